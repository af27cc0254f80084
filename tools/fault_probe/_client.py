"""Faults of the reward client: `flowgrpo_eqx.HttpReward` calling hostile loopback servers
(plain sockets and threads, one fresh server per fault) that trickle, stall, reset, redirect
or answer with replies no reward server sends.

The client runs in the probe's own process, with `timeout=1`, `retries=1` and a short
backoff, so that every call ends within about two seconds. A bad reply must end the call with
a `RewardError` whose message names the problem (`named`): 4xx replies at once, other
failures after the retry. A failure that the retry cures must be scored (`held`). Scores
taken from a bad reply are `accepted`; another exception type is a `traceback`; a call that
outlives `CALL_LIMIT` is a `hang`.
"""

import contextlib
import dataclasses
import functools
import io
import json
import pathlib
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from flowgrpo_eqx import HttpReward, RewardError
from flowgrpo_eqx.rewards._wire import npy_bytes

from ._probe import Fault, Judgement


TIMEOUT = 1.0
"""The client's `timeout`: seconds one attempt may take."""
RETRIES = 1
"""The client's `retries`: one more attempt after a failed one."""
BACKOFF = 0.05
"""The client's `backoff`: the pause before its retry."""
CALL_LIMIT = 5.0
"""Seconds a call may take before it is a hang: two attempts and the backoff take about 2."""
COUNT = 2
"""Samples per call."""
SCORES = np.array([0.5, 0.25])
"""The scores a well-behaved server answers."""
PAUSE = 0.1
"""Seconds between the bytes of a trickled reply."""
TRICKLE_FOR = 10.0
"""Seconds a trickling server keeps trickling (unless the client goes away)."""

Handler = Callable[[socket.socket, threading.Event], None]
"""What a scripted server does with one accepted connection (stop when the event is set)."""


def read_request(conn: socket.socket) -> bytes:
    """Read one request (head, then a Content-Length body) from `conn`; what arrived if the
    client stops sending first."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(body) < length:
        chunk = conn.recv(1 << 20)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


def reply_bytes(
    status: str = "200 OK",
    body: bytes = b"",
    *,
    content_type: str = "application/x-npy",
    headers: Sequence[tuple[str, str]] = (),
    length: int | None = None,
) -> bytes:
    """A raw reply: status line, `Content-Type`, `Content-Length` (`length`, else the
    body's), `headers`, `Connection: close`, then the body."""
    size = len(body) if length is None else length
    lines = [f"HTTP/1.1 {status}", f"Content-Type: {content_type}", f"Content-Length: {size}"]
    lines += [f"{name}: {value}" for name, value in headers]
    lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def json_error(status: str, kind: str, message: str) -> bytes:
    """A reward server's JSON error reply."""
    body = json.dumps({"error": kind, "message": message}).encode()
    return reply_bytes(status, body, content_type="application/json")


def scores_reply(scores: npt.NDArray[Any] = SCORES) -> bytes:
    """A 200 reply holding `scores` as `.npy`."""
    return reply_bytes(body=npy_bytes(scores))


def pickled_npy(array: npt.NDArray[Any]) -> bytes:
    """`array` as `.npy`, pickled when it holds objects."""
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=True)
    return buffer.getvalue()


def npy_claiming(shape: tuple[int, ...], data: bytes) -> bytes:
    """A float64 `.npy` whose header claims `shape`, followed by `data`."""
    header = f"{{'descr': '<f8', 'fortran_order': False, 'shape': {shape}, }}".encode()
    header += b" " * (-(10 + len(header) + 1) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header + data


# --- handlers -------------------------------------------------------------------------------


def answer(data: bytes) -> Handler:
    """Read the request, send `data`, close."""

    def handle(conn: socket.socket, stop: threading.Event) -> None:
        del stop
        read_request(conn)
        conn.sendall(data)

    return handle


def answer_at(path: bytes, data: bytes) -> Handler:
    """Read the request; send `data` if it is for `path`, else a plain 404; close."""

    def handle(conn: socket.socket, stop: threading.Event) -> None:
        del stop
        request_line = read_request(conn).split(b"\r\n", 1)[0].split(b" ")
        found = len(request_line) == 3 and request_line[1] == path
        conn.sendall(data if found else reply_bytes("404 Not Found", b"404: Not Found"))

    return handle


def answer_unread(data: bytes) -> Handler:
    """Send `data` without reading the request (e.g. to a TLS hello), then close."""

    def handle(conn: socket.socket, stop: threading.Event) -> None:
        del stop
        conn.sendall(data)

    return handle


def trickle(head: bytes, trickled: bytes) -> Handler:
    """Read the request, send `head` at once, then `trickled` a byte per `PAUSE` s for up to
    `TRICKLE_FOR` s (a trickle the client cuts off ends when a send fails)."""

    def handle(conn: socket.socket, stop: threading.Event) -> None:
        read_request(conn)
        conn.sendall(head)
        deadline = time.monotonic() + TRICKLE_FOR
        for byte in trickled:
            if stop.is_set() or time.monotonic() > deadline:
                return
            conn.sendall(bytes([byte]))
            time.sleep(PAUSE)

    return handle


def silence(conn: socket.socket, stop: threading.Event) -> None:
    """Read the request and answer nothing, holding the connection open."""
    read_request(conn)
    stop.wait(TRICKLE_FOR)


def endless_continue(conn: socket.socket, stop: threading.Event) -> None:
    """Read the request, then send `100 Continue` replies, one per 50 ms, and never a final
    reply."""
    read_request(conn)
    deadline = time.monotonic() + TRICKLE_FOR
    while not stop.is_set() and time.monotonic() < deadline:
        conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
        time.sleep(0.05)


def unread(conn: socket.socket, stop: threading.Event) -> None:
    """Accept the connection and never read from it (the client's upload fills the
    buffers)."""
    del conn
    stop.wait(TRICKLE_FOR)


def close_unanswered(conn: socket.socket, stop: threading.Event) -> None:
    """Read the request and close the connection without a reply."""
    del stop
    read_request(conn)


def reset(conn: socket.socket, stop: threading.Event) -> None:
    """Read the request and reset the connection (RST instead of FIN)."""
    del stop
    read_request(conn)
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def flood(conn: socket.socket, stop: threading.Event) -> None:
    """Read the request, announce a 1 TB reply and stream zeros until the client leaves."""
    read_request(conn)
    conn.sendall(reply_bytes(length=10**12))
    chunk = bytes(1 << 16)
    deadline = time.monotonic() + TRICKLE_FOR
    while not stop.is_set() and time.monotonic() < deadline:
        conn.sendall(chunk)


# --- the scripted server --------------------------------------------------------------------


@dataclasses.dataclass
class Scripted:
    """A loopback server whose `k`-th connection is handled by `handlers[k]` (the last one for
    every connection after), each on its own thread."""

    handlers: Sequence[Handler]
    listener: socket.socket = dataclasses.field(init=False)
    stop: threading.Event = dataclasses.field(default_factory=threading.Event)
    connections: int = 0
    errors: list[str] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.05)
        self.port = int(self.listener.getsockname()[1])
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    @property
    def url(self) -> str:
        """The server's base URL."""
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            handler = self.handlers[min(self.connections, len(self.handlers) - 1)]
            self.connections += 1
            thread = threading.Thread(target=self._handle, args=(handler, conn), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _handle(self, handler: Handler, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(TRICKLE_FOR)
            try:
                handler(conn, self.stop)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client went away: what these faults expect it to do
            except OSError as error:
                self.errors.append(f"{type(error).__name__}: {error}")

    def close(self) -> None:
        """Stop accepting and tell the handlers to stop."""
        self.stop.set()
        self.listener.close()
        for thread in self._threads:
            thread.join(1.0)


@contextlib.contextmanager
def scripted(*handlers: Handler) -> Iterator[Scripted]:
    """A `Scripted` server for the duration of the block."""
    server = Scripted(handlers)
    try:
        yield server
    finally:
        server.close()


# --- calling the client and judging what it did ---------------------------------------------


@dataclasses.dataclass(frozen=True)
class Called:
    """How one call of the client ended: its scores or its exception, and how long it took
    (None if it was still running at `CALL_LIMIT`)."""

    scores: npt.NDArray[np.float64] | None
    error: BaseException | None
    seconds: float | None


def call_client(url: str, *, count: int = COUNT, **settings: Any) -> Called:
    """Call `HttpReward(url, timeout=TIMEOUT, retries=RETRIES, backoff=BACKOFF, **settings)`
    on `count` images and prompts, on a thread given `CALL_LIMIT` seconds."""
    options = {"timeout": TIMEOUT, "retries": RETRIES, "backoff": BACKOFF, **settings}
    reward = HttpReward(url, **options)
    samples = np.zeros((count, 16, 16, 3), np.float32)
    rows = {"tokens": np.tile(np.array([[0, 4, 1, 5]], np.int32), (count, 1))}
    ended: list[Called] = []
    started = time.monotonic()

    def attempt() -> None:
        try:
            scores = reward(samples, rows)
            ended.append(Called(scores, None, time.monotonic() - started))
        except BaseException as error:  # noqa: BLE001 - judged by the probe
            ended.append(Called(None, error, time.monotonic() - started))

    thread = threading.Thread(target=attempt, daemon=True)
    thread.start()
    thread.join(CALL_LIMIT)
    return ended[0] if ended else Called(None, None, None)


def _common_findings(called: Called) -> Judgement | None:
    if called.seconds is None:
        return Judgement("hang", f"the call had not ended after {CALL_LIMIT:g} s")
    error = called.error
    if error is not None and not isinstance(error, RewardError):
        return Judgement("traceback", f"raised {type(error).__name__}: {str(error)[:200]}")
    if called.seconds > CALL_LIMIT:
        return Judgement("hang", f"the call took {called.seconds:.1f} s")
    return None


def judge_failed(
    called: Called, names: Sequence[str], server: Scripted | None, *, retried: bool
) -> Judgement:
    """`named` when the call raised `RewardError` naming one of `names` within `CALL_LIMIT`,
    after `RETRIES + 1` connections if `retried`, else after one."""
    finding = _common_findings(called)
    if finding is not None:
        return finding
    if called.error is None:
        return Judgement("accepted", f"scored {called.scores!r} from the bad reply")
    said = " ".join(str(called.error).split())
    shown = f"{said[:240]} ({called.seconds:.1f} s)"
    if not any(name.lower() in said.lower() for name in names):
        return Judgement("unnamed", f"names none of {list(names)}: {shown}")
    expected = RETRIES + 1 if retried else 1
    if server is not None and server.connections != expected:
        how = "retried" if retried else "sent once"
        detail = f"{server.connections} connections, not {expected} (a reply to be {how}): "
        return Judgement("unnamed", detail + shown)
    return Judgement("named", shown)


def judge_scored(called: Called, server: Scripted, connections: int) -> Judgement:
    """`held` when the call returned `SCORES` after `connections` connections."""
    finding = _common_findings(called)
    if finding is not None:
        return finding
    if called.scores is None:
        return Judgement("unnamed", f"failed where it should have scored: {called.error}")
    if not np.array_equal(called.scores, SCORES) or server.connections != connections:
        return Judgement(
            "unnamed", f"scored {called.scores!r} after {server.connections} connections"
        )
    return Judgement(
        "held", f"scored {called.scores.tolist()} after {connections} connections "
        f"({called.seconds:.1f} s)",
    )  # fmt: skip


# --- faults ---------------------------------------------------------------------------------


def _failing(handler: Handler, names: Sequence[str], retried: bool, workdir: pathlib.Path
             ) -> Judgement:  # fmt: skip
    del workdir
    with scripted(handler) as server:
        called = call_client(server.url)
    return judge_failed(called, names, server, retried=retried)


def _recovering(first: Handler, workdir: pathlib.Path) -> Judgement:
    del workdir
    with scripted(first, answer(scores_reply())) as server:
        called = call_client(server.url)
    return judge_scored(called, server, 2)


def _nothing_listening(workdir: pathlib.Path) -> Judgement:
    del workdir
    with socket.socket() as placeholder:
        placeholder.bind(("127.0.0.1", 0))
        port = placeholder.getsockname()[1]
    called = call_client(f"http://127.0.0.1:{port}")
    return judge_failed(called, ("connection refused",), None, retried=True)


def _https_to_plain_http(workdir: pathlib.Path) -> Judgement:
    del workdir
    refusal = reply_bytes("400 Bad Request", b"plain HTTP here", content_type="text/plain")
    with scripted(answer_unread(refusal)) as server:
        called = call_client(server.url.replace("http://", "https://"))
    return judge_failed(called, ("ssl", "wrong version"), server, retried=True)


def _unread_upload(workdir: pathlib.Path) -> Judgement:
    """A server that accepts a 20 MB upload and never reads it: the send must time out."""
    del workdir
    with scripted(unread) as server:
        called = call_client(server.url, count=7000)
    return judge_failed(called, ("timed out",), server, retried=True)


def _wrong_token(workdir: pathlib.Path) -> Judgement:
    del workdir
    refusal = json_error("401 Unauthorized", "unauthorized", "missing or wrong bearer token.")
    with scripted(answer(refusal)) as server:
        called = call_client(server.url, token="not-the-token")
    return judge_failed(called, ("unauthorized", "401"), server, retried=False)


_SCORE_HEAD = reply_bytes(length=len(npy_bytes(SCORES)))
_MANY_HEADERS = [(f"X-Filler-{index}", "y") for index in range(1000)]
_HTML = b"<html><body><h1>Sign in to the proxy</h1><form>...</form></body></html>"

FAILING: tuple[tuple[str, Handler, tuple[str, ...], bool], ...] = (
    ("reply head trickled a byte per 0.1 s",
     trickle(b"", scores_reply()), ("timed out",), True),
    ("reply body trickled a byte per 0.1 s",
     trickle(_SCORE_HEAD, npy_bytes(SCORES)), ("timed out",), True),
    ("a request answered with silence", silence, ("timed out",), True),
    ("closed without a reply", close_unanswered, ("closed", "disconnected"), True),
    ("reset after the request", reset, ("reset",), True),
    ("a garbage status line", answer(b"HELLO THERE\r\n\r\n"), ("status line", "BadStatusLine"),
     True),
    ("endless 100 Continue", endless_continue, ("timed out",), True),
    ("a 1 MB reply header line",
     answer(reply_bytes(body=npy_bytes(SCORES), headers=[("X-Big", "a" * (1 << 20))])),
     ("header line", "LineTooLong"), True),
    ("a 400 with a 1 MB message",
     answer(json_error("400 Bad Request", "malformed_body", "x" * (1 << 20))), ("400",), False),
    ("1000 reply headers",
     answer(reply_bytes(body=npy_bytes(SCORES), headers=_MANY_HEADERS)), ("headers",), True),
    ("500 every time",
     answer(json_error("500 Internal Server Error", "reward_failed", "the reward raised")),
     ("500", "reward_failed"), True),
    ("400 JSON error",
     answer(json_error("400 Bad Request", "malformed_body", "the header is not valid")),
     ("malformed_body",), False),
    ("413 too large",
     answer(json_error("413 Payload Too Large", "too_large", "exceeds max_request_bytes 10")),
     ("too_large",), False),
    ("404 from another service", answer(reply_bytes("404 Not Found", b"no such page",
                                                    content_type="text/plain")),
     ("404",), False),
    ("302 redirect",
     answer(reply_bytes("302 Found", headers=[("Location", "http://127.0.0.1:9/score")])),
     ("not followed",), False),
    ("scores of the wrong length", answer(scores_reply(np.array([0.5]))),
     ("expected float64 (2,)",), True),
    ("NaN scores", answer(scores_reply(np.array([np.nan, 0.5]))), ("non-finite",), True),
    ("inf scores", answer(scores_reply(np.array([0.5, -np.inf]))), ("non-finite",), True),
    ("float32 scores", answer(scores_reply(SCORES.astype(np.float32))), ("float32",), True),
    ("scores of shape [2, 1]", answer(scores_reply(SCORES[:, None])), ("(2, 1)",), True),
    ("a reply that is not .npy",
     answer(reply_bytes(body=b"0.5,0.25\n", content_type="text/csv")), (".npy",), True),
    ("an HTML page as the reply", answer(reply_bytes(body=_HTML, content_type="text/html")),
     (".npy",), True),
    ("an empty 200 reply", answer(reply_bytes()), (".npy",), True),
    ("pickled object scores",
     answer(reply_bytes(body=pickled_npy(np.array([0.5, {"x": 1}], dtype=object)))),
     ("object", "pickle"), True),
    (".npy claiming 10**12 scores",
     answer(reply_bytes(body=npy_claiming((10**12,), SCORES.tobytes()))),
     ("claims", "longer than"), True),
    ("a reply cut short",
     answer(reply_bytes(body=npy_bytes(SCORES)[:-8], length=len(npy_bytes(SCORES)))),
     ("claims", "incomplete", "bytes"), True),
    ("a 1 TB reply streamed", flood, ("exceeds",), True),
)  # fmt: skip
"""(fault name, the server's handler, words one of which the error must hold, whether the
client must retry)."""

RECOVERING: tuple[tuple[str, Handler], ...] = (
    ("500, then scores",
     answer(json_error("500 Internal Server Error", "reward_failed", "a passing failure"))),
    ("503 busy, then scores",
     answer(json_error("503 Service Unavailable", "busy", "4 requests are already served"))),
    ("408, then scores",
     answer(json_error("408 Request Timeout", "read_timeout", "the body did not arrive"))),
    ("closed without a reply, then scores", close_unanswered),
)  # fmt: skip
"""(fault name, the first connection's handler): the retry must score."""


def _url_of_the_endpoint(workdir: pathlib.Path) -> Judgement:
    """`HttpReward("http://host:port/score")`: the URL of the endpoint, not the base. It once
    posted to /score/score and got "HTTP 404 Not Found: 404: Not Found"; now it means the
    base, and is scored."""
    del workdir
    with scripted(answer_at(b"/score", scores_reply())) as server:
        called = call_client(server.url + "/score")
    return judge_scored(called, server, 1)


def _not_found_names_the_url(workdir: pathlib.Path) -> Judgement:
    """A 404 for a URL with a path the server does not know: the error names the URL
    requested and says `url` must be the base (not retried)."""
    del workdir
    with scripted(answer_at(b"/score", scores_reply())) as server:
        called = call_client(server.url + "/v1")
        requested = f"POST {server.url}/v1/score"
    return judge_failed(called, (requested,), server, retried=False)


def _chunked_scores(workdir: pathlib.Path) -> Judgement:
    """A 200 whose scores come chunked (no Content-Length): valid HTTP, so scored."""
    del workdir
    body = npy_bytes(SCORES)
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/x-npy\r\nTransfer-Encoding: chunked\r\n"
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in (body[:50], body[50:]))
    with scripted(answer(head + b"Connection: close\r\n\r\n" + chunks + b"0\r\n\r\n")) as server:
        called = call_client(server.url)
    return judge_scored(called, server, 1)


def faults() -> list[Fault]:
    """The client's faults."""
    found = [
        Fault("client", "nothing listening", _nothing_listening),
        Fault("client", "https to a plain HTTP server", _https_to_plain_http),
        Fault("client", "401 for a wrong token", _wrong_token),
        Fault("client", "a chunked reply", _chunked_scores),
        Fault("client", "a server that never reads a 20 MB upload", _unread_upload),
        Fault("client", "a URL ending in /score", _url_of_the_endpoint),
        Fault("client", "404: a URL whose path the server lacks", _not_found_names_the_url),
    ]
    found += [
        Fault("client", name, functools.partial(_failing, handler, names, retried))
        for name, handler, names, retried in FAILING
    ]
    found += [
        Fault("client", name, functools.partial(_recovering, handler))
        for name, handler in RECOVERING
    ]
    return found
