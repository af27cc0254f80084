"""Properties of the splash kernel's block sizes (`models/_splash.py`), over any sequence
lengths and blocks: the keys are read in the largest block the rule allows (found here by
trying every multiple of the block), and the kernel's blocks tile sequences padded to a
multiple of the block and no further."""

from hypothesis import given, strategies as st

import flowgrpo_eqx.testing as T
from flowgrpo_eqx.models import _splash


BLOCKS = st.sampled_from([128, 256, 384, 512, 1024, 2048])


@T.property_settings(60)
@given(blocks=st.integers(1, 200), block=BLOCKS)
def test_the_keys_are_read_in_the_largest_dividing_multiple_of_the_block_up_to_the_limit(
    blocks: int, block: int
) -> None:
    padded = blocks * block
    allowed = [
        read
        for read in range(block, padded + 1, block)
        if padded % read == 0 and read <= max(_splash.KEY_BLOCK_LIMIT, block)
    ]
    assert _splash._key_block(padded, block) == max(allowed)


@T.property_settings(60)
@given(queries=st.integers(1, 3000), keys=st.integers(1, 3000), block=BLOCKS)
def test_the_kernels_blocks_tile_the_least_padding(queries: int, keys: int, block: int) -> None:
    _, sizes, padded_q, padded_kv = _splash._mask(queries, keys, 1, block)
    scored = min(block, -(-keys // 128) * 128)
    assert 0 <= padded_kv - keys < scored and padded_kv % scored == 0
    assert 0 <= padded_q - queries < sizes.block_q and padded_q % sizes.block_q == 0
    assert sizes.block_kv_compute == sizes.block_kv_dkv_compute == scored
    assert sizes.block_kv == sizes.block_kv_dkv == _splash._key_block(padded_kv, scored)
    assert sizes.block_q == sizes.block_q_dkv
    for size in (sizes.block_q, sizes.block_kv, scored):
        assert size % _splash.LANES == 0
