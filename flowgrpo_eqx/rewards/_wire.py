"""The reward server's wire format, shared by the client (`HttpReward`) and the server.

A scoring request (`CONTENT_TYPE`) is the bytes `MAGIC`, a little-endian uint32 header length,
a UTF-8 JSON header, then the `.npy` blobs (`np.save(..., allow_pickle=False)`) the header
lists in order:

    {"samples": "float" | "uint8", "rows": "none" | "array" | "dict",
     "arrays": [["samples", nbytes], ["rows/prompt", nbytes], ...]}

`samples` comes first; rows follow as one blob per leaf, nested dict keys joined by `/`
(`"rows"` alone for rows that are one array). The reply to a scoring request is one `.npy`
float64 array `[N]` (`NPY_CONTENT_TYPE`); an error reply is JSON
`{"error": kind, "message": text}`, with `"limit": setting` added when one of the server's
limits refused the request.

Samples must be real numbers: a float or integer dtype (`SAMPLE_KINDS`); rows may also be
bool or fixed-width strings (`ROWS_KINDS`). Complex, datetime, timedelta, structured and
object arrays are refused by name (`"unsupported_dtype"`; object arrays as
`"pickled_array"`), and so are arrays that hold no element (a shape with a 0 axis): every
array must then hold at least one element, so each axis of each declared shape is at most the
body's length, which the server bounds by its `max_request_bytes` before reading it.
"""

import dataclasses
import io
import json
import math
import struct
import tokenize
from collections.abc import Mapping
from typing import Any, Literal, final

import numpy as np
import numpy.typing as npt

from ._reward import to_uint8_images


MAGIC = b"flowgrpo-reward/1\n"
CONTENT_TYPE = "application/x-flowgrpo-reward"
NPY_CONTENT_TYPE = "application/x-npy"
TOKEN_ENV = "FLOWGRPO_REWARD_TOKEN"
_HEADER_LIMIT = 1 << 20
_NPY_HEADER_LIMIT = 1 << 16
_ALIGN = 64
# uint8 level -> float32 `x / 127.5 - 1`, computed in float64 and rounded once.
_UINT8_TO_FLOAT32 = (np.arange(256) / 127.5 - 1.0).astype(np.float32)

SAMPLE_KINDS = "fiu"
"""The NumPy dtype kinds a request's samples may have: real floats, signed and unsigned ints."""

ROWS_KINDS = "biufSU"
"""The NumPy dtype kinds a request's rows may have: those of samples, bool, and fixed-width
byte and Unicode strings (prompts)."""

WireErrorKind = Literal["malformed_body", "pickled_array", "unsupported_dtype"]


class WireError(ValueError):
    """A request body that is not the wire format; `kind` names the problem for the reply."""

    def __init__(self, kind: WireErrorKind, message: str):
        super().__init__(message)
        self.kind: WireErrorKind = kind


def npy_bytes(array: npt.NDArray[Any]) -> bytes:
    """`array` in NumPy's `.npy` format, refusing object arrays (which would be pickled)."""
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def load_npy(blob: Any, what: str) -> npt.NDArray[Any]:
    """Read one `.npy` blob that must be exactly one array and never a pickle.

    The header is checked against the bytes that follow it before anything is allocated, so
    a header that claims more (or fewer) elements than the blob holds is refused without
    ever reserving memory for them.

    **Arguments:**

    - `blob`: the `.npy` bytes (any buffer).
    - `what`: the blob's name, for the messages.

    **Returns:**

    The array: a view of `blob` when `blob` is writable and the data is aligned, else a copy.

    **Raises:**

    - `WireError`: `"pickled_array"` for an object dtype, `"malformed_body"` for anything
        else that is not a whole `.npy` array; `what` names the blob.
    """
    data = np.frombuffer(blob, dtype=np.uint8)
    return _array_at(data, 0, data.size, what)


def _array_at(
    body: npt.NDArray[np.uint8],
    start: int,
    size: int,
    what: str,
    *,
    kinds: str | None = None,
) -> npt.NDArray[Any]:
    """The `.npy` array in `body[start : start + size]`, its header checked first; with
    `kinds`, its dtype must be of one of those kinds and it must hold an element."""
    blob = body[start : start + size]
    head = io.BytesIO(blob[:_NPY_HEADER_LIMIT].tobytes())
    try:
        version = np.lib.format.read_magic(head)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(head)
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(head)
        else:
            raise ValueError(f".npy version {version} is not accepted (1.0 and 2.0 are)")
    # numpy reads a header that fails to parse again through `tokenize`, whose TokenError
    # is none of the others.
    except (ValueError, TypeError, OverflowError, tokenize.TokenError) as error:
        raise WireError("malformed_body", f"{what} is not a .npy array: {error}") from error
    if dtype.hasobject:
        raise WireError(
            "pickled_array",
            f"{what} has dtype {dtype}, which holds Python objects; only plain arrays are "
            "accepted, never pickles.",
        )
    follows = size - head.tell()
    if any(axis < 0 for axis in shape) or dtype.itemsize == 0 or dtype.subdtype is not None:
        raise WireError(
            "malformed_body", f"{what} has shape {_shape_text(shape)} of dtype {dtype}."
        )
    if kinds is not None and dtype.kind not in kinds:
        raise WireError(
            "unsupported_dtype",
            f"{what} has dtype {dtype}, which is not accepted here (only "
            f"{_describe_kinds(kinds)}).",
        )
    if kinds is not None and math.prod(shape) == 0:
        # Its axes are bounded by nothing: a reward would do per-row work for billions of
        # declared rows sent in zero bytes.
        raise WireError(
            "malformed_body",
            f"{what} has shape {_shape_text(shape)}, which holds no element; send one or more.",
        )
    claimed = math.prod(shape) * dtype.itemsize
    if claimed != follows:
        raise WireError(
            "malformed_body",
            f"{what}'s .npy header claims shape {_shape_text(shape)} of {dtype} "
            f"({_number_text(claimed)} bytes), but {follows} bytes follow it.",
        )
    try:
        flat = blob[head.tell() :].view(dtype)
        array = flat.reshape(shape, order="F" if fortran else "C")
    except (ValueError, TypeError) as error:
        raise WireError("malformed_body", f"{what} is not a .npy array: {error}") from error
    if not (array.flags.writeable and array.flags.aligned):
        array = array.copy(order="K")
    return array


def _number_text(number: int) -> str:
    """`number` as text, or its count of bits when it has over 20 digits (Python refuses to
    print integers of over 4300 digits, and a client may declare one)."""
    return str(number) if abs(number) < 10**20 else f"<a {number.bit_length()}-bit number>"


def _shape_text(shape: tuple[int, ...]) -> str:
    """`shape` as text, each axis as `_number_text` writes it."""
    axes = [_number_text(axis) for axis in shape]
    return "(" + ", ".join(axes) + ("," if len(axes) == 1 else "") + ")"


_KIND_NAMES = {
    "b": "bool",
    "i": "signed int",
    "u": "unsigned int",
    "f": "real float",
    "S": "byte string",
    "U": "Unicode string",
}


def _describe_kinds(kinds: str) -> str:
    return ", ".join(_KIND_NAMES[kind] for kind in kinds) + " dtypes"


def _flatten_rows(rows: Any, prefix: str = "rows") -> list[tuple[str, npt.NDArray[Any]]]:
    if isinstance(rows, Mapping):
        leaves = []
        for key, value in rows.items():
            if not isinstance(key, str) or not key or "/" in key:
                raise ValueError(
                    f"`rows` keys must be non-empty strings without '/', got {key!r} under "
                    f"{prefix!r}."
                )
            leaves.extend(_flatten_rows(value, f"{prefix}/{key}"))
        return leaves
    if isinstance(rows, list | tuple) or rows is None:
        raise ValueError(
            f"`rows` must be None, an array or a (nested) dict of arrays; {prefix!r} is a "
            f"{type(rows).__name__}."
        )
    return [(prefix, np.asarray(rows))]


def encode_request(samples: Any, rows: Any, *, images_as_uint8: bool = False) -> bytes:
    """The request body for `samples` and `rows`.

    **Arguments:**

    - `samples`: `[N, *sample]` samples in [-1, 1].
    - `rows`: None, an array, or a (nested) dict of arrays with leading axis `N`.
    - `images_as_uint8`: send the samples as uint8 images (`to_uint8_images`), a quarter of
        the float32 bytes; the server turns them back into float32 `x / 127.5 - 1`
        (computed in float64, rounded once).

    **Raises:**

    - `ValueError`: for rows of another kind, dict keys that are not strings or hold '/',
        object arrays (e.g. lists of Python strings: use `np.asarray(..., dtype=str)`), or
        samples that are not images when `images_as_uint8`.
    """
    array = np.asarray(samples)
    if images_as_uint8:
        array = to_uint8_images(array).reshape(array.shape)
    if rows is None:
        rows_kind = "none"
        leaves = []
    else:
        rows_kind = "dict" if isinstance(rows, Mapping) else "array"
        leaves = _flatten_rows(rows)
    blobs = [("samples", _npy_or_explain(array, "samples"))]
    blobs += [(name, _npy_or_explain(leaf, name)) for name, leaf in leaves]
    header = json.dumps(
        {
            "samples": "uint8" if images_as_uint8 else "float",
            "rows": rows_kind,
            "arrays": [[name, len(blob)] for name, blob in blobs],
        }
    ).encode()
    # Trailing spaces (still JSON) start the samples' .npy on a 64-byte boundary, where
    # np.save also aligns the data: the server can then score them in place, without a copy.
    header += b" " * (-(len(MAGIC) + 4 + len(header)) % _ALIGN)
    return b"".join([MAGIC, struct.pack("<I", len(header)), header, *(b for _, b in blobs)])


def _npy_or_explain(array: npt.NDArray[Any], name: str) -> bytes:
    try:
        return npy_bytes(array)
    except ValueError as error:
        raise ValueError(
            f"{name!r} has dtype {array.dtype}, which cannot be sent without pickling; use "
            "numeric, bool or fixed-width string arrays."
        ) from error


@final
@dataclasses.dataclass(frozen=True)
class WireRequest:
    """A request body read and checked, its samples still as they were sent (`parse_request`).

    **Arguments:**

    - `samples`: the samples as sent: uint8 images when `uint8`, else the reward's samples.
    - `rows`: the rows, as `encode_request` received them (None, an array, or nested dicts).
    - `uint8`: whether the samples travelled as uint8 images, to become float32.
    """

    samples: npt.NDArray[Any]
    rows: Any
    uint8: bool

    @property
    def count(self) -> int:
        """The rows of the request.

        **Returns:**

        The samples' leading axis `N`.
        """
        return int(self.samples.shape[0])

    def leaves(self) -> list[npt.NDArray[Any]]:
        """The arrays of the rows.

        **Returns:**

        Every array of `rows` (none for rows that are None), in no particular order.
        """
        return [leaf for _, leaf in _flatten_rows(self.rows)] if self.rows is not None else []

    def decoded_bytes(self) -> int:
        """The bytes of the arrays the reward gets, without allocating them.

        **Returns:**

        The bytes of the samples (as float32, 4 bytes per element, when they travelled as
        uint8) and of every array of the rows.
        """
        samples = 4 * self.samples.size if self.uint8 else self.samples.nbytes
        return int(samples + sum(leaf.nbytes for leaf in self.leaves()))

    def row_bytes(self) -> int:
        """The bytes of one row of the arrays as the reward gets them (`decoded_bytes` per
        row).

        **Returns:**

        The bytes, at least 1.
        """
        return max(1, -(-self.decoded_bytes() // max(1, self.count)))

    def part(self, start: int, stop: int) -> "WireRequest":
        """Rows `start` to `stop` of the request: views of its samples and of every array of
        its rows.

        **Arguments:**

        - `start`, `stop`: the rows, `0 <= start < stop <= count`.

        **Returns:**

        The `WireRequest` of those rows, its samples still as they were sent.
        """
        rows = None if self.rows is None else _slice_rows(self.rows, start, stop)
        return WireRequest(self.samples[start:stop], rows, self.uint8)

    def decoded(self) -> tuple[npt.NDArray[Any], Any]:
        """The arrays as the reward gets them.

        **Returns:**

        `(samples, rows)`: uint8 samples become float32 `x / 127.5 - 1`, computed in float64
        and rounded once (float32 arithmetic would round twice and miss the nearest float32
        for some levels), a new array made a block at a time (no temporary larger than a
        block); other samples and the rows are returned as they are.
        """
        if not self.uint8:
            return self.samples, self.rows
        out = np.empty(self.samples.shape, np.float32)
        flat_in, flat_out = self.samples.reshape(-1), out.reshape(-1)
        for start in range(0, flat_in.size, _DECODE_BLOCK):
            stop = start + _DECODE_BLOCK
            flat_out[start:stop] = _UINT8_TO_FLOAT32[flat_in[start:stop]]
        return out, self.rows


_DECODE_BLOCK = 1 << 20
"""uint8 samples decoded per step: the table lookup's index array is 8 bytes an element."""


def _slice_rows(rows: Any, start: int, stop: int) -> Any:
    if isinstance(rows, Mapping):
        return {key: _slice_rows(value, start, stop) for key, value in rows.items()}
    return rows[start:stop]


def decode_request(body: Any) -> tuple[npt.NDArray[Any], Any]:
    """The samples and rows of a request body (`encode_request`'s inverse):
    `parse_request(body).decoded()`.

    **Arguments:**

    - `body`: the request body (`bytes`, or any buffer such as a uint8 array).

    **Returns:**

    `(samples, rows)`, rows as `encode_request` received them (None, an array, or nested
    dicts); uint8 samples come back as float32 `x / 127.5 - 1`.

    **Raises:**

    - `WireError`: as `parse_request`.
    """
    return parse_request(body).decoded()


def parse_request(body: Any) -> WireRequest:
    """Read and check a request body, without yet turning uint8 samples into float32 (so that
    a server can hold the request to its limits before it allocates them).

    Every length is checked before anything is allocated: the header's array lengths must add
    up to the body, and each `.npy` header must describe exactly the bytes that follow it and
    at least one element, so that no axis of any array exceeds the body's length. Samples must
    have a real float or integer dtype (`SAMPLE_KINDS`), rows may also be bool or strings
    (`ROWS_KINDS`).
    The arrays are views of `body` when it is writable (the server reads bodies into a
    writable buffer) and their data is aligned, copies otherwise, so reading costs at most
    one more body of memory.

    **Arguments:**

    - `body`: the request body (`bytes`, or any buffer such as a uint8 array).

    **Returns:**

    The `WireRequest`.

    **Raises:**

    - `WireError`: naming what is wrong: `"pickled_array"` for an object-dtype array,
        `"unsupported_dtype"` naming the array and its dtype (complex, datetime, structured,
        bool samples, ...), `"malformed_body"` otherwise (bad magic, header or lengths, a
        `.npy` header that does not match its bytes, an array with no element, rows whose
        leading axis is not the samples').
    """
    data = np.frombuffer(body, dtype=np.uint8)
    if data[: len(MAGIC)].tobytes() != MAGIC:
        raise WireError(
            "malformed_body",
            f"the body does not start with {MAGIC!r}; send it with flowgrpo_eqx.HttpReward.",
        )
    offset = len(MAGIC)
    if data.size < offset + 4:
        raise WireError("malformed_body", "the body ends before its header length.")
    (header_length,) = struct.unpack("<I", data[offset : offset + 4].tobytes())
    offset += 4
    if header_length > min(_HEADER_LIMIT, data.size - offset):
        raise WireError("malformed_body", f"the header length {header_length} is out of range.")
    try:
        header = json.loads(data[offset : offset + header_length].tobytes())
        encoding = header["samples"]
        rows_kind = header["rows"]
        entries = [(str(name), int(size)) for name, size in header["arrays"]]
    except (ValueError, KeyError, TypeError, OverflowError, RecursionError) as error:
        reason = "nested too deep" if isinstance(error, RecursionError) else repr(error)
        raise WireError("malformed_body", f"the header is not valid: {reason}") from None
    offset += header_length
    if encoding not in ("float", "uint8") or rows_kind not in ("none", "array", "dict"):
        raise WireError(
            "malformed_body", f"unknown samples {encoding!r} or rows {rows_kind!r} in header."
        )
    names = [name for name, _ in entries]
    if not names or names[0] != "samples" or len(set(names)) != len(names):
        raise WireError("malformed_body", f"the arrays must be 'samples' then rows: {names}.")
    if any(size < 0 for _, size in entries) or sum(s for _, s in entries) != data.size - offset:
        raise WireError("malformed_body", "the array lengths do not add up to the body length.")
    arrays = {}
    for name, size in entries:
        kinds = SAMPLE_KINDS if name == "samples" else ROWS_KINDS
        arrays[name] = _array_at(data, offset, size, name, kinds=kinds)
        offset += size
    samples = arrays.pop("samples")
    if samples.ndim == 0:
        raise WireError("malformed_body", "'samples' must have a leading batch axis.")
    if encoding == "uint8" and samples.dtype != np.uint8:
        raise WireError("malformed_body", f"uint8 samples arrived as {samples.dtype}.")
    for name, leaf in arrays.items():
        if leaf.ndim == 0 or leaf.shape[0] != samples.shape[0]:
            raise WireError(
                "malformed_body",
                f"{name!r} has shape {leaf.shape}; rows need the samples' leading axis "
                f"{samples.shape[0]}.",
            )
    return WireRequest(samples, _unflatten_rows(rows_kind, arrays), encoding == "uint8")


def _unflatten_rows(rows_kind: str, arrays: dict[str, npt.NDArray[Any]]) -> Any:
    if rows_kind == "none" or rows_kind == "array":
        expected = [] if rows_kind == "none" else ["rows"]
        if list(arrays) != expected:
            raise WireError("malformed_body", f"rows {rows_kind!r} cannot hold {list(arrays)}.")
        return arrays["rows"] if arrays else None
    rows: dict[str, Any] = {}
    for name, leaf in arrays.items():
        parts = name.split("/")
        if parts[0] != "rows" or len(parts) < 2 or not all(parts[1:]):
            raise WireError("malformed_body", f"array name {name!r} is not 'rows/<key>'.")
        node = rows
        for part in parts[1:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise WireError("malformed_body", f"{name!r} is under an array.")
            node = child
        if parts[-1] in node:
            raise WireError("malformed_body", f"{name!r} is both an array and a dict.")
        node[parts[-1]] = leaf
    return rows
