"""Property tests of the reward server's chunked scoring: a request scored in chunks of rows
(`--score-chunk-bytes`) gets, bit for bit, the scores of the whole request scored at once by
a reward that scores sample by sample, whatever the chunk, the rows and the samples' wire
type; and the host rewards' block-wise conversion to uint8 images is the whole one."""

import numpy as np
from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp

from flowgrpo_eqx.rewards import _reward
from flowgrpo_eqx.rewards._reward import score, to_uint8_images
from flowgrpo_eqx.rewards._server_requests import score_decoded
from flowgrpo_eqx.rewards._wire import encode_request, parse_request


def _per_sample(samples: np.ndarray, rows: dict[str, np.ndarray]) -> np.ndarray:
    """A reward of each sample alone: its mean, its row's offset, and its prompt's length."""
    flat = np.asarray(samples, np.float64).reshape(samples.shape[0], -1)
    lengths = np.char.str_len(rows["meta"]["prompt"]).astype(np.float64)
    return flat.mean(axis=1) + rows["offset"] + 0.01 * lengths


@st.composite
def _requests(draw: st.DrawFn) -> tuple[np.ndarray, dict[str, object], bool, int]:
    count = draw(st.integers(1, 40))
    side = draw(st.integers(1, 4))
    samples = draw(
        hnp.arrays(np.float32, (count, side, side, 3), elements=st.floats(-1, 1, width=32))
    )
    rows = {
        "offset": draw(hnp.arrays(np.float64, count, elements=st.floats(-5, 5))),
        "meta": {"prompt": np.array([f"p{'x' * (i % 5)}" for i in range(count)])},
    }
    uint8 = draw(st.booleans())
    chunk = draw(st.integers(1, 4 * side * side * 3 * count + 64))
    return samples, rows, uint8, chunk


@settings(max_examples=60, deadline=None)
@given(_requests())
def test_a_request_scored_in_chunks_is_scored_as_it_would_be_whole(
    request: tuple[np.ndarray, dict[str, object], bool, int],
) -> None:
    samples, rows, uint8, chunk = request
    body = encode_request(samples, rows, images_as_uint8=uint8)
    parsed = parse_request(np.frombuffer(body, np.uint8).copy())
    whole = score(_per_sample, *parsed.decoded())
    chunked = score_decoded(_per_sample, parsed, chunk)
    assert chunked.dtype == np.float64 and chunked.tobytes() == whole.tobytes()


@settings(max_examples=40, deadline=None)
@given(
    hnp.arrays(
        np.float32,
        st.tuples(
            st.integers(1, 12), st.integers(1, 5), st.integers(1, 5), st.sampled_from([1, 3])
        ),
        elements=st.floats(-2, 2, width=32),
    ),
    st.integers(1, 400),
)
def test_block_wise_uint8_images_are_the_whole_conversion(
    samples: np.ndarray, block_bytes: int
) -> None:
    want = np.round((np.clip(samples.astype(np.float64), -1, 1) + 1) * 127.5).astype(np.uint8)
    saved = _reward._BLOCK_BYTES
    _reward._BLOCK_BYTES = block_bytes
    try:
        got = to_uint8_images(samples)
    finally:
        _reward._BLOCK_BYTES = saved
    assert got.dtype == np.uint8 and np.array_equal(got, want)
