"""`python -m tools.tpu.norm_variants`: SD3.5-Medium's step with its query-key RMSNorm
computed another way, timed beside the library's on one accelerator.

The library's per-head RMSNorm of the queries and keys (`head_rms_norm`) works on the
`[S, heads x head_dim]` layout the projections give: each head's sum of squares, and the
spreading of its scale back over its features, are products with a block-diagonal 0/1
matrix. The form it replaced, `split_heads`, reduces `[S, heads, head_dim]` over its last
axis (`rms_norm` on `[S, 24, 64]`); on a TPU v5e it took 128 ms of the
1,136 ms step of `sd35m b8 splash nothing` against the library's 43 ms of 1,024
(docs/accelerators.md). This keeps the choice measurable on another chip.

    bash tools/tpu/run.sh python -m tools.tpu.norm_variants [--row ROW] [--calls 5] [--profile]

Prints one JSON object: the bench's measurement of the row (`bench._full_size.measure`) with
the library's norm and with each variant, in one process (`--profile` adds each one's device
profile, with the time by the function that made the ops). Compare the variants' `ms`.
"""

import functools
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager

import jax

from flowgrpo_eqx.models import _joint
from flowgrpo_eqx.models._layers import rms_norm
from tools.tpu._compare import compare, swapped


VARIANTS: dict[str, Callable[..., jax.Array] | None] = {
    "library": None,
    "split_heads": rms_norm,
}
"""The norms to time: `None` for the library's own."""


def joint_attention_norm(norm: Callable[..., jax.Array] | None) -> AbstractContextManager[None]:
    """Within the block, the joint attention's query-key norm (MMDiT's and FLUX's) is `norm`
    (the library's when `None`), put back after."""
    return swapped([_joint], "head_rms_norm", norm)


def main(argv: list[str] | None = None) -> int:
    variants = {
        name: functools.partial(joint_attention_norm, norm) for name, norm in VARIANTS.items()
    }
    return compare("python -m tools.tpu.norm_variants", __doc__ or "", variants, argv)


if __name__ == "__main__":
    sys.exit(main())
