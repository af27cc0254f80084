"""Property tests of the reward server's wire format: exact round trips, and no input that
makes the decoder fail other than with a named `WireError`."""

import io
import json
import struct

import numpy as np
from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp

from flowgrpo_eqx.rewards._wire import MAGIC, WireError, decode_request, encode_request


_count = st.integers(1, 5)
_dtypes = st.sampled_from([np.float32, np.float64, np.int32, np.uint8, np.bool_, "<U7"])


@st.composite
def _batches(draw: st.DrawFn) -> tuple[np.ndarray, dict[str, object]]:
    count = draw(_count)
    samples = draw(
        hnp.arrays(draw(st.sampled_from([np.float32, np.float64])), (count, 2, 3), elements=None)
    )
    keys = draw(st.lists(st.text("abcxyz_", min_size=1, max_size=4), max_size=3, unique=True))
    rows: dict[str, object] = {}
    for key in keys:
        # At least one element: an empty array is refused (its axes would be unbounded).
        leaf = hnp.arrays(draw(_dtypes), (count, draw(st.integers(1, 3))))
        rows[key] = {"inner": draw(leaf)} if draw(st.booleans()) else draw(leaf)
    return samples, rows


def _same(got: object, want: object) -> bool:
    if isinstance(want, dict):
        return (
            isinstance(got, dict)
            and got.keys() == want.keys()
            and all(_same(got[k], want[k]) for k in want)
        )
    assert isinstance(got, np.ndarray) and isinstance(want, np.ndarray)
    return got.dtype == want.dtype and got.shape == want.shape and got.tobytes() == want.tobytes()


@given(_batches())
def test_round_trip_is_bit_exact(batch: tuple[np.ndarray, dict[str, object]]) -> None:
    samples, rows = batch
    got_samples, got_rows = decode_request(encode_request(samples, rows))
    assert _same(got_samples, samples)  # NaN payloads and -0.0 included
    assert _same(got_rows, rows)


@given(hnp.arrays(np.uint8, st.tuples(_count, st.just(3), st.just(2), st.just(3))))
def test_uint8_images_come_back_on_the_float32_grid(levels: np.ndarray) -> None:
    want = (levels.astype(np.float64) / 127.5 - 1.0).astype(np.float32)
    got, _ = decode_request(encode_request(want, None, images_as_uint8=True))
    assert got.dtype == np.float32 and np.array_equal(got, want)


@settings(max_examples=300)
@given(st.data())
def test_damaged_bodies_fail_only_with_wire_error(data: st.DataObject) -> None:
    count = data.draw(_count)
    body = bytearray(
        encode_request(np.zeros((count, 2), np.float32), {"a": {"b": np.arange(count)}})
    )
    for _ in range(data.draw(st.integers(1, 4))):
        position = data.draw(st.integers(0, len(body) - 1))
        body[position] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(body)))
    damaged = bytes(body[:cut]) + data.draw(st.binary(max_size=8))
    try:
        decode_request(damaged)
    except WireError as error:
        assert error.kind in ("malformed_body", "pickled_array", "unsupported_dtype")


@given(st.binary(max_size=64))
def test_arbitrary_bytes_after_the_magic_fail_only_with_wire_error(tail: bytes) -> None:
    try:
        decode_request(MAGIC + tail)
    except WireError as error:
        assert error.kind == "malformed_body"


def test_uint8_levels_decode_to_the_nearest_float32() -> None:
    levels = np.arange(256, dtype=np.uint8).reshape(256, 1, 1, 1)
    got, _ = decode_request(encode_request(levels / 127.5 - 1.0, None, images_as_uint8=True))
    exact = (2.0 * np.arange(256) - 255.0) / 255.0  # one rounding, in float64
    got = got.reshape(-1)
    error = np.abs(got.astype(np.float64) - exact)
    for neighbour in (np.nextafter(got, np.float32(-2)), np.nextafter(got, np.float32(2))):
        assert np.all(error <= np.abs(neighbour.astype(np.float64) - exact))


@given(
    st.lists(st.integers(0, 2**40), min_size=1, max_size=4),
    st.sampled_from(["<f4", "<f8", "|u1", "<i8"]),
    st.integers(0, 256),
)
def test_npy_headers_must_match_their_bytes(shape: list[int], descr: str, length: int) -> None:
    # A header may claim any shape; only one that describes exactly the bytes that follow,
    # and at least one element, is read, and none makes the decoder allocate what it claims.
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        header, {"descr": descr, "fortran_order": False, "shape": tuple(shape)}
    )
    blob = header.getvalue() + bytes(length)
    claimed = int(np.prod(shape, dtype=object)) * np.dtype(descr).itemsize
    try:
        samples, _ = decode_request(_container_with_samples(blob))
    except WireError as error:
        assert error.kind == "malformed_body"
        # ...or numpy itself cannot describe it (empty, but its other axes overflow).
        nominal = int(np.prod([axis for axis in shape if axis], dtype=object))
        assert claimed != length or claimed == 0 or nominal * np.dtype(descr).itemsize >= 2**63
    else:
        assert claimed == length > 0 and samples.shape == tuple(shape)


def _container_with_samples(blob: bytes) -> bytes:
    header = json.dumps({"samples": "float", "rows": "none", "arrays": [["samples", len(blob)]]})
    return MAGIC + struct.pack("<I", len(header)) + header.encode() + blob
