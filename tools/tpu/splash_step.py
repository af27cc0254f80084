"""`python -m tools.tpu.splash_step`: SD3.5-Medium's step with the splash kernel reading each
attention's keys in one block, timed beside the library's on one accelerator.

The library's splash kernel takes queries and keys in blocks of `attention_chunk` (512) and
computes the scores 512 keys at a time. `tools/tpu/splash_blocks.py` measured on a TPU v5e
(`docs/accelerators.md`) that at SD3.5-Medium's joint shape one block holding all the padded
keys (`kv_whole`: 1,536), the scores still computed 512 keys at a time, makes the attention's
forward 15% faster and its value and gradient 14%; the queries in one block too (`whole`)
is the other candidate. Here each variant keeps the library's padding (a multiple of the
block) and takes its key blocks (`keys_whole`), or its query and key blocks (`whole`), as
long as the padded sequence, whatever the attention's length (the joint attention's 1,357
tokens and the image's own 1,024), so the whole step shows what the kernel's blocks are
worth. It is not the library's until it is faster here, and then with its own tests.

    bash tools/tpu/run.sh python -m tools.tpu.splash_step [--row ROW] [--calls 5] [--profile]

Prints one JSON object: the bench's measurement of the row (`bench._full_size.measure`)
under each variant, in one process. Compare the variants' `ms`.
"""

import dataclasses
import functools
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from flowgrpo_eqx.models import _splash
from tools.tpu._compare import compare, swapped


MaskMaker = Callable[[int, int, int, int], tuple[Any, Any, int, int]]
"""`_splash._mask`'s signature: queries, keys, heads and block to the multi-head mask, the
kernel's block sizes and the padded lengths of the queries and the keys."""


def rows_in_one_block(library: MaskMaker, queries_too: bool) -> MaskMaker:
    """A replacement for `_splash._mask` (`library`): the same mask and padding, with the
    kernel's key blocks, forward and backward, as long as the padded keys (and its query
    blocks as long as the padded queries when `queries_too`); the scores are still computed
    `block` keys at a time."""

    @functools.lru_cache(maxsize=64)
    def mask(queries: int, keys: int, heads: int, block: int) -> tuple[Any, Any, int, int]:
        heads_mask, sizes, padded_q, padded_kv = library(queries, keys, heads, block)
        block_q = padded_q if queries_too else sizes.block_q
        whole = dataclasses.replace(
            sizes, block_q=block_q, block_q_dkv=block_q, block_kv=padded_kv, block_kv_dkv=padded_kv
        )
        return heads_mask, whole, padded_q, padded_kv

    return mask


@contextmanager
def one_block(queries_too: bool | None) -> Iterator[None]:
    """Within the block, the library's splash attention reads its keys (and, when
    `queries_too`, its queries) in one block each (`rows_in_one_block`); `None`: the
    library's blocks."""
    variant = None if queries_too is None else rows_in_one_block(_splash._mask, queries_too)
    with swapped([_splash], "_mask", variant):
        yield


VARIANTS: dict[str, bool | None] = {"library": None, "keys_whole": False, "whole": True}
"""The variants, by name: `one_block`'s `queries_too`."""


def main(argv: list[str] | None = None) -> int:
    variants = {name: functools.partial(one_block, value) for name, value in VARIANTS.items()}
    return compare("python -m tools.tpu.splash_step", __doc__ or "", variants, argv)


if __name__ == "__main__":
    sys.exit(main())
