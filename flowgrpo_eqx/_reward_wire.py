"""The reward server's wire format, shared by the client (`HttpReward`) and the server.

A scoring request (`CONTENT_TYPE`) is the bytes `MAGIC`, a little-endian uint32 header length,
a UTF-8 JSON header, then the `.npy` blobs (`np.save(..., allow_pickle=False)`) the header
lists in order:

    {"samples": "float" | "uint8", "rows": "none" | "array" | "dict",
     "arrays": [["samples", nbytes], ["rows/prompt", nbytes], ...]}

`samples` comes first; rows follow as one blob per leaf, nested dict keys joined by `/`
(`"rows"` alone for rows that are one array). The reply to a scoring request is one `.npy`
float64 array `[N]` (`NPY_CONTENT_TYPE`); an error reply is JSON
`{"error": kind, "message": text}`.
"""

import io
import json
import struct
from collections.abc import Mapping
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from ._reward import to_uint8_images


MAGIC = b"flowgrpo-reward/1\n"
CONTENT_TYPE = "application/x-flowgrpo-reward"
NPY_CONTENT_TYPE = "application/x-npy"
TOKEN_ENV = "FLOWGRPO_REWARD_TOKEN"
_HEADER_LIMIT = 1 << 20

WireErrorKind = Literal["malformed_body", "pickled_array"]


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


def load_npy(blob: bytes, what: str) -> npt.NDArray[Any]:
    """Read one `.npy` blob that must be exactly one array and never a pickle.

    **Raises:**

    - `WireError`: `"pickled_array"` for an object dtype, `"malformed_body"` for anything
        else that is not a whole `.npy` array; `what` names the blob.
    """
    buffer = io.BytesIO(blob)
    try:
        version = np.lib.format.read_magic(buffer)
        if version == (1, 0):
            _, _, dtype = np.lib.format.read_array_header_1_0(buffer)
        elif version == (2, 0):
            _, _, dtype = np.lib.format.read_array_header_2_0(buffer)
        else:
            dtype = None
    except ValueError as error:
        raise WireError("malformed_body", f"{what} is not a .npy array: {error}") from error
    if dtype is not None and dtype.hasobject:
        raise WireError(
            "pickled_array",
            f"{what} has dtype {dtype}, which holds Python objects; only plain arrays are "
            "accepted, never pickles.",
        )
    buffer.seek(0)
    try:
        array = np.load(buffer, allow_pickle=False)
    except (ValueError, EOFError, OSError) as error:
        raise WireError("malformed_body", f"{what} is not a .npy array: {error}") from error
    if not isinstance(array, np.ndarray) or buffer.tell() != len(blob):
        raise WireError("malformed_body", f"{what} has bytes after its array.")
    return array


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
    return b"".join([MAGIC, struct.pack("<I", len(header)), header, *(b for _, b in blobs)])


def _npy_or_explain(array: npt.NDArray[Any], name: str) -> bytes:
    try:
        return npy_bytes(array)
    except ValueError as error:
        raise ValueError(
            f"{name!r} has dtype {array.dtype}, which cannot be sent without pickling; use "
            "numeric, bool or fixed-width string arrays."
        ) from error


def decode_request(body: bytes) -> tuple[npt.NDArray[Any], Any]:
    """The samples and rows of a request body (`encode_request`'s inverse).

    uint8 samples come back as float32 `x / 127.5 - 1`, computed in float64 and rounded once
    (float32 arithmetic would round twice and miss the nearest float32 for some levels).

    **Returns:**

    `(samples, rows)`, rows as `encode_request` received them (None, an array, or nested
    dicts).

    **Raises:**

    - `WireError`: naming what is wrong: `"pickled_array"` for an object-dtype array,
        `"malformed_body"` otherwise (bad magic, header or lengths, rows whose leading axis
        is not the samples').
    """
    if not body.startswith(MAGIC):
        raise WireError(
            "malformed_body",
            f"the body does not start with {MAGIC!r}; send it with flowgrpo_eqx.HttpReward.",
        )
    offset = len(MAGIC)
    if len(body) < offset + 4:
        raise WireError("malformed_body", "the body ends before its header length.")
    (header_length,) = struct.unpack_from("<I", body, offset)
    offset += 4
    if header_length > min(_HEADER_LIMIT, len(body) - offset):
        raise WireError("malformed_body", f"the header length {header_length} is out of range.")
    try:
        header = json.loads(body[offset : offset + header_length])
        encoding = header["samples"]
        rows_kind = header["rows"]
        entries = [(str(name), int(size)) for name, size in header["arrays"]]
    except (ValueError, KeyError, TypeError) as error:
        raise WireError("malformed_body", f"the header is not valid: {error!r}") from error
    offset += header_length
    if encoding not in ("float", "uint8") or rows_kind not in ("none", "array", "dict"):
        raise WireError(
            "malformed_body", f"unknown samples {encoding!r} or rows {rows_kind!r} in header."
        )
    names = [name for name, _ in entries]
    if not names or names[0] != "samples" or len(set(names)) != len(names):
        raise WireError("malformed_body", f"the arrays must be 'samples' then rows: {names}.")
    if any(size < 0 for _, size in entries) or sum(s for _, s in entries) != len(body) - offset:
        raise WireError("malformed_body", "the array lengths do not add up to the body length.")
    arrays = {}
    for name, size in entries:
        arrays[name] = load_npy(body[offset : offset + size], name)
        offset += size
    samples = arrays.pop("samples")
    if samples.ndim == 0:
        raise WireError("malformed_body", "'samples' must have a leading batch axis.")
    if encoding == "uint8":
        if samples.dtype != np.uint8:
            raise WireError("malformed_body", f"uint8 samples arrived as {samples.dtype}.")
        samples = (samples / 127.5 - 1.0).astype(np.float32)
    for name, leaf in arrays.items():
        if leaf.ndim == 0 or leaf.shape[0] != samples.shape[0]:
            raise WireError(
                "malformed_body",
                f"{name!r} has shape {leaf.shape}; rows need the samples' leading axis "
                f"{samples.shape[0]}.",
            )
    return samples, _unflatten_rows(rows_kind, arrays)


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
