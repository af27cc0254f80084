"""A reward served over HTTP: `HttpReward`, and the wire format it shares with the server.

The client is the standard library's `http.client`: the training environment needs no extra
package, proxies set in the environment never reroute a call, and each attempt reads its
reply against one deadline.

Wire format (`CONTENT_TYPE`): the bytes `MAGIC`, a little-endian uint32 header length, a
UTF-8 JSON header, then the `.npy` blobs (`np.save(..., allow_pickle=False)`) the header
lists in order:

    {"samples": "float" | "uint8", "rows": "none" | "array" | "dict",
     "arrays": [["samples", nbytes], ["rows/prompt", nbytes], ...]}

`samples` comes first; rows follow as one blob per leaf, nested dict keys joined by `/`
(`"rows"` alone for rows that are one array). The reply to a scoring request is one `.npy`
float64 array `[N]`; an error reply is JSON `{"error": kind, "message": text}`.
"""

import http.client
import io
import json
import os
import socket
import struct
import time
import urllib.parse
from collections.abc import Mapping
from typing import Any, Literal, final

import numpy as np
import numpy.typing as npt

from ._reward import RewardError, to_uint8_images


MAGIC = b"flowgrpo-reward/1\n"
CONTENT_TYPE = "application/x-flowgrpo-reward"
NPY_CONTENT_TYPE = "application/x-npy"
TOKEN_ENV = "FLOWGRPO_REWARD_TOKEN"
_HEADER_LIMIT = 1 << 20
_ERROR_BODY_LIMIT = 1 << 16
_RETRIED_CLIENT_STATUSES = (408, 429)

# Indirection so tests can record the backoff without sleeping.
_sleep = time.sleep

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


class _Retryable(Exception):
    """A failed attempt worth repeating: the server may answer next time."""


class _Rejected(Exception):
    """The server refused the request itself (a 4xx); repeating it cannot help."""


@final
class HttpReward:
    """A reward computed by a reward server (`python -m flowgrpo_eqx.reward_server`).

    Each call POSTs the samples and repeated rows to `<url>/score` and returns the server's
    float64 scores bit for bit. The server may run in another environment, process or
    machine.

    **Arguments:**

    - `url`: the server's base URL, `http://host:port` (or `https://`, optionally with a
        path prefix).
    - `timeout`: seconds one attempt may take, from connecting to the last reply byte.
    - `retries`: further attempts after a failed one (connection refused or reset, timeout,
        HTTP 5xx, 408 or 429, or a reply that is not `[N]` finite float64 scores); other 4xx
        replies (wrong token, bad request) are never repeated. Attempt `k` (from 0) is
        followed by a pause of `backoff * 2**k` seconds.
    - `token`: sent as `Authorization: Bearer <token>`; if None, the environment variable
        `FLOWGRPO_REWARD_TOKEN` is used when set.
    - `backoff`: the first pause in seconds.
    - `images_as_uint8`: send images as uint8 (a quarter of the float32 bytes). Scores are
        then the reward's on float32 `to_uint8_images(samples) / 127.5 - 1`, which equals
        `samples` only for samples already on that grid.

    A call ends within about `timeout * (retries + 1) + backoff * (2**retries - 1)` seconds.

    **Raises:**

    - `ValueError`: naming the argument, for a URL that is not http(s) with a host, a
        non-positive timeout, or a negative `retries` or `backoff`.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout: float = 30.0,
        retries: int = 2,
        token: str | None = None,
        backoff: float = 0.5,
        images_as_uint8: bool = False,
    ):
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(f"`url` must be http(s)://host[:port][/prefix], got {url!r}.")
        if parsed.query or parsed.fragment:
            raise ValueError(f"`url` must have no query or fragment, got {url!r}.")
        try:
            port = parsed.port
        except ValueError as error:
            raise ValueError(f"`url` has an invalid port: {url!r}.") from error
        if not (timeout > 0 and np.isfinite(timeout)):
            raise ValueError(f"`timeout` must be a positive number of seconds, got {timeout}.")
        if retries < 0:
            raise ValueError(f"`retries` must be >= 0, got {retries}.")
        if not (backoff >= 0 and np.isfinite(backoff)):
            raise ValueError(f"`backoff` must be >= 0 seconds, got {backoff}.")
        self.url = url.rstrip("/")
        self.name = f"http:{self.url}"
        self.timeout = float(timeout)
        self.retries = int(retries)
        self.backoff = float(backoff)
        self.images_as_uint8 = images_as_uint8
        self._token = token if token is not None else os.environ.get(TOKEN_ENV) or None
        self._https = parsed.scheme == "https"
        self._host = parsed.hostname
        self._port = port
        self._path = parsed.path.rstrip("/") + "/score"

    def __repr__(self) -> str:
        token = "None" if self._token is None else "'***'"
        return (
            f"HttpReward({self.url!r}, timeout={self.timeout}, retries={self.retries}, "
            f"token={token}, backoff={self.backoff}, images_as_uint8={self.images_as_uint8})"
        )

    def __call__(self, samples: npt.NDArray[Any], rows: Any) -> npt.NDArray[np.float64]:
        """Score `samples` on the server.

        **Arguments:**

        - `samples`: `[N, *sample]` numpy samples in [-1, 1].
        - `rows`: None, an array, or a (nested) dict of arrays with leading axis `N`.

        **Returns:**

        The server's `[N]` float64 scores.

        **Raises:**

        - `RewardError`: naming the URL and what happened: samples or rows that cannot be
            sent, a 4xx reply (at once), or the last failure after `retries + 1` attempts.
        """
        count = int(np.shape(samples)[0])
        try:
            body = encode_request(samples, rows, images_as_uint8=self.images_as_uint8)
        except ValueError as error:
            message = f"Reward server {self.url}: cannot send the batch: {error}"
            raise RewardError(message) from error
        attempts = self.retries + 1
        failure = ""
        for attempt in range(attempts):
            try:
                return self._attempt(body, count)
            except _Rejected as error:
                raise RewardError(
                    f"Reward server {self.url} rejected the request (not retried): {error}"
                ) from None
            except _Retryable as error:
                failure = str(error)
            if attempt + 1 < attempts:
                _sleep(self.backoff * 2**attempt)
        plural = "attempt" if attempts == 1 else "attempts"
        raise RewardError(f"Reward server {self.url} failed after {attempts} {plural}: {failure}")

    def _attempt(self, body: bytes, count: int) -> npt.NDArray[np.float64]:
        deadline = time.monotonic() + self.timeout
        headers = {
            "Content-Type": CONTENT_TYPE,
            "Accept": NPY_CONTENT_TYPE,
            "Connection": "close",
        }
        if self._token is not None:
            headers["Authorization"] = f"Bearer {self._token}"
        connection_type = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        connection = connection_type(self._host, self._port, timeout=self.timeout)
        response = None
        try:
            connection.connect()
            # Kept: http.client lets go of the socket once it sees a closing reply's headers.
            sock = connection.sock
            _wait_at_most(sock, deadline)
            connection.request("POST", self._path, body=body, headers=headers)
            _wait_at_most(sock, deadline)
            response = connection.getresponse()
            limit = 8 * count + (1 << 16) if response.status == 200 else _ERROR_BODY_LIMIT
            reply = _read_until(sock, response, deadline, limit)
        except TimeoutError:
            raise _Retryable(f"timed out after {self.timeout:g} s") from None
        except ConnectionRefusedError:
            raise _Retryable("connection refused (is the server running?)") from None
        except (OSError, http.client.HTTPException) as error:
            raise _Retryable(f"connection failed: {type(error).__name__}: {error}") from None
        finally:
            if response is not None:
                response.close()
            connection.close()
        if response.status != 200:
            described = f"HTTP {response.status} {response.reason}: {_error_text(reply)}"
            if 400 <= response.status < 500 and response.status not in _RETRIED_CLIENT_STATUSES:
                raise _Rejected(described)
            raise _Retryable(described)
        return _checked_scores(reply, count)


def _wait_at_most(sock: socket.socket, deadline: float) -> None:
    """Bound the socket's next operation by what is left of the attempt."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError
    sock.settimeout(remaining)


def _read_until(
    sock: socket.socket, response: http.client.HTTPResponse, deadline: float, limit: int
) -> bytes:
    """The reply body, each read bounded by the attempt's deadline and the whole by `limit`."""
    chunks: list[bytes] = []
    size = 0
    while True:
        _wait_at_most(sock, deadline)
        chunk = response.read1(1 << 16)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        size += len(chunk)
        if size > limit:
            raise _Retryable(f"the reply exceeds {limit} bytes")


def _error_text(reply: bytes) -> str:
    try:
        parsed = json.loads(reply)
        return f"{parsed['error']}: {parsed['message']}"
    except (ValueError, KeyError, TypeError):
        return reply[:500].decode("utf-8", "replace").strip() or "(empty reply)"


def _checked_scores(reply: bytes, count: int) -> npt.NDArray[np.float64]:
    try:
        scores = load_npy(reply, "the reply")
    except WireError as error:
        raise _Retryable(f"malformed reply: {error}") from None
    if scores.dtype != np.float64 or scores.shape != (count,):
        raise _Retryable(
            f"the reply holds {scores.dtype} {scores.shape}; expected float64 ({count},)"
        )
    bad = np.flatnonzero(~np.isfinite(scores))
    if bad.size:
        raise _Retryable(f"the reply holds non-finite scores at rows {bad.tolist()}")
    return scores
