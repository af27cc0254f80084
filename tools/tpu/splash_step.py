"""`python -m tools.tpu.splash_step`: SD3.5-Medium's step with the splash kernel reading its
keys in blocks of another size, timed beside the library's on one accelerator.

The library's splash kernel pads each sequence to a multiple of `attention_chunk` (512),
takes the queries and computes the scores 512 at a time, and reads the keys in blocks of up
to 1,536 (`_splash.KEY_BLOCK_LIMIT`). `tools/tpu/splash_blocks.py` measured on a TPU v5e
(`docs/accelerators.md`) that at SD3.5-Medium's joint shape reading all 1,536 padded keys in
one block, in place of 512 at a time, makes the attention's forward 15% faster and its value
and gradient 14%; this command measured what that is worth in the whole step, which made it
the library's. Each variant keeps the library's padding and computing blocks and reads the
keys in blocks of the computing block (`keys_by_block`, the library's before) or of the whole
padded sequence (`keys_whole`, whatever its length: at SD3.5's 1,357 and 1,024 tokens it is
the library's; at 4,608 tokens of 128-wide heads it overflows the kernel's on-chip memory),
or in the library's blocks held head-dim-minor (`keys_head_dim_minor`, the kernel's default
layout: the library holds them sequence-minor, the sweep's fastest forward, which this
command measured 0.3-0.6% faster in the steps of SD3.5-Medium, FLUX.1 and Wan 2.1). A
variant is not the library's until it is faster here, and then with its own tests.

    bash tools/tpu/run.sh python -m tools.tpu.splash_step [--row ROW] [--calls 5] [--profile]
        [--variants NAME,...]

Prints one JSON object: the bench's measurement of the row (`bench._full_size.measure`)
under each variant, in one process. Compare the variants' `ms`.
"""

import dataclasses
import functools
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal, TypeAlias

from flowgrpo_eqx.models import _splash
from tools.tpu._compare import compare, swapped


MaskMaker = Callable[[int, int, int, int], tuple[Any, Any, int, int]]
"""`_splash._mask`'s signature: queries, keys, heads and block to the multi-head mask, the
kernel's block sizes and the padded lengths of the queries and the keys."""

KeyBlocks: TypeAlias = Literal["by_block", "whole", "head_dim_minor"]
"""How a variant reads the keys: in blocks of the computing block, all in one block (both in
the library's sequence-minor layout, `[heads, head_dim, S]`), or in the library's blocks laid
out head-dim-minor (`[heads, S, head_dim]`, the kernel's default: each block's scores
transpose it)."""


def keys_read(library: MaskMaker, blocks: KeyBlocks) -> MaskMaker:
    """A replacement for `_splash._mask` (`library`): the same mask, padding and computing
    blocks, with the kernel's key blocks, forward and backward, of the computing block's
    size (`"by_block"`) or of all the padded keys (`"whole"`), or the library's key blocks
    with the keys laid out head-dim-minor (`"head_dim_minor"`)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as kernel_lib,
    )

    @functools.lru_cache(maxsize=64)
    def mask(queries: int, keys: int, heads: int, block: int) -> tuple[Any, Any, int, int]:
        heads_mask, sizes, padded_q, padded_kv = library(queries, keys, heads, block)
        if blocks == "head_dim_minor":
            replaced = dataclasses.replace(sizes, k_layout=kernel_lib.QKVLayout.HEAD_DIM_MINOR)
        else:
            read = sizes.block_kv_compute if blocks == "by_block" else padded_kv
            replaced = dataclasses.replace(sizes, block_kv=read, block_kv_dkv=read)
        return heads_mask, replaced, padded_q, padded_kv

    return mask


@contextmanager
def key_blocks(blocks: KeyBlocks | None) -> Iterator[None]:
    """Within the block, the library's splash attention reads its keys as `blocks` says
    (`keys_read`); `None`: as the library does."""
    variant = None if blocks is None else keys_read(_splash._mask, blocks)
    with swapped([_splash], "_mask", variant):
        yield


VARIANTS: dict[str, KeyBlocks | None] = {
    "library": None,
    "keys_by_block": "by_block",
    "keys_whole": "whole",
    "keys_head_dim_minor": "head_dim_minor",
}
"""The variants, by name: `key_blocks`'s argument."""


def main(argv: list[str] | None = None) -> int:
    variants = {name: functools.partial(key_blocks, value) for name, value in VARIANTS.items()}
    return compare("python -m tools.tpu.splash_step", __doc__ or "", variants, argv)


if __name__ == "__main__":
    sys.exit(main())
