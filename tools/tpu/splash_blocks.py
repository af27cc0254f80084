"""`python -m tools.tpu.splash_blocks`: the splash kernel's block sizes, swept at one joint
attention's shape.

The library's splash kernel (`attention_chunk`, 512) pads each sequence to a multiple of 512,
takes the queries 512 at a time and computes the scores 512 keys at a time, forward and in the
fused backward; it reads the keys in blocks of up to 1,536 (`_splash.KEY_BLOCK_LIMIT`), which
this sweep chose (`docs/accelerators.md`): before, it read them 512 at a time (`blocks512`).
It holds the keys sequence-minor, the sweep's fastest forward (`kv_whole_keys_seq_minor`);
`kv_whole` is the same blocks in the kernel's default layout.
SD3.5-Medium's joint sequence at 512² is 1,357 tokens, padded to 1,536, so 22% of the scores
are of padding; its heads are 64 wide.

This tool times the library's `splash_attention` (its transposes, padding and kernel, as a
model calls it, over a batch) with the kernel's block sizes swapped for each variant's,
forward and backward, and checks that each variant computes what the library's blocks
compute. A variant is not the library's until it is faster in the whole step, and then with
its own tests.

    bash tools/tpu/run.sh python -m tools.tpu.splash_blocks [--shape 8,1357,24,64]
        [--rounds 20] [--variants NAME,...] [--plot PNG]
    python -m tools.tpu.splash_blocks --from-record RECORD.json --plot PNG

Prints one JSON object: per variant its block sizes, padded lengths, milliseconds per call
of the forward and of the value and gradient (median of interleaved rounds, with quartiles),
and the largest difference of its output and gradient from the library's; a variant the
kernel's compiler refuses gets its error instead. Progress goes to stderr. `--plot` draws
the medians and quartiles as a PNG, of this sweep or, with `--from-record`, of a record
(the JSON an earlier sweep printed), anywhere.
"""

import argparse
import contextlib
import dataclasses
import functools
import json
import math
import sys
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flowgrpo_eqx.models import _splash
from tools.tpu._compare import chosen_variants, swapped


@dataclasses.dataclass(frozen=True)
class Blocks:
    """The splash kernel's block sizes (`BlockSizes`), each a multiple of 128.

    - `q`, `kv`, `kv_compute`: the forward's blocks of queries and keys, and of keys per
        product of scores.
    - `q_dkv`, `kv_dkv`, `kv_dkv_compute`: the fused backward's (with `fused_backward`
        off, the keys' and values' backward; the queries' takes `q` and `kv`).
    - `pad_to`: pad both sequences to a multiple of this, not of the blocks (every block
        must divide the padded length); `None`: the least multiple of every block.
    - `keys_seq_minor`: the kernel holds the keys as `[head_dim, S]` (its `SEQ_MINOR`
        layout: the scores are then a plain product, not one with the keys transposed).
    - `fused_backward`: one backward kernel for every gradient (the library's), or one for
        the queries' and another for the keys' and values'.
    """

    q: int
    kv: int
    kv_compute: int
    q_dkv: int
    kv_dkv: int
    kv_dkv_compute: int
    pad_to: int | None = None
    keys_seq_minor: bool = False
    fused_backward: bool = True

    def padded(self, length: int, blocks: tuple[int, ...]) -> int:
        """`length` padded to a multiple of every one of `blocks` (and of `pad_to`)."""
        multiple = math.lcm(*blocks, *(() if self.pad_to is None else (self.pad_to,)))
        return -(-length // multiple) * multiple


VARIANTS: dict[str, Blocks | None] = {
    "library": None,
    "kv_whole": Blocks(512, 1536, 512, 512, 1536, 512),
    "kv_whole_compute_whole": Blocks(512, 1536, 1536, 512, 1536, 1536),
    "q_whole": Blocks(1536, 512, 512, 1536, 512, 512),
    "q256": Blocks(256, 512, 512, 256, 512, 512),
    "q256_kv_whole": Blocks(256, 1536, 512, 256, 1536, 512),
    "compute256": Blocks(512, 512, 256, 512, 512, 256),
    "backward1024": Blocks(512, 512, 512, 1024, 1024, 512, pad_to=1024),
    "pad1408_whole": Blocks(1408, 1408, 1408, 1408, 1408, 1408),
    "pad1408_q128": Blocks(128, 1408, 1408, 128, 1408, 1408),
    "whole": Blocks(1536, 1536, 512, 1536, 1536, 512),
    "blocks512": Blocks(512, 512, 512, 512, 512, 512),
    "q768_kv_whole": Blocks(768, 1536, 512, 768, 1536, 512),
    "kv_whole_keys_seq_minor": Blocks(512, 1536, 512, 512, 1536, 512, keys_seq_minor=True),
    "kv_whole_unfused_backward": Blocks(512, 1536, 512, 512, 1536, 512, fused_backward=False),
}
"""The variants, by name; `library` (`None`) is the library's own `_splash._mask`: at
SD3.5's shape, queries in blocks of 512 and keys in one block of 1,536, scored 512 at a time
and held sequence-minor (`kv_whole_keys_seq_minor`); `blocks512` is the library's blocks
before the sweep, `kv_whole` the library's blocks in the kernel's default layout. The last
three try those blocks with other queries' blocks, layout of the keys or backward kernels
(measured on a TPU v5e: `docs/accelerators.md`). `pad1408_whole` and `whole` do not fit that chip's
scoped VMEM."""


def blocked_mask(blocks: Blocks) -> Callable[[int, int, int, int], tuple[Any, Any, int, int]]:
    """A replacement for `_splash._mask` with `blocks` in place of the library's blocks:
    the multi-head mask over the padded lengths (padded keys masked), the kernel's block
    sizes, and the padded lengths of the queries and the keys."""
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as kernel_lib,
    )

    layout = kernel_lib.QKVLayout

    @functools.lru_cache(maxsize=16)
    def mask(queries: int, keys: int, heads: int, block: int) -> tuple[Any, Any, int, int]:
        padded_q = blocks.padded(queries, (blocks.q, blocks.q_dkv))
        padded_kv = blocks.padded(
            keys, (blocks.kv, blocks.kv_compute, blocks.kv_dkv, blocks.kv_dkv_compute)
        )
        sizes = kernel_lib.BlockSizes(
            block_q=blocks.q,
            block_kv=blocks.kv,
            block_kv_compute=blocks.kv_compute,
            block_q_dkv=blocks.q_dkv,
            block_kv_dkv=blocks.kv_dkv,
            block_kv_dkv_compute=blocks.kv_dkv_compute,
            block_q_dq=None if blocks.fused_backward else blocks.q,
            block_kv_dq=None if blocks.fused_backward else blocks.kv,
            use_fused_bwd_kernel=blocks.fused_backward,
            k_layout=layout.SEQ_MINOR if blocks.keys_seq_minor else layout.HEAD_DIM_MINOR,
        )
        heads_mask = _splash.padded_keys_mask(padded_q, padded_kv, keys, heads)
        return heads_mask, sizes, padded_q, padded_kv

    return mask


@contextlib.contextmanager
def kernel_blocks(blocks: Blocks | None) -> Iterator[None]:
    """Within the block, the library's splash attention runs with `blocks` (`None`: its
    own)."""
    with swapped([_splash], "_mask", None if blocks is None else blocked_mask(blocks)):
        yield


def _programs(block: int) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """The forward and the value-and-gradient of the library's splash attention over a batch
    of `[S, heads, head_dim]` examples (the gradient of the output against a cotangent)."""
    attend = jax.vmap(functools.partial(_splash.splash_attention, block=block))

    def loss(q: jax.Array, k: jax.Array, v: jax.Array, cotangent: jax.Array) -> jax.Array:
        return jnp.sum(attend(q, k, v).astype(jnp.float32) * cotangent)

    return jax.jit(attend), jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def inputs(shape: tuple[int, int, int, int], dtype: Any) -> tuple[jax.Array, ...]:
    """Random queries, keys, values and a cotangent, `[batch, S, heads, head_dim]`."""
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v = (jax.random.normal(key, shape).astype(dtype) for key in keys[:3])
    return q, k, v, jax.random.normal(keys[3], shape, jnp.float32)


def _described(blocks: Blocks | None) -> dict[str, Any] | str:
    return "the library's" if blocks is None else dataclasses.asdict(blocks)


def _largest_difference(got: Any, want: Any) -> float:
    pairs = zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
    return max(
        float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))
        for a, b in pairs
    )


def sweep(
    names: list[str],
    shape: tuple[int, int, int, int],
    rounds: int,
    dtype: Any = jnp.bfloat16,
    block: int = 512,
) -> dict[str, Any]:
    """Compile and time each variant of `names`, and compare it with `library`'s results.

    **Arguments:**

    - `names`: variants of `VARIANTS` (`library` is measured first whether named or not).
    - `shape`: `[batch, S, heads, head_dim]`.
    - `rounds`: timed rounds (every variant once per round, in a rotated order).
    - `dtype`: the queries', keys' and values' dtype.
    - `block`: the library's `attention_chunk`, for the variants that keep it.

    **Returns:**

    Per variant: `blocks`, `padded` (queries, keys), `forward_ms` and `gradient_ms`
    (`bench._timing.summary` of milliseconds), `max_difference` (output, loss and gradients
    against `library`'s); or `error` where compiling or running it failed.
    """
    from bench._timing import interleave, log, summary

    args = inputs(shape, dtype)
    report: dict[str, Any] = {}
    calls: dict[str, Callable[[], Any]] = {}
    reference: tuple[Any, Any] | None = None
    for name in ["library", *(n for n in names if n != "library")]:
        blocks = VARIANTS[name]
        log(f"splash blocks: {name} {blocks}")
        try:
            with kernel_blocks(blocks):
                forward, gradient = _programs(block)
                forward_call = forward.lower(*args[:3]).compile()
                gradient_call = gradient.lower(*args).compile()
                _, _, padded_q, padded_kv = _splash._mask(shape[1], shape[1], shape[2], block)
            results = (forward_call(*args[:3]), gradient_call(*args))
        except Exception as error:  # the kernel's compiler refuses block sizes it cannot tile
            report[name] = {"blocks": _described(blocks), "error": repr(error)[:600]}
            continue
        reference = results if reference is None else reference
        report[name] = {
            "blocks": _described(blocks),
            "padded": [padded_q, padded_kv],
            "max_difference": _largest_difference(results, reference),
        }
        calls[f"{name}/forward"] = functools.partial(forward_call, *args[:3])
        calls[f"{name}/gradient"] = functools.partial(gradient_call, *args)
    timings = interleave(calls, rounds)
    for key, seconds in timings.wall.items():
        name, program = key.split("/")
        report[name][f"{program}_ms"] = summary(np.asarray(seconds) * 1e3, 3)
    return report


def plot(report: dict[str, Any], path: str) -> None:
    """Draw a sweep's `report` (`main`'s JSON) as a PNG at `path`: per variant, the median
    milliseconds of the forward and of the value and gradient, with their quartiles, and the
    variants that failed named as such.

    **Raises:**

    - `ValueError`: naming the record's part that is missing or not a sweep's.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = report.get("variants")
    if not isinstance(variants, dict) or not variants:
        raise ValueError("the record has no `variants` of a sweep")
    names = list(variants)
    figure, axis = plt.subplots(figsize=(8, 0.45 * len(names) + 1.5), dpi=100)
    rows = np.arange(len(names))
    for offset, (program, label) in enumerate(
        [("forward_ms", "forward"), ("gradient_ms", "value and gradient")]
    ):
        medians, spans = [], []
        for name in names:
            times = variants[name].get(program)
            if times is None and "error" not in variants[name]:
                raise ValueError(f"the record's variant {name!r} has neither {program} nor error")
            times = times or {"median": np.nan, "p25": np.nan, "p75": np.nan}
            medians.append(times["median"])
            spans.append((times["median"] - times["p25"], times["p75"] - times["median"]))
        axis.barh(
            rows + 0.4 * offset - 0.2,
            medians,
            height=0.4,
            xerr=np.asarray(spans).T,
            label=label,
        )
    for row, name in enumerate(names):
        if "error" in variants[name]:
            axis.text(0, row, " failed (its error is in the record)", va="center", fontsize=8)
    axis.set_yticks(rows, names)
    axis.invert_yaxis()
    axis.set_xlabel("ms per call (median of interleaved rounds; bars: quartiles)")
    shape = "x".join(str(size) for size in report.get("shape", []))
    axis.set_title(f"splash attention's blocks, {shape} on {report.get('device', '?')}")
    axis.grid(axis="x", alpha=0.3)
    figure.legend(loc="lower center", ncol=2, frameon=False)
    figure.tight_layout(rect=(0, 0.05, 1, 1))
    figure.savefig(path)
    plt.close(figure)


def _shape(text: str) -> tuple[int, int, int, int]:
    sizes = tuple(int(part) for part in text.split(","))
    if len(sizes) != 4 or min(sizes) < 1:
        raise ValueError(f"four positive sizes batch,S,heads,head_dim, got {text!r}")
    return sizes  # type: ignore[return-value]


def main(argv: list[str] | None = None) -> int:
    """The command line (the module's docstring). Returns 0; a bad argument exits with
    argparse's usage error, naming it."""
    parser = argparse.ArgumentParser(
        prog="python -m tools.tpu.splash_blocks",
        description=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--shape", default="8,1357,24,64", help="batch,S,heads,head_dim")
    parser.add_argument("--rounds", type=int, default=20, help="timed rounds (20)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="names, comma-separated")
    parser.add_argument("--plot", metavar="PNG", help="draw the sweep as a PNG")
    parser.add_argument(
        "--from-record", metavar="JSON", help="plot this record of a sweep, measuring nothing"
    )
    args = parser.parse_args(argv)
    if args.from_record is not None:
        if args.plot is None:
            parser.error("--from-record draws a record: give --plot PNG")
        try:
            with open(args.from_record) as handle:
                plot(json.load(handle), args.plot)
        except (OSError, ValueError, KeyError, TypeError) as error:
            parser.error(f"--from-record: {args.from_record}: {error!r}")
        return 0
    try:
        shape = _shape(args.shape)
    except ValueError as error:
        parser.error(f"--shape: {error}")
    if args.rounds < 1:
        parser.error(f"--rounds must be a positive number, got {args.rounds}")
    names = chosen_variants(parser, args.variants, VARIANTS)
    device = jax.devices()[0]
    report = {
        "jax": jax.__version__,
        "device": device.device_kind,
        "shape": list(shape),
        "variants": sweep(names, shape, args.rounds),
    }
    print(json.dumps(report, indent=1))
    if args.plot is not None:
        plot(report, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
