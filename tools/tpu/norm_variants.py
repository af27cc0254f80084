"""`python -m tools.tpu.norm_variants`: SD3.5-Medium's step with its query-key RMSNorm
computed another way, timed beside the library's on one accelerator.

The profile of `sd35m b8 splash nothing` on a TPU v5e gives 128 ms of its 1,136 to the
per-head RMSNorm of the queries and keys (`rms_norm` on `[S, 24, 64]`: 44 ms of it the cast
to float32, copied into another layout; `tools/tpu/op_sources.py`, docs/accelerators.md).
FLUX.1's heads are 128 wide and Wan 2.1 normalises the whole `[S, 1536]` row; both steps
reach 0.43 to 0.44 MFU there.
`lane_dense_head_rms_norm` computes the same function without splitting the 64-wide heads
apart: each head's sum of squares and the spreading of its scale back over its 64 features
are products with a block-diagonal 0/1 matrix at `"highest"` precision, on the row's
`[S, heads x head_dim]` layout. Whether that is faster is what this measures; it is not the
library's until it is, and then with its own tests against diffusers.

    bash tools/tpu/run.sh python -m tools.tpu.norm_variants [--row ROW] [--calls 5] [--profile]

Prints one JSON object: the bench's measurement of the row (`bench._full_size.measure`) with
the library's norm and with the variant, in one process (`--profile` adds each one's device
profile, with the time by the function that made the ops). Compare the variants' `ms`: the
variant's own small products count in its `model_tflop_per_step`, and so in its `mfu`.
"""

import argparse
import contextlib
import json
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp


def lane_dense_head_rms_norm(h: jax.Array, weight: jax.Array, eps: float = 1e-6) -> jax.Array:
    """The per-head RMSNorm of `h`, `[S, heads, head_dim]`, with `weight`, `[head_dim]`, as
    `flowgrpo_eqx.models._layers.rms_norm` computes it (statistics and scaling in float32,
    then the weight in its dtype), on the `[S, heads x head_dim]` layout."""
    seq, heads, dim = h.shape
    flat = h.reshape(seq, heads * dim).astype(jnp.float32)
    groups = (jnp.arange(heads * dim)[:, None] // dim == jnp.arange(heads)[None, :]).astype(
        jnp.float32
    )
    highest = jax.lax.Precision.HIGHEST
    mean_square = jnp.dot(flat * flat, groups, precision=highest) / dim
    scale = jnp.dot(jax.lax.rsqrt(mean_square + eps), groups.T, precision=highest)
    normed = (flat * scale).astype(weight.dtype) * jnp.tile(weight, heads)[None, :]
    return normed.reshape(seq, heads, dim)


VARIANTS: dict[str, Callable[..., jax.Array] | None] = {
    "library": None,
    "lane_dense": lane_dense_head_rms_norm,
}
"""The norms to time: `None` for the library's own."""


@contextlib.contextmanager
def joint_attention_norm(norm: Callable[..., jax.Array] | None) -> Iterator[None]:
    """Within the block, the joint attention's query-key norm (MMDiT's and FLUX's) is `norm`
    (the library's when `None`): the experiment swaps the name the module looks up when a
    model is traced, and puts it back."""
    from flowgrpo_eqx.models import _joint

    library = _joint.rms_norm
    _joint.rms_norm = library if norm is None else norm  # type: ignore[assignment]
    try:
        yield
    finally:
        _joint.rms_norm = library


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.tpu.norm_variants",
        description=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--row", default="sd35m b8 splash nothing", help="a full-size row")
    parser.add_argument("--calls", type=int, default=5, help="timed calls per variant (5)")
    parser.add_argument("--profile", action="store_true", help="profile each variant too")
    args = parser.parse_args(argv)
    if args.calls < 1:
        parser.error(f"--calls must be a positive number, got {args.calls}")
    from bench import _full_size as full_size

    try:
        (row,) = full_size.rows(args.row)
    except ValueError as error:
        parser.error(f"--row: {error}")
    device = jax.devices()[0]
    peak = full_size.device_peak_tflops(device)
    report: dict[str, Any] = {"jax": jax.__version__, "device": device.device_kind}
    for name, norm in VARIANTS.items():
        folder = tempfile.mkdtemp(prefix=f"flowgrpo-{name}-") if args.profile else None
        with joint_attention_norm(norm):
            report[name] = full_size.measure(row, args.calls, None, peak, folder)
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
