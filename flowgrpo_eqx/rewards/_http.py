"""A reward served over HTTP: `HttpReward`, the client of `flowgrpo_eqx.rewards.server`.

The client is the standard library's `http.client`: the training environment needs no extra
package, proxies set in the environment never reroute a call, and each attempt reads its
reply against one deadline. The wire format it shares with the server is in `_wire.py`.
"""

import http.client
import io
import json
import os
import socket
import time
import urllib.parse
from typing import Any, cast, final

import numpy as np
import numpy.typing as npt

from .._misc import check_int, check_number
from ._reward import RewardError, check_finite_samples
from ._wire import (
    CONTENT_TYPE,
    NPY_CONTENT_TYPE,
    TOKEN_ENV,
    WireError,
    encode_request,
    load_npy,
)


_ENDPOINT = "/score"
_ERROR_BODY_LIMIT = 1 << 16
_RETRIED_CLIENT_STATUSES = (408, 429)

# Indirection so tests can record the backoff without sleeping.
_sleep = time.sleep


class _Retryable(Exception):
    """A failed attempt worth repeating: the server may answer next time."""


class _Rejected(Exception):
    """The server refused the request itself (a 4xx, or a redirect, which is not followed):
    repeating it cannot help."""


@final
class HttpReward:
    """A reward computed by a reward server (`python -m flowgrpo_eqx.rewards.server`).

    Each call POSTs the samples and repeated rows to `<url>/score` and returns the server's
    float64 scores bit for bit. The server may run in another environment, process or
    machine.

    **Arguments:**

    - `url`: the server's base URL, `http://host:port` (or `https://`, optionally with a
        path prefix); requests go to `<url>/score`. A URL that already ends in `/score`
        means its base: `http://host:port/score` is taken as `http://host:port`.
    - `timeout`: seconds one attempt may take, from connecting to the last reply byte
        (the reply's status line and headers included, however slowly they arrive).
    - `retries`: further attempts after a failed one (connection refused or reset, timeout,
        HTTP 5xx, 408 or 429, or a reply that is not `[N]` finite float64 scores); other 4xx
        replies (wrong token, bad request) and redirects (never followed) are not repeated.
        Attempt `k` (from 0) is followed by a pause of `backoff * 2**k` seconds.
    - `token`: sent as `Authorization: Bearer <token>`; if None, the environment variable
        `FLOWGRPO_REWARD_TOKEN` is used when set.
    - `backoff`: the first pause in seconds.
    - `images_as_uint8`: send images as uint8 (a quarter of the float32 bytes). Scores are
        then the reward's on float32 `to_uint8_images(samples) / 127.5 - 1`, which equals
        `samples` only for samples already on that grid.

    A call ends within about `timeout * (retries + 1) + backoff * (2**retries - 1)` seconds.

    **Raises:**

    - `ValueError`: naming the argument, for a URL that is not http(s) with a host, a
        `timeout` that is not a finite number > 0, `retries` that is not an int >= 0, or a
        `backoff` that is not a finite number >= 0.
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
        check_number("timeout", timeout, minimum=0, include_minimum=False)
        check_int("retries", retries, 0)
        check_number("backoff", backoff, minimum=0)
        prefix = parsed.path.rstrip("/")
        if prefix.endswith(_ENDPOINT):  # the endpoint itself: its base is meant
            prefix = prefix.removesuffix(_ENDPOINT)
        self.url = urllib.parse.urlunsplit((parsed.scheme, parsed.netloc, prefix, "", ""))
        self.name = f"http:{self.url}"
        self.timeout = float(timeout)
        self.retries = int(retries)
        self.backoff = float(backoff)
        self.images_as_uint8 = images_as_uint8
        self._token = token if token is not None else os.environ.get(TOKEN_ENV) or None
        self._https = parsed.scheme == "https"
        self._host = parsed.hostname
        self._port = port
        self._path = prefix + _ENDPOINT
        self._endpoint = self.url + _ENDPOINT

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
            sent (samples holding NaN or inf, naming their rows), a 4xx or 3xx reply (at once;
            a 404 names the URL requested), or the last failure after `retries + 1` attempts.
        """
        check_finite_samples(self.name, samples)
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
        sock = None
        try:
            connection.connect()
            # Kept, and closed here: http.client lets go of it once it sees a closing reply's
            # headers, while the reply is still to be read through it.
            sock = connection.sock
            connection.sock = cast(socket.socket, _DeadlineSocket(sock, deadline))
            _wait_at_most(sock, deadline)
            connection.request("POST", self._path, body=body, headers=headers)
            _wait_at_most(sock, deadline)
            response = connection.getresponse()
            if response.status == 200:
                reply = _read_until(sock, response, deadline, 8 * count + (1 << 16))
            else:  # only its start is shown: the status decides what happens next
                reply = _read_until(sock, response, deadline, _ERROR_BODY_LIMIT, cut=True)
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
            if sock is not None:
                sock.close()
        if response.status != 200:
            described = f"HTTP {response.status} {response.reason}: {_error_text(reply)}"
            if response.status == 404:
                described += (
                    f" (POST {self._endpoint}: no reward server answers there; `url` must be "
                    "the server's base URL, http://host:port, to which /score is added)"
                )
            if 300 <= response.status < 400:
                location = response.getheader("Location") or "none given"
                raise _Rejected(f"{described} (redirects are not followed; Location: {location})")
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


class _DeadlineSocket:
    """A connected socket whose every read waits at most what is left of one deadline.

    http.client reads a reply's status line and headers line by line through
    `sock.makefile("rb")`, each read bounded by the socket's timeout alone: a server that
    trickles its headers a byte at a time would hold the attempt for as long as it likes.
    `close` is left to the attempt, which closes the socket itself once the reply is read;
    everything else is the socket's own.
    """

    def __init__(self, sock: socket.socket, deadline: float):
        self._sock = sock
        self._deadline = deadline

    def makefile(self, mode: str = "rb", *args: Any, **kwargs: Any) -> io.BufferedReader:
        del args, kwargs
        if mode != "rb":
            raise ValueError(f"only mode 'rb' is supported, got {mode!r}")
        return io.BufferedReader(_DeadlineReader(self._sock, self._deadline))

    def close(self) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


class _DeadlineReader(io.RawIOBase):
    """`_DeadlineSocket`'s reading side: `recv_into` under the time left."""

    def __init__(self, sock: socket.socket, deadline: float):
        super().__init__()
        self._sock = sock
        self._deadline = deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        _wait_at_most(self._sock, self._deadline)
        return self._sock.recv_into(buffer)


def _read_until(
    sock: socket.socket,
    response: http.client.HTTPResponse,
    deadline: float,
    limit: int,
    *,
    cut: bool = False,
) -> bytes:
    """The reply body, each read bounded by the attempt's deadline and the whole by `limit`
    (beyond which it is an error, or with `cut` its first `limit` bytes)."""
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
            if cut:
                return b"".join(chunks)[:limit]
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
