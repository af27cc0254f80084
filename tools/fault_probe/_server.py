"""Faults of the reward server: hostile-but-fair requests sent over loopback to a real
`flowgrpo-eqx serve-reward partial` process, a fresh one for each fault.

A bad request must get a 4xx (or 503) reply whose message names what is wrong (`named`); a
fair one must be scored, and a slow or crowding client must be cut off while others are still
served (`held`). After every fault the server must still answer `GET /health`, stop with exit
status 0 on SIGTERM, and have printed no Python traceback. The server runs with a read timeout
of one second (`FAST`), so that a body or head that never arrives is given up on quickly.

Faults the reward itself refuses (samples it cannot score: NaN, a wrong shape, prompts outside
the task) come back as the server's documented 500 `reward_failed`, naming the problem; those
are judged `named` only when the message names it.
"""

import collections
import contextlib
import dataclasses
import functools
import http.client
import io
import json
import os
import pathlib
import select
import signal
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from flowgrpo_eqx import HttpReward, RewardError
from flowgrpo_eqx.rewards._wire import CONTENT_TYPE, MAGIC, TOKEN_ENV, encode_request, npy_bytes
from flowgrpo_eqx.rewards.limits import DEFAULT_MAX_TOTAL_BYTES, DEFAULT_SCORE_CHUNK_BYTES

from ._probe import (
    Fault,
    Finding,
    Judgement,
    Verdict,
    environment,
    flowgrpo_eqx,
    judge_refusal as judge_command_refusal,
    run,
)


START_LIMIT = 90.0
"""Seconds the server may take to print its address (it imports JAX first)."""
REPLY_LIMIT = 15.0
"""Seconds any reply may take; none of these faults needs more than a read timeout or two."""
HEALTH_LIMIT = 5.0
"""Seconds `GET /health` may take, during and after a fault."""
STOP_LIMIT = 15.0
"""Seconds the server may take to exit after SIGTERM."""
READ_TIMEOUT = 1.0
"""The servers' `--read-timeout`: a head or body that has not arrived by then is given up."""
MEMORY_SLACK = 64 << 20
"""Bytes of peak memory a refused request may add to the server: a declared shape must never
be allocated."""
IMAGE_SHAPE = (16, 16, 3)
"""The shapes task's images."""
FAST = ("--read-timeout", str(READ_TIMEOUT))
"""The flags every fault's server runs with."""

Outcome = Literal["refused", "reward refused", "scored"]
"""What a request's fault expects: a 4xx naming the problem, the reward's own 500 naming it
(or a 4xx), or scores."""


@dataclasses.dataclass(frozen=True)
class Reply:
    """An HTTP reply as a client saw it: `status` 0 when the connection closed without one."""

    status: int
    headers: dict[str, str]
    body: bytes
    seconds: float

    def said(self) -> str:
        """The reply's message: `kind: message` of a JSON error, else its text."""
        try:
            parsed = json.loads(self.body)
            said = f"{parsed['error']}: {parsed['message']}"
        except (ValueError, KeyError, TypeError):
            said = self.body[:300].decode("utf-8", "replace")
        return " ".join(said.split()) or "(empty body)"


def read_reply(sock: socket.socket, started: float, *, method: str = "POST") -> Reply:
    """Read one reply from `sock` (its timeout bounds each read), or `Reply(0, ...)` when the
    server closed the connection without one; a read that times out is a `hang`."""
    response = http.client.HTTPResponse(sock, method=method)
    try:
        response.begin()
        body = response.read()
    except TimeoutError:
        raise Finding("hang", f"no reply within {sock.gettimeout():g} s") from None
    except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
        return Reply(0, {}, b"", time.monotonic() - started)
    finally:
        response.close()
    headers = {name.lower(): value for name, value in response.getheaders()}
    return Reply(response.status, headers, body, time.monotonic() - started)


def request_bytes(
    body: bytes = b"",
    *,
    method: str = "POST",
    path: str = "/score",
    headers: Sequence[tuple[str, str]] | None = None,
    length: int | None = None,
    version: str = "HTTP/1.1",
) -> bytes:
    """A raw request: `Host`, `Content-Type` and `Content-Length` (`length`, else the body's
    own; none for a GET) unless `headers` are given, then `Connection: close` and the body."""
    if headers is None:
        headers = [("Host", "127.0.0.1"), ("Connection", "close")]
        if method != "GET":
            size = len(body) if length is None else length
            headers += [("Content-Type", CONTENT_TYPE), ("Content-Length", str(size))]
    head = f"{method} {path} {version}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers)
    return (head + "\r\n").encode("latin-1") + body


@dataclasses.dataclass
class Server:
    """A running `serve-reward` process and its port."""

    process: subprocess.Popen[bytes]
    port: int

    def connect(self, timeout: float = REPLY_LIMIT) -> socket.socket:
        """A new connection to the server, each operation bounded by `timeout`."""
        return socket.create_connection(("127.0.0.1", self.port), timeout=timeout)

    def exchange(
        self,
        data: bytes,
        *,
        method: str = "POST",
        limit: float = REPLY_LIMIT,
        close_write: bool = False,
    ) -> Reply:
        """Send `data` on a new connection (then half-close it if `close_write`) and read the
        reply. A send cut short by the server is not an error: it may have answered first."""
        with self.connect(limit) as sock:
            started = time.monotonic()
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                sock.sendall(data)
                if close_write:
                    sock.shutdown(socket.SHUT_WR)
            return read_reply(sock, started, method=method)

    def post(self, body: bytes, **request: Any) -> Reply:
        """POST `body` to `/score` (see `request_bytes` for `request`)."""
        return self.exchange(request_bytes(body, **request))

    def health(self, when: str) -> None:
        """Raise a finding unless `GET /health` answers 200 within `HEALTH_LIMIT`; `when`
        says when it was asked, for the message."""
        try:
            reply = self.exchange(
                request_bytes(method="GET", path="/health"), method="GET", limit=HEALTH_LIMIT
            )
        except Finding:
            message = f"/health gave no answer within {HEALTH_LIMIT:g} s {when}"
            raise Finding("hang", message) from None
        except OSError as error:
            status = self.process.poll()
            if status is not None:
                raise Finding("traceback", f"the server died {when} (exit {status})") from None
            raise Finding("hang", f"/health refused {when}: {error}") from None
        if reply.status != 200:
            raise Finding("traceback", f"/health answered {reply.status} {when}: {reply.said()}")

    def peak_memory(self) -> int:
        """The server's peak resident memory so far, in bytes (Linux's VmHWM)."""
        status = pathlib.Path(f"/proc/{self.process.pid}/status").read_text()
        (line,) = [line for line in status.splitlines() if line.startswith("VmHWM:")]
        return int(line.split()[1]) * 1024


def _traceback_line(text: str) -> str | None:
    """The exception that ends the last traceback in `text` (with its message's first line
    when that is on the next line), and how many tracebacks there are; None if there are
    none."""
    header = "Traceback (most recent call last)"
    lines = text.splitlines()
    starts = [index for index, line in enumerate(lines) if line.startswith(header)]
    if not starts:
        return None
    after = [line for line in lines[starts[-1] + 1 :] if line.strip()]
    ends = [index for index, line in enumerate(after) if not line[0].isspace()]
    raised = after[ends[0]] if ends else lines[starts[-1]]
    if ends and raised.endswith(":") and ends[0] + 1 < len(after):
        raised += " " + after[ends[0] + 1].strip()
    return f"{raised[:200]} ({len(starts)} traceback(s))"


def _await_address(process: subprocess.Popen[bytes], out: pathlib.Path, err: pathlib.Path) -> int:
    """The port the server prints it serves on."""
    deadline = time.monotonic() + START_LIMIT
    while time.monotonic() < deadline:
        first = out.read_text(errors="replace").partition("\n")
        if first[1]:
            if not first[0].startswith("serving ") or "http://127.0.0.1:" not in first[0]:
                raise Finding("unprobed", f"the server's first line is {first[0]!r}")
            return int(first[0].rsplit(":", 1)[1].strip("/"))
        if process.poll() is not None:
            said = err.read_text(errors="replace").strip()[-300:]
            raise Finding("unprobed", f"the server exited {process.returncode}: {said}")
        time.sleep(0.05)
    raise Finding("unprobed", f"the server printed no address within {START_LIMIT:g} s")


def _kill(process: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def _check_stopped(process: subprocess.Popen[bytes], out: pathlib.Path, err: pathlib.Path) -> None:
    """Stop the server with SIGTERM; raise a finding if it does not exit 0 or printed a
    traceback."""
    process.send_signal(signal.SIGTERM)
    try:
        status = process.wait(STOP_LIMIT)
    except subprocess.TimeoutExpired:
        _kill(process)
        message = f"the server did not exit within {STOP_LIMIT:g} s of SIGTERM"
        raise Finding("hang", message) from None
    printed = out.read_text(errors="replace") + err.read_text(errors="replace")
    raised = _traceback_line(printed)
    if raised is not None:
        raise Finding("traceback", f"the server printed a traceback: {raised}")
    if status != 0:
        raise Finding("traceback", f"the server exited {status} on SIGTERM: {printed[-200:]}")


@contextlib.contextmanager
def serving(workdir: pathlib.Path, *flags: str, reward: str = "partial") -> Iterator[Server]:
    """A fresh `serve-reward REWARD` on a free loopback port with `flags` (after `FAST`),
    stopped with SIGTERM afterwards: the exit must be 0, with no traceback printed."""
    out, err = workdir / "server.out", workdir / "server.err"
    command = flowgrpo_eqx("serve-reward", reward, "--port", "0", *FAST, *flags)
    with open(out, "wb") as out_file, open(err, "wb") as err_file:
        process = subprocess.Popen(
            command, env=environment(), stdin=subprocess.DEVNULL, stdout=out_file,
            stderr=err_file, start_new_session=True,
        )  # fmt: skip
    try:
        yield Server(process, _await_address(process, out, err))
    except BaseException:
        _kill(process)
        raise
    _check_stopped(process, out, err)


# --- bodies -----------------------------------------------------------------------------------


def images(count: int = 2, shape: tuple[int, ...] = IMAGE_SHAPE) -> npt.NDArray[np.float32]:
    """`count` random images in [-1, 1]."""
    return np.random.default_rng(0).uniform(-1, 1, (count, *shape)).astype(np.float32)


def tokens(count: int = 2) -> npt.NDArray[np.int32]:
    """`count` prompts of the shapes task: "a red square left of a green circle", ..."""
    return np.array([[0, 4, 1, 5], [2, 6, 3, 4]] * count, dtype=np.int32)[:count]


def valid_body() -> bytes:
    """A request a client would send: two images and their prompts."""
    return encode_request(images(), {"tokens": tokens()})


def npy_with_header(descr: str, shape: tuple[int, ...] | str, data: bytes = b"") -> bytes:
    """A `.npy` 1.0 blob whose header declares `descr` and `shape` (whatever `data` holds)."""
    header = f"{{'descr': {descr!r}, 'fortran_order': False, 'shape': {shape!s}, }}"
    encoded = header.encode("latin-1")
    encoded += b" " * (-(10 + len(encoded) + 1) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(encoded)) + encoded + data


def pickled_npy(array: npt.NDArray[Any]) -> bytes:
    """`array` as `.npy`, pickled if it holds objects."""
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=True)
    return buffer.getvalue()


def wire(
    blobs: Sequence[tuple[str, bytes]],
    *,
    samples: str = "float",
    rows: str = "dict",
    sizes: Sequence[int] | None = None,
) -> bytes:
    """A body of the wire format holding `blobs`, its header listing `sizes` (else the blobs'
    own lengths)."""
    listed = [len(blob) for _, blob in blobs] if sizes is None else sizes
    arrays = [[name, size] for (name, _), size in zip(blobs, listed, strict=True)]
    header = json.dumps({"samples": samples, "rows": rows, "arrays": arrays}).encode()
    return MAGIC + struct.pack("<I", len(header)) + header + b"".join(b for _, b in blobs)


def with_header(header: bytes, rest: bytes = b"") -> bytes:
    """A body whose header is `header` (any bytes), then `rest`."""
    return MAGIC + struct.pack("<I", len(header)) + header + rest


def with_samples(blob: bytes, count: int = 2) -> bytes:
    """A body holding the samples `blob` and `count` valid prompts."""
    return wire([("samples", blob), ("rows/tokens", npy_bytes(tokens(count)))])


def with_rows(rows: Any, samples: npt.NDArray[Any] | None = None) -> bytes:
    """A body of valid images (or `samples`) with `rows` (as `encode_request` sends them)."""
    return encode_request(images() if samples is None else samples, rows)


def _not_the_magic() -> bytes:
    return b"flowgrpo-reward/0\n" + valid_body()[len(MAGIC) :]


def _nan_samples() -> bytes:
    samples = images()
    samples[1, 3, 4, 0] = np.nan
    return with_samples(npy_bytes(samples))


def _sizes_off_by(delta: int) -> bytes:
    blobs = [("samples", npy_bytes(images())), ("rows/tokens", npy_bytes(tokens()))]
    return wire(blobs, sizes=[len(blobs[0][1]) + delta, len(blobs[1][1])])


def _negative_blob_size() -> bytes:
    blobs = [("samples", npy_bytes(images())), ("rows/tokens", npy_bytes(tokens()))]
    total = sum(len(blob) for _, blob in blobs)
    return wire(blobs, sizes=[-100, total + 100])


def _cut_in_half() -> bytes:
    body = valid_body()
    return body[: len(body) // 2]


def _deep_header() -> bytes:
    depth = 100_000
    return with_header(b"[" * depth + b"]" * depth)


def _digits_axis() -> bytes:
    # 4300 digits: as long as Python will read an int from text; the byte count it implies
    # has more.
    return with_samples(npy_with_header("<f4", (10**4299, *IMAGE_SHAPE), b"\0" * 64))


def _big_npy_header() -> bytes:
    return with_samples(npy_with_header("<f4", "(2," + " " * 60_000 + "16, 16, 3)"))


def _structured_samples() -> bytes:
    array = np.zeros((2, 16, 16), dtype=[("red", "<f4"), ("green", "<f4"), ("blue", "<f4")])
    return with_samples(npy_bytes(array))


WIRE_FAULTS: tuple[tuple[str, Callable[[], bytes], Outcome, tuple[str, ...]], ...] = (
    ("a valid request", valid_body, "scored", ()),
    ("a valid request as uint8 images",
     lambda: encode_request(images(), {"tokens": tokens()}, images_as_uint8=True), "scored", ()),
    ("float16 samples", lambda: with_samples(npy_bytes(images().astype(np.float16))),
     "scored", ()),
    ("int64 samples", lambda: with_samples(npy_bytes(np.ones((2, *IMAGE_SHAPE), np.int64))),
     "scored", ()),
    ("not the magic", _not_the_magic, "refused", ("flowgrpo-reward/1",)),
    ("an empty body", lambda: b"", "refused", ("flowgrpo-reward/1",)),
    ("body ends inside the header length", lambda: MAGIC + b"\x01\x00", "refused",
     ("header length",)),
    ("header length beyond the body",
     lambda: MAGIC + struct.pack("<I", 1 << 19) + b"{}", "refused", ("header length",)),
    ("header not JSON", lambda: with_header(b"{samples: float"), "refused", ("header",)),
    ("header not UTF-8", lambda: with_header(b'{"samples": "\xff\xfe"}'), "refused",
     ("header",)),
    ("header a JSON list", lambda: with_header(b"[1, 2]"), "refused", ("header",)),
    ("header without arrays", lambda: with_header(b'{"samples": "float", "rows": "dict"}'),
     "refused", ("arrays",)),
    ("header arrays not pairs",
     lambda: with_header(b'{"samples": "float", "rows": "dict", "arrays": [["samples"]]}'),
     "refused", ("header",)),
    ("header nested 100000 deep", _deep_header, "refused", ("header", "nest", "deep")),
    ("samples encoded as 'png'",
     lambda: wire([("samples", npy_bytes(images()))], samples="png", rows="none"), "refused",
     ("png",)),
    ("blob sizes disagree with the header", lambda: _sizes_off_by(10), "refused",
     ("add up", "claims")),
    ("a negative blob size", _negative_blob_size, "refused", ("add up",)),
    ("rows listed before samples",
     lambda: wire([("rows/tokens", npy_bytes(tokens())), ("samples", npy_bytes(images()))]),
     "refused", ("'samples' then rows",)),
    ("the same rows twice",
     lambda: wire([("samples", npy_bytes(images())), ("rows/tokens", npy_bytes(tokens())),
                   ("rows/tokens", npy_bytes(tokens()))]),
     "refused", ("'samples' then rows",)),
    ("a rows key both array and folder",
     lambda: wire([("samples", npy_bytes(images())), ("rows/tokens", npy_bytes(tokens())),
                   ("rows/tokens/b", npy_bytes(tokens()))]),
     "refused", ("rows/tokens",)),
    ("the body cut in half", _cut_in_half, "refused", ("add up", "claims")),
    ("samples not .npy", lambda: with_samples(os.urandom(3072)), "refused", (".npy",)),
    ("declared 3e9 rows of nothing",
     lambda: with_samples(npy_with_header("<f4", (3_000_000_000, 0, 16, 3))), "refused",
     ("no element",)),
    ("a negative axis",
     lambda: with_samples(npy_with_header("<f4", (-2, *IMAGE_SHAPE), images().tobytes())),
     "refused", ("shape",)),
    ("an axis of 10**12",
     lambda: with_samples(npy_with_header("<f4", (10**12, *IMAGE_SHAPE), images().tobytes())),
     "refused", ("claims", "longer than")),
    ("an element count past int64",
     lambda: with_samples(npy_with_header("<f4", (2**31, 2**31, 2**31, 3), b"\0" * 4096)),
     "refused", ("claims", "longer than")),
    ("an axis of 4300 digits", _digits_axis, "refused", ("claims", "shape", "digits")),
    ("a 60 kB .npy header", _big_npy_header, "refused", ("header",)),
    ("a .npy header of version 3.0",
     lambda: with_samples(npy_bytes(images()).replace(b"\x93NUMPY\x01\x00", b"\x93NUMPY\x03\x00",
                                                      1)),
     "refused", ("version",)),
    ("a .npy shape that is a string",
     lambda: with_samples(npy_with_header("<f4", "'big'", images().tobytes())), "refused",
     ("shape",)),
    ("a zero-byte dtype", lambda: with_samples(npy_with_header("|V0", (2, *IMAGE_SHAPE))),
     "refused", ("V0", "dtype")),
    ("complex samples", lambda: with_samples(npy_bytes(images().astype(np.complex64))),
     "refused", ("complex",)),
    ("datetime samples",
     lambda: with_samples(npy_bytes(np.zeros((2, *IMAGE_SHAPE), "datetime64[s]"))), "refused",
     ("datetime",)),
    ("timedelta samples",
     lambda: with_samples(npy_bytes(np.zeros((2, *IMAGE_SHAPE), "timedelta64[ms]"))),
     "refused", ("timedelta",)),
    ("pickled object samples",
     lambda: with_samples(pickled_npy(np.array([{"x": 1}, None], dtype=object))), "refused",
     ("object", "pickle")),
    ("structured samples", _structured_samples, "refused", ("red", "dtype")),
    ("bool samples", lambda: with_samples(npy_bytes(np.ones((2, *IMAGE_SHAPE), bool))),
     "refused", ("bool",)),
    ("a scalar as samples", lambda: with_samples(npy_bytes(np.array(0.5, np.float32)), 1),
     "refused", ("batch axis", "shape")),
    ("NaN samples", _nan_samples, "reward refused", ("nan",)),
    ("samples of rank 3", lambda: with_samples(npy_bytes(images()[..., 0])), "reward refused",
     ("shape",)),
    ("8x8 images", lambda: with_samples(npy_bytes(images(shape=(8, 8, 3)))), "reward refused",
     ("shape",)),
    ("3 prompts for 2 samples", lambda: with_rows({"tokens": tokens(3)}), "refused",
     ("leading axis",)),
    ("no rows", lambda: with_rows(None), "reward refused", ("rows", "tokens")),
    ("rows an array, not a dict", lambda: with_rows(tokens()), "reward refused",
     ("rows", "tokens")),
    ("rows without tokens", lambda: with_rows({"prompt": tokens()}), "reward refused",
     ("tokens",)),
    ("a prompt outside the vocabulary",
     lambda: with_rows({"tokens": np.full((2, 4), 9, np.int32)}), "reward refused",
     ("colour", "shape entries", "tokens")),
    ("prompts as text",
     lambda: with_rows({"tokens": np.array([["red", "circle", "blue", "square"]] * 2)}),
     "reward refused", ("integer", "dtype")),
)  # fmt: skip
"""(fault name, body, what must happen, words one of which a refusal must hold)."""


# --- judgements -------------------------------------------------------------------------------


def judge_refusal(
    reply: Reply,
    names: Sequence[str],
    *,
    reward_refused: bool = False,
    status: int | None = None,
) -> Judgement:
    """`named` for a 4xx or 503 (or, with `reward_refused`, the reward's 500 `reward_failed`)
    whose message holds one of `names`, and whose status is `status` where one is given;
    else the finding that applies."""
    said = reply.said()
    shown = f"{reply.status} {said[:200]}"
    if reply.status == 0:
        return Judgement(
            "unnamed", f"closed the connection without a reply ({reply.seconds:.1f} s)"
        )
    if 200 <= reply.status < 300:
        return Judgement("accepted", f"{reply.status}: the fault was answered as valid")
    reward_failed = reward_refused and reply.status == 500 and said.startswith("reward_failed")
    if not (400 <= reply.status < 500 or reply.status == 503 or reward_failed):
        return Judgement("traceback", f"answered {shown}")
    if not any(name.lower() in said.lower() for name in names):
        return Judgement("unnamed", f"names none of {list(names)}: {shown}")
    if status is not None and reply.status != status:
        return Judgement("unnamed", f"not {status}: {shown}")
    return Judgement("named", shown)


def judge_scores(reply: Reply, count: int, bounds: tuple[float, float] = (0.0, 1.0)) -> Judgement:
    """`held` for a 200 holding `count` finite float64 scores in `bounds` ([0, 1], the
    shapes task's rewards)."""
    if reply.status != 200:
        verdict: Verdict = "unnamed" if 400 <= reply.status < 500 else "traceback"
        raise Finding(verdict, f"a fair request got {reply.status}: {reply.said()[:200]}")
    try:
        scores = np.load(io.BytesIO(reply.body), allow_pickle=False)
    except ValueError as error:
        raise Finding("unnamed", f"200, but not .npy: {error}") from None
    if scores.dtype != np.float64 or scores.shape != (count,):
        raise Finding("unnamed", f"200, but {scores.dtype} {scores.shape}, not float64 ({count},)")
    low, high = bounds
    if not (np.isfinite(scores).all() and (low <= scores).all() and (scores <= high).all()):
        outside = scores[~((low <= scores) & (scores <= high))][:5].tolist()
        raise Finding("unnamed", f"200, but scores such as {outside} are not in [{low}, {high}]")
    shown = scores[:8].round(3).tolist()
    return Judgement("held", f"200 in {reply.seconds:.2f} s: scores {shown}")


def _declared_count(body: bytes) -> int:
    """The leading axis of the samples in a body made by `encode_request`."""
    head = io.BytesIO(body[body.index(b"\x93NUMPY") + 8 :])
    shape, _, _ = np.lib.format.read_array_header_1_0(head)
    return int(shape[0])


def _wire_fault(make: Callable[[], bytes], outcome: Outcome, names: Sequence[str],
                workdir: pathlib.Path) -> Judgement:  # fmt: skip
    body = make()
    with serving(workdir) as server:
        before = server.peak_memory()
        reply = server.post(body)
        grown = server.peak_memory() - before
        server.health("after the fault")
    if outcome == "scored":
        judgement = judge_scores(reply, _declared_count(body))
    else:
        judgement = judge_refusal(reply, names, reward_refused=outcome == "reward refused")
    if grown > MEMORY_SLACK:
        return Judgement("accepted", f"peak memory grew {grown >> 20} MiB; {judgement.detail}")
    return judgement


# --- faults of HTTP itself --------------------------------------------------------------------


def _raw_refused(data: bytes, names: Sequence[str], workdir: pathlib.Path) -> Judgement:
    """Send `data` as it is; a 4xx naming the problem, or the connection closed, is right."""
    with serving(workdir) as server:
        reply = server.exchange(data)
        server.health("after the fault")
    if reply.status == 0:
        return Judgement("held", f"connection closed without a reply in {reply.seconds:.1f} s")
    return judge_refusal(reply, names)


def _many_headers(workdir: pathlib.Path) -> Judgement:
    lines = [("Host", "127.0.0.1"), *((f"X-Filler-{i}", "y") for i in range(20_000))]
    data = request_bytes(method="GET", path="/health", headers=[*lines, ("Connection", "close")])
    with serving(workdir) as server:
        reply = server.exchange(data, method="GET")
        server.health("after the fault")
    if reply.status == 200:
        return Judgement("held", "/health answered despite 20000 headers")
    return judge_refusal(reply, ("header",))


def _huge_header_line(workdir: pathlib.Path) -> Judgement:
    headers = [("Host", "127.0.0.1"), ("X-Big", "a" * (1 << 20)), ("Connection", "close")]
    data = request_bytes(method="GET", path="/health", headers=headers)
    return _raw_refused(data, ("header", "8190 bytes", "line"), workdir)


def _too_large(workdir: pathlib.Path) -> Judgement:
    """A Content-Length beyond --max-request-bytes: 413 at once, without sending the body."""
    with serving(workdir, "--max-request-bytes", "100000") as server:
        reply = server.exchange(request_bytes(length=10**9), limit=READ_TIMEOUT / 2 + 2)
        server.health("after the fault")
    return judge_refusal(reply, ("max_request_bytes",), status=413)


def _content_length_beyond_the_body(workdir: pathlib.Path) -> Judgement:
    """A Content-Length 1000 bytes beyond what is sent: 408 after the read timeout."""
    body = valid_body()
    with serving(workdir) as server:
        reply = server.exchange(request_bytes(body, length=len(body) + 1000))
        server.health("after the fault")
    judgement = judge_refusal(reply, ("did not arrive",))
    if reply.status != 0 and reply.seconds > READ_TIMEOUT + 3:
        return Judgement("hang", f"answered only after {reply.seconds:.1f} s: {judgement.detail}")
    return judgement


def _body_ends_early(workdir: pathlib.Path) -> Judgement:
    """A Content-Length beyond the body, then the client half-closes. aiohttp takes the end
    of the client's stream for a lost connection, so the server closes it at once (a 400
    naming the early end is as good, if it comes); either way it stays healthy."""
    body = valid_body()
    with serving(workdir) as server:
        reply = server.exchange(request_bytes(body, length=len(body) + 1000), close_write=True)
        server.health("after the fault")
    if reply.status == 0:
        return Judgement("held", f"closed the connection at once ({reply.seconds:.1f} s)")
    return judge_refusal(reply, ("ended before",))


def _token_fault(given: str | None, workdir: pathlib.Path) -> Judgement:
    headers = [("Host", "127.0.0.1"), ("Connection", "close"), ("Content-Type", CONTENT_TYPE)]
    body = valid_body()
    headers.append(("Content-Length", str(len(body))))
    if given is not None:
        headers.append(("Authorization", given))
    with serving(workdir, "--token", "s3cret-token") as server:
        reply = server.post(body, headers=headers)
        server.health("after the fault")
    if given == "Bearer s3cret-token":
        return judge_scores(reply, 2)
    return judge_refusal(reply, ("token",), status=401)


def _valid_http_1_0(workdir: pathlib.Path) -> Judgement:
    body = valid_body()
    with serving(workdir) as server:
        reply = server.post(body, version="HTTP/1.0")
        server.health("after the fault")
    return judge_scores(reply, 2)


def _keep_alive_then_garbage(workdir: pathlib.Path) -> Judgement:
    """A valid request on a kept-alive connection, then garbage on the same connection."""
    body = valid_body()
    headers = [("Host", "127.0.0.1"), ("Connection", "keep-alive"),
               ("Content-Type", CONTENT_TYPE), ("Content-Length", str(len(body)))]  # fmt: skip
    with serving(workdir) as server, server.connect() as sock:
        started = time.monotonic()
        sock.sendall(request_bytes(body, headers=headers))
        first = read_reply(sock, started)
        started = time.monotonic()
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(b"\x00\x01GARBAGE \xff\xfe\r\n\r\n")
        second = read_reply(sock, started)
        server.health("after the fault")
    scored = judge_scores(first, 2)
    if second.status == 0:
        return Judgement("held", f"{scored.detail}; then the garbage's connection was closed")
    if 400 <= second.status < 500:
        return Judgement("held", f"{scored.detail}; then {second.status} {second.said()[:100]}")
    return Judgement("accepted", f"the garbage got {second.status}: {second.said()[:100]}")


def _trickle_until_closed(
    sock: socket.socket, data: bytes, pause: float, limit: float, server: Server
) -> tuple[float | None, bytes]:
    """Send `data` a byte per `pause` s until the server closes the connection or `limit` s
    have passed (then None); /health must answer half a second in."""
    started = time.monotonic()
    checked = False
    received = b""
    for byte in data:
        elapsed = time.monotonic() - started
        if elapsed > limit:
            return None, received
        if not checked and elapsed > 0.5:
            server.health("while a connection trickles")
            checked = True
        try:
            sock.sendall(bytes([byte]))
            readable, _, _ = select.select([sock], [], [], pause)
            if readable:
                chunk = sock.recv(65536)
                received += chunk
                if not chunk:
                    return time.monotonic() - started, received
        except (BrokenPipeError, ConnectionResetError):
            return time.monotonic() - started, received
    return None, received


def _trickled_head(workdir: pathlib.Path) -> Judgement:
    """A request head trickled a byte per 0.2 s: closed after the read timeout."""
    data = request_bytes(method="GET", path="/health") * 4
    with serving(workdir) as server, server.connect() as sock:
        closed, received = _trickle_until_closed(sock, data, 0.2, 10.0, server)
        server.health("after the fault")
    if closed is None:
        return Judgement("hang", "a head trickled a byte per 0.2 s was still read after 10 s")
    if closed > READ_TIMEOUT + 3:
        return Judgement("hang", f"the trickling connection was closed only after {closed:.1f} s")
    shown = received[:40].decode("latin-1")
    return Judgement("held", f"closed after {closed:.1f} s ({shown!r}); /health answered")


def _trickled_body(workdir: pathlib.Path) -> Judgement:
    """A body trickled a byte per 0.1 s: 408 after the read timeout."""
    body = valid_body()
    with serving(workdir) as server, server.connect() as sock:
        sock.sendall(request_bytes(length=len(body)))
        closed, received = _trickle_until_closed(sock, body, 0.1, 10.0, server)
        server.health("after the fault")
    if closed is None:
        return Judgement("hang", "a body trickled a byte per 0.1 s was still read after 10 s")
    if closed > READ_TIMEOUT + 3:
        return Judgement("hang", f"the trickling body was cut off only after {closed:.1f} s")
    status = received.split(b"\r\n", 1)[0].decode("latin-1")
    if b" 408 " not in received[:20] or b"did not arrive" not in received:
        return Judgement("unnamed", f"cut off after {closed:.1f} s with {status!r}")
    return Judgement("named", f"{status} after {closed:.1f} s; /health answered")


def _slow_uploads(workdir: pathlib.Path) -> Judgement:
    """Three slow uploads at once with --max-concurrent-requests 2: a body still arriving
    takes no place, so a fair request is scored meanwhile; the three get 408 after the read
    timeout, and /health answers throughout."""
    body = valid_body()
    head = request_bytes(length=len(body))
    with serving(workdir, "--max-concurrent-requests", "2") as server:
        held = [server.connect() for _ in range(3)]
        try:
            started = time.monotonic()
            for sock in held:
                sock.sendall(head + body[:100])
            time.sleep(0.3)
            fair = server.post(body)
            server.health("while three uploads are held")
            late = [read_reply(sock, started) for sock in held]
        finally:
            for sock in held:
                sock.close()
        server.health("after the fault")
    if fair.status != 200:
        return Judgement("hang", f"a fair request got {fair.status}: {fair.said()[:160]}")
    scored = judge_scores(fair, 2)
    statuses = [reply.status for reply in late]
    if statuses != [408, 408, 408] or max(r.seconds for r in late) > READ_TIMEOUT + 3:
        seconds = [round(r.seconds, 1) for r in late]
        return Judgement("hang", f"the slow uploads got {statuses} after {seconds} s")
    return Judgement("held", f"fair request: {scored.detail[:60]}; slow ones: 408")


def _trickled_bodies_and_a_fair_client(workdir: pathlib.Path) -> Judgement:
    """Four clients that each announce a 1 MB body and send a byte of it every 0.5 s, under
    the default read timeout (30 s): a fair `HttpReward(timeout=5, retries=2)` must still be
    scored (they once took every place, and it got 503 three times in 1.5 s)."""
    head = request_bytes(length=1_000_000)
    with serving(workdir, "--read-timeout", "30") as server:
        slow = [server.connect() for _ in range(4)]
        stop = threading.Event()

        def trickle() -> None:
            while not stop.wait(0.5):
                for sock in slow:
                    with contextlib.suppress(OSError):
                        sock.send(b"x")

        trickling = threading.Thread(target=trickle, daemon=True)
        try:
            for sock in slow:
                sock.sendall(head)
            trickling.start()
            time.sleep(0.5)
            started = time.monotonic()
            client = HttpReward(f"http://127.0.0.1:{server.port}", timeout=5.0, retries=2)
            try:
                scores = client(images(), {"tokens": tokens()})
            except RewardError as error:
                said = " ".join(str(error).split())[:200]
                raise Finding("hang", f"a fair client was not scored: {said}") from None
            seconds = time.monotonic() - started
            server.health("while four bodies trickle")
        finally:
            stop.set()
            if trickling.is_alive():
                trickling.join(2.0)
            for sock in slow:
                sock.close()
        server.health("after the fault")
    return Judgement("held", f"a fair client scored {scores.size} in {seconds:.2f} s meanwhile")


def _too_many_rows(make: Callable[[], npt.NDArray[Any]], workdir: pathlib.Path) -> Judgement:
    """More rows than the default --max-request-rows (65536), sent as uint8: 413 naming the
    limit, without the reward's thread spending a moment on them."""
    samples = make()
    count = samples.shape[0]
    body = encode_request(samples, {"tokens": tokens(count)}, images_as_uint8=True)
    with serving(workdir) as server:
        reply = server.post(body)
        server.health("after the fault")
    return judge_refusal(reply, ("max_request_rows",), status=413)


def _many_images(workdir: pathlib.Path) -> Judgement:
    """70000 uint8 images the reward would score, with their prompts: more rows than the
    default --max-request-rows (65536), so 413 naming it (once they were scored)."""
    count = 70_000
    samples = npy_bytes(np.full((count, *IMAGE_SHAPE), 128, np.uint8))
    body = wire([("samples", samples), ("rows/tokens", npy_bytes(tokens(count)))], samples="uint8")
    with serving(workdir) as server:
        reply = server.post(body)
        server.health("after the fault")
    return judge_refusal(reply, ("max_request_rows",), status=413)


def _grey_pixels(count: int) -> npt.NDArray[np.float32]:
    """`count` 1x1 grey "images" `[count, 1, 1]`: a row per byte once sent as uint8."""
    return np.zeros((count, 1, 1), np.float32)


BIG_UINT8_SHAPE = (16000, 64, 64, 3)
"""The issue's large body: 188 MiB of uint8 images, 752 MiB as the float32 the reward gets."""
BIG_BODY_MULTIPLE = 1.25
"""The most a refused 188 MiB uint8 body may grow the server's peak memory, in bodies
(docs/reward_server.md gives the measured figure)."""


def _big_uint8_body() -> bytes:
    """A request of `BIG_UINT8_SHAPE` uint8 images, without rows."""
    samples = npy_bytes(np.zeros(BIG_UINT8_SHAPE, np.uint8))
    return wire([("samples", samples)], samples="uint8", rows="none")


def _big_uint8_bodies(count: int, workdir: pathlib.Path) -> Judgement:
    """`count` bodies of 188 MiB uint8 images at once to the default server: each gets 413
    naming --max-decoded-bytes (752 MiB as float32, over 256 MiB) or, while others are
    held, 429 naming --max-bytes-per-peer (all come from one address) or --max-total-bytes;
    the server's peak memory grows by at most
    `BIG_BODY_MULTIPLE` bodies for one, and by the default --max-total-bytes (512 MiB) and
    one body for several."""
    data = request_bytes(_big_uint8_body())
    with serving(workdir, "--read-timeout", "30") as server:
        before = server.peak_memory()
        replies: list[Reply | BaseException] = []

        def send() -> None:
            try:
                replies.append(server.exchange(data, limit=60.0))
            except BaseException as error:  # noqa: BLE001 - handed back to the probe
                replies.append(error)

        senders = [threading.Thread(target=send, daemon=True) for _ in range(count)]
        for sender in senders:
            sender.start()
        for sender in senders:
            sender.join(90.0)
        grown = server.peak_memory() - before
        server.health("after the fault")
    if len(replies) != count:
        raise Finding("hang", f"{count - len(replies)} of {count} bodies got no reply in 90 s")
    judgements = []
    for reply in replies:
        if isinstance(reply, BaseException):
            raise reply
        names = ("max_decoded_bytes", "max_total_bytes", "max_bytes_per_peer")
        judgement = judge_refusal(reply, names)
        if judgement.verdict != "named" or reply.status not in (413, 429):
            return judgement
        judgements.append(f"{reply.status} {json.loads(reply.body)['limit']}")
    body = len(data)
    bound = BIG_BODY_MULTIPLE * body if count == 1 else DEFAULT_MAX_TOTAL_BYTES + body
    shown = f"peak memory grew {grown / body:.2f} bodies ({grown >> 20} MiB)"
    if grown > bound:
        return Judgement("accepted", f"{shown}, over {bound / body:.2f}; {judgements}")
    return Judgement("named", f"{sorted(judgements)}; {shown}")


def _empty_token(workdir: pathlib.Path) -> Judgement:
    """`serve-reward --token ''`: refused, naming --token (it once served with no token)."""
    command = flowgrpo_eqx("serve-reward", "partial", "--token", "", "--port", "0")
    env = {k: v for k, v in environment().items() if k != TOKEN_ENV}
    ran = run(command, timeout=START_LIMIT, cwd=workdir, env=env)
    return judge_command_refusal(ran, limit=START_LIMIT, names=("--token",))


def _disconnect_mid_body(workdir: pathlib.Path) -> Judgement:
    """A client that resets its connection halfway through a body; the server goes on."""
    body = valid_body()
    with serving(workdir) as server:
        with server.connect() as sock:
            sock.sendall(request_bytes(length=len(body) * 4) + body)
            time.sleep(0.1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        time.sleep(0.2)
        server.health("after a reset mid-body")
        after = judge_scores(server.post(body), 2)
    return Judgement("held", f"the next request: {after.detail}")


def _idle_flood(workdir: pathlib.Path) -> Judgement:
    """60 idle connections with --max-connections 8 (and a 5 s read timeout): /health still
    answers, and the longest-idle connections are closed."""
    count = 60
    with serving(workdir, "--max-connections", "8", "--read-timeout", "5") as server:
        idle = []
        try:
            for _ in range(count):
                idle.append(server.connect())
            time.sleep(0.3)
            started = time.monotonic()
            server.health(f"with {count} idle connections open")
            answered = time.monotonic() - started
            time.sleep(0.2)
            readable, _, _ = select.select(idle, [], [], 0)
            closed = sum(1 for sock in readable if _closed(sock))
        finally:
            for sock in idle:
                sock.close()
        server.health("after the fault")
    if closed < count - 8:
        return Judgement("hang", f"only {closed} of {count} idle connections were closed")
    return Judgement("held", f"/health answered in {answered:.2f} s; {closed} idle closed")


def _closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except OSError:
        return True


def _health_during_decode(workdir: pathlib.Path) -> Judgement:
    """A 60 MB valid request (decoded off the event loop): /health answers meanwhile."""
    count = 4000
    body = encode_request(images(count), {"tokens": tokens(count)})
    with serving(workdir, "--read-timeout", "20") as server:
        result: list[Reply | BaseException] = []

        def send() -> None:
            try:
                result.append(server.post(body))
            except BaseException as error:  # noqa: BLE001 - handed back to the probe
                result.append(error)

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        time.sleep(0.2)
        started = time.monotonic()
        server.health("while a large batch is read and scored")
        answered = time.monotonic() - started
        sender.join(REPLY_LIMIT * 2)
        if sender.is_alive() or not result:
            raise Finding("hang", f"the large batch got no reply within {REPLY_LIMIT * 2:g} s")
        reply = result[0]
        if isinstance(reply, BaseException):
            raise reply
        server.health("after the fault")
    scored = judge_scores(reply, count)
    return Judgement("held", f"/health answered in {answered:.2f} s; {scored.detail[:60]}")


# --- one peer against the others ----------------------------------------------------------

HOSTILE = "127.0.0.2"
"""The hostile peer's address (on Linux, every 127.x.y.z is this machine); the well-behaved
client calls from 127.0.0.1."""


def _hostile(server: Server, timeout: float = REPLY_LIMIT) -> socket.socket:
    """A new connection to the server from `HOSTILE`."""
    return socket.create_connection(
        ("127.0.0.1", server.port), timeout=timeout, source_address=(HOSTILE, 0)
    )


def _first_bytes(sock: socket.socket, count: int = 12) -> bytes:
    """What `sock` has received first (nothing when the server reset it)."""
    try:
        return sock.recv(count)
    except OSError:
        return b""


def _fair_calls(server: Server, count: int = 3) -> str:
    """`count` calls of `HttpReward(url)` with its defaults (timeout 30 s, 2 retries) from
    127.0.0.1, each of which must be scored, and `/health` between them; what they took."""
    client = HttpReward(f"http://127.0.0.1:{server.port}")
    seconds = []
    for index in range(count):
        started = time.monotonic()
        try:
            client(images(8), {"tokens": tokens(8)})
        except RewardError as error:
            said = " ".join(str(error).split())[:220]
            raise Finding(
                "hang", f"call {index + 1} of a client beside it failed: {said}"
            ) from None
        seconds.append(time.monotonic() - started)
        server.health(f"after call {index + 1} of a client beside it")
    return f"{count} calls beside it scored in {min(seconds):.1f} to {max(seconds):.1f} s"


def _peer_slow_uploads(workdir: pathlib.Path) -> Judgement:
    """300 slow uploads from one address (more than --max-connections, each busy reading its
    body, none idle): three real `HttpReward` calls and /health once failed with connection
    resets. One peer keeps at most --max-connections-per-peer; the others are answered 429."""
    head = request_bytes(length=1_000_000)
    with serving(workdir, "--read-timeout", "30") as server:
        held: list[socket.socket] = []
        try:
            for _ in range(300):
                sock = _hostile(server)
                with contextlib.suppress(OSError):
                    sock.sendall(head + bytes(100))
                held.append(sock)
            time.sleep(0.5)
            fair = _fair_calls(server)
            readable, _, _ = select.select(held, [], [], 0)
            answered = sum(1 for sock in readable if _first_bytes(sock).startswith(b"HTTP/1.1 429"))
        finally:
            for sock in held:
                sock.close()
        server.health("after the fault")
    return Judgement("held", f"{fair}; {answered} of its 300 answered 429")


def _peer_held_bodies(workdir: pathlib.Path) -> Judgement:
    """Two 256 MiB bodies from one address, each held one byte short of complete: they once
    took the whole --max-total-bytes, and every real client got 429 until they timed out.
    The second is refused past --max-bytes-per-peer, and a client beside them is scored."""
    size = 256 << 20
    chunk = bytes(1 << 20)
    with serving(workdir, "--read-timeout", "30") as server:
        bodies = [_hostile(server, timeout=60.0) for _ in range(2)]
        try:
            for sock in bodies:
                sock.sendall(request_bytes(length=size))
                left = size - 1
                with contextlib.suppress(OSError):
                    while left:
                        left -= sock.send(chunk[: min(len(chunk), left)])
            time.sleep(0.3)
            readable, _, _ = select.select(bodies, [], [], 0)
            refused = [_first_bytes(sock, 4096) for sock in readable]
            fair = _fair_calls(server)
        finally:
            for sock in bodies:
                sock.close()
        server.health("after the fault")
    said = [reply for reply in refused if b"max_bytes_per_peer" in reply]
    if not said:
        return Judgement("accepted", f"neither body was refused past max_bytes_per_peer: {fair}")
    return Judgement("held", f"{fair}; its second body got 429 max_bytes_per_peer")


def _peer_row_senders(workdir: pathlib.Path) -> Judgement:
    """Four threads of one address sending 64 kB requests of 65536 1x1 uint8 images to
    `jpeg_incompressibility`: they once took every row and place (3,133 of theirs got 429,
    and so did all three real calls). One peer holds at most --max-rows-per-peer and
    --max-requests-per-peer, and a client beside it waits at most behind what it holds."""
    body = request_bytes(encode_request(np.zeros((65536, 1, 1), np.float32), None,
                                        images_as_uint8=True))  # fmt: skip
    statuses: collections.Counter[str] = collections.Counter()
    stop = threading.Event()
    with serving(workdir, "--read-timeout", "30", reward="jpeg_incompressibility") as server:

        def send() -> None:
            while not stop.is_set():
                try:
                    with _hostile(server, timeout=60.0) as sock:
                        sock.sendall(body)
                        first = sock.recv(12)
                    statuses[first[9:12].decode("latin-1") or "closed"] += 1
                except OSError as error:
                    statuses[type(error).__name__] += 1

        senders = [threading.Thread(target=send, daemon=True) for _ in range(4)]
        for sender in senders:
            sender.start()
        try:
            time.sleep(1.0)
            fair = _fair_calls(server)
        finally:
            stop.set()
            for sender in senders:
                sender.join(60.0)
        server.health("after the fault")
    return Judgement("held", f"{fair}; its requests: {dict(statuses)}")


JPEG_MEMORY_SLACK = 64 << 20
"""Bytes of peak memory a scored request may add beyond its body and two chunks (the
float32 of one, the JPEG reward's blocks): buffers, the reply, the allocator's keep."""


def _scored_memory(
    samples: npt.NDArray[np.float32], uint8: bool, workdir: pathlib.Path
) -> Judgement:
    """One request scored by `jpeg_incompressibility` under the default limits: it must be
    scored, and the server's peak memory grow by at most the body, two chunks of
    --score-chunk-bytes and `JPEG_MEMORY_SLACK` (a 60 MiB uint8 body once grew it 28.9
    times, a 188 MiB float32 one 6.9 times)."""
    data = request_bytes(encode_request(samples, None, images_as_uint8=uint8))
    body = len(data)
    with serving(workdir, "--read-timeout", "60", reward="jpeg_incompressibility") as server:
        time.sleep(0.3)
        before = server.peak_memory()
        reply = server.exchange(data, limit=120.0)
        grown = server.peak_memory() - before
        server.health("after the fault")
    # JPEG sizes in kB: a 64x64 image of noise at quality 95 is a few kB, never 100.
    judge_scores(reply, samples.shape[0], bounds=(0.0, 100.0))
    bound = body + 2 * DEFAULT_SCORE_CHUNK_BYTES + JPEG_MEMORY_SLACK
    shown = f"peak memory grew {grown / body:.2f} bodies ({grown >> 20} MiB of {body >> 20} MiB)"
    if grown > bound:
        return Judgement("accepted", f"{shown}, over the bound {bound >> 20} MiB")
    return Judgement("held", f"scored; {shown}")


def _uint8_images_60_mib() -> npt.NDArray[np.float32]:
    return np.random.default_rng(0).uniform(-1, 1, (20480, 32, 32, 3)).astype(np.float32)


def _float32_images_188_mib() -> npt.NDArray[np.float32]:
    return np.random.default_rng(0).uniform(-1, 1, (4000, 64, 64, 3)).astype(np.float32)


HTTP_FAULTS: tuple[tuple[str, Callable[[pathlib.Path], Judgement]], ...] = (
    ("GET /score", functools.partial(
        _raw_refused, request_bytes(method="GET", path="/score"), ("method not allowed",))),
    ("POST to an unknown path", functools.partial(
        _raw_refused, request_bytes(valid_body(), path="/scores"), ("not found",))),
    ("a malformed request line",
     functools.partial(_raw_refused, b"BLAH\r\n\r\n", ("method", "request line"))),
    ("a TLS hello on the HTTP port", functools.partial(
        _raw_refused, b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(64), ("https",))),
    ("an HTTP/2 preface", functools.partial(
        _raw_refused, b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", ("PRI", "HTTP/2", "upgrade"))),
    ("20000 headers", _many_headers),
    ("a 1 MB header line", _huge_header_line),
    ("Content-Length not a number", functools.partial(
        _raw_refused, request_bytes(headers=[("Host", "x"), ("Content-Length", "abc")]),
        ("content-length",))),
    ("two Content-Lengths", functools.partial(
        _raw_refused,
        request_bytes(b"abcdef", headers=[("Host", "x"), ("Content-Length", "5"),
                                          ("Content-Length", "6")]),
        ("content-length",))),
    ("Content-Length and chunked", functools.partial(
        _raw_refused,
        request_bytes(b"0\r\n\r\n", headers=[("Host", "x"), ("Content-Length", "5"),
                                             ("Transfer-Encoding", "chunked")]),
        ("content-length", "transfer-encoding"))),
    ("a chunked body of 1 TB", functools.partial(
        _raw_refused,
        request_bytes(b"ffffffffff\r\n" + bytes(4096),
                      headers=[("Host", "x"), ("Transfer-Encoding", "chunked")]),
        ("content-length",))),
    ("a body without Content-Length", functools.partial(
        _raw_refused, request_bytes(valid_body(), headers=[("Host", "x"), ("Connection", "close")]),
        ("content-length", "data after"))),
    ("Content-Length beyond --max-request-bytes", _too_large),
    ("Content-Length beyond the body sent", _content_length_beyond_the_body),
    ("the body ends before its Content-Length", _body_ends_early),
    ("no token", functools.partial(_token_fault, None)),
    ("a wrong token", functools.partial(_token_fault, "Bearer s3cret-tokem")),
    ("a token without Bearer", functools.partial(_token_fault, "s3cret-token")),
    ("the right token", functools.partial(_token_fault, "Bearer s3cret-token")),
    ("a valid request over HTTP/1.0", _valid_http_1_0),
    ("keep-alive, then garbage", _keep_alive_then_garbage),
    ("a head trickled a byte per 0.2 s", _trickled_head),
    ("a body trickled a byte per 0.1 s", _trickled_body),
    ("3 slow uploads, 2 places: a fair request scored meanwhile", _slow_uploads),
    ("4 bodies of 1 MB trickled a byte per 0.5 s, then HttpReward",
     _trickled_bodies_and_a_fair_client),
    ("200000 rows of 1x1 uint8 samples (200 kB)",
     functools.partial(_too_many_rows, lambda: _grey_pixels(200_000))),
    ("70000 rows of 16x16 uint8 images (54 MB)", _many_images),
    ("a 188 MiB body of uint8 (16000, 64, 64, 3)", functools.partial(_big_uint8_bodies, 1)),
    ("four 188 MiB uint8 bodies at once", functools.partial(_big_uint8_bodies, 4)),
    ("serve-reward --token ''", _empty_token),
    ("a reset halfway through a body", _disconnect_mid_body),
    ("60 idle connections, 8 allowed", _idle_flood),
    ("/health during a 4000-image batch", _health_during_decode),
    ("300 slow uploads from one peer, HttpReward from another", _peer_slow_uploads),
    ("two 256 MiB bodies held a byte short by one peer, HttpReward from another",
     _peer_held_bodies),
    ("four senders of 65536-row requests from one peer, HttpReward from another",
     _peer_row_senders),
    ("a 60 MiB body of uint8 images scored by jpeg_incompressibility",
     lambda workdir: _scored_memory(_uint8_images_60_mib(), True, workdir)),
    ("a 188 MiB body of float32 images scored by jpeg_incompressibility",
     lambda workdir: _scored_memory(_float32_images_188_mib(), False, workdir)),
)  # fmt: skip
"""(fault name, probe) for faults of HTTP and of connections."""


def faults() -> list[Fault]:
    """The server's faults: every `WIRE_FAULTS` body posted as it is, then `HTTP_FAULTS`."""
    found = [
        Fault("server", name, functools.partial(_wire_fault, make, outcome, names))
        for name, make, outcome, names in WIRE_FAULTS
    ]
    found += [Fault("server", name, probe) for name, probe in HTTP_FAULTS]
    return found
