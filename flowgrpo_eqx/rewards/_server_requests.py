"""The reward server's accounting of one request (needs aiohttp, as
`flowgrpo_eqx.rewards.server`): what it holds of the server's totals (`Hold`, by peer
`PeerUse`), its body read into one buffer as it arrives (`read_body`), the bytes and rows
its scoring takes (`beyond_body`, `chunk_rows`), its scoring in chunks on the reward's thread
(`score_decoded`), and the JSON error replies (`error_reply`, `refusal_reply`)."""

import asyncio
import dataclasses
import hmac
from concurrent.futures import Future
from typing import Any, Protocol, final, runtime_checkable

import numpy as np
import numpy.typing as npt
from aiohttp import web

from ._reward import FlowReward, RewardError, score
from ._wire import WireRequest
from .limits import ServerLimits, limit_text


@runtime_checkable
class Totals(Protocol):
    """What the server's requests hold together (the server, to a `Hold`): bytes, rows and
    places, the same by peer, and the limits they are held to."""

    limits: ServerLimits
    bytes_held: int
    rows_held: int
    placed: int
    peers: dict[str, "PeerUse"]


def error_reply(web_status: int, kind: str, message: str, limit: str | None = None) -> web.Response:
    """A JSON error reply; `limit` names the limit that refused the request, if one did (its
    flag is in `message`), and a refusal that may pass later (429, 503) says when to retry."""
    body = {"error": kind, "message": message}
    if limit is not None:
        body["limit"] = limit
    response = web.json_response(body, status=web_status)
    if web_status in (429, 503):
        response.headers["Retry-After"] = "1"
    return response


def refusal_reply(
    web_status: int, kind: str, message: str, limit: str | None = None
) -> web.Response:
    """An error reply that closes the connection once sent: what is left of the request's
    body is read and thrown away (for at most the runner's lingering time), never kept."""
    response = error_reply(web_status, kind, message, limit)
    response.force_close()
    return response


def authorized(header: str | None, token: str) -> bool:
    """Whether the Authorization `header` is `Bearer <token>` (compared in constant time)."""
    scheme, _, given = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.encode(), token.encode())


@final
class Truncated(Exception):
    """The body ended before its Content-Length."""


@final
class OverCapacity(Exception):
    """The body's next bytes would take the server past its `max_total_bytes`, or the peer
    past its `max_bytes_per_peer` (`limit` says which)."""

    def __init__(self, limit: str):
        super().__init__(limit)
        self.limit = limit


async def read_body(request: web.Request, length: int, hold: "Hold") -> npt.NDArray[np.uint8]:
    """The `length` body bytes, into one writable buffer (the decoded arrays are views of it).

    `np.empty` reserves address space only: memory is committed as the bytes arrive, so a
    client that announces a large body and sends nothing costs nothing. Each chunk is
    counted in `hold` as it arrives (what the buffer then holds), or `OverCapacity` is
    raised when the server holds too much already. A body not read to its end gives its
    bytes back at once: `asyncio.wait_for` runs this as a task of its own, whose handler
    resumes only on a later turn of the loop, while other bodies go on arriving.
    """
    buffer = np.empty(length, dtype=np.uint8)
    filled = 0
    try:
        while filled < length:
            chunk = await request.content.readany()
            if not chunk or filled + len(chunk) > length:
                raise Truncated
            refused = hold.take(len(chunk))
            if refused is not None:
                raise OverCapacity(refused)
            buffer[filled : filled + len(chunk)] = np.frombuffer(chunk, dtype=np.uint8)
            filled += len(chunk)
    except BaseException:
        del buffer  # the exception's traceback keeps this frame, which would keep the buffer
        hold.release()
        raise
    return buffer


def chunk_rows(parsed: WireRequest, chunk_bytes: int) -> int:
    """The rows of `parsed` the reward scores per call: as many as fit `chunk_bytes` of
    arrays as the reward gets them (at least one)."""
    return max(1, min(parsed.count, chunk_bytes // parsed.row_bytes()))


def beyond_body(parsed: WireRequest, body: npt.NDArray[np.uint8], chunk_bytes: int) -> int:
    """The bytes `parsed` takes besides its body's: the float32 samples that one chunk of
    uint8 ones becomes (`score_decoded` decodes a chunk at a time), and arrays copied
    because they arrived unaligned."""
    arrays = [parsed.samples, *parsed.leaves()]
    copied = sum(array.nbytes for array in arrays if not np.may_share_memory(array, body))
    if not parsed.uint8:
        return int(copied)
    per_row = parsed.samples.size // max(1, parsed.count)
    return int(copied + 4 * per_row * chunk_rows(parsed, chunk_bytes))


@final
class Hold:
    """What one request holds of the server's totals: bytes (of its body as they arrive,
    then of its decoded arrays) and, once admitted, rows and a place. Released once: when
    its handler ends, or, once it is handed to the reward's thread, when that is done."""

    def __init__(self, server: Totals, peer: str):
        self.server = server
        self.peer = peer
        self.use = server.peers.setdefault(peer, PeerUse())
        self.use.holds += 1
        self.bytes = 0
        self.rows = 0
        self.placed = False
        self.handed_over = False
        self.released = False

    def take(self, count: int) -> str | None:
        """Count `count` more bytes, unless the server would then hold more than its
        `max_total_bytes` or the peer more than its `max_bytes_per_peer`; `None` when they
        were counted, else the limit's name."""
        server, limits = self.server, self.server.limits
        if self.use.bytes + count > limits.max_bytes_per_peer:
            return "max_bytes_per_peer"
        if server.bytes_held + count > limits.max_total_bytes:
            return "max_total_bytes"
        server.bytes_held += count
        self.use.bytes += count
        self.bytes += count
        return None

    def admit(self, rows: int) -> None:
        """Take a place for a request of `rows` rows."""
        self.server.rows_held += rows
        self.server.placed += 1
        self.use.rows += rows
        self.use.requests += 1
        self.rows = rows
        self.placed = True

    def release(self) -> None:
        """Give back everything held (once)."""
        if self.released:
            return
        self.released = True
        self.server.bytes_held -= self.bytes
        self.server.rows_held -= self.rows
        self.server.placed -= int(self.placed)
        use = self.use
        use.bytes -= self.bytes
        use.rows -= self.rows
        use.requests -= int(self.placed)
        use.holds -= 1
        if use.holds == 0:
            self.server.peers.pop(self.peer, None)


@final
@dataclasses.dataclass
class PeerUse:
    """What one peer's requests hold: bytes, rows and places, and how many requests hold
    anything (the entry is dropped when none does)."""

    bytes: int = 0
    rows: int = 0
    requests: int = 0
    holds: int = 0


def score_decoded(
    reward: FlowReward, parsed: WireRequest, chunk_bytes: int
) -> npt.NDArray[np.float64]:
    """`score` on the reward's thread, on chunks of rows of at most `chunk_bytes` of arrays
    as the reward gets them: uint8 samples become float32 a chunk at a time, only now, so
    that a request waiting for the reward holds only its body, and the reward works on a
    chunk at a time."""
    step = chunk_rows(parsed, chunk_bytes)
    if step >= parsed.count:
        return score(reward, *parsed.decoded())
    scores = np.empty(parsed.count, np.float64)
    for start in range(0, parsed.count, step):
        stop = min(start + step, parsed.count)
        samples, rows = parsed.part(start, stop).decoded()
        try:
            scores[start:stop] = score(reward, samples, rows)
        except RewardError as error:
            raise RewardError(
                f"{error} (rows {start} to {stop - 1} of the request, scored as one chunk of "
                f"{limit_text('score_chunk_bytes', chunk_bytes)})"
            ) from error
    return scores


def release_on(loop: asyncio.AbstractEventLoop, hold: Hold, future: Future[Any]) -> None:
    """Release `hold` on `loop` once the reward's thread is done with its request (or it
    was dropped before its turn)."""
    del future
    try:
        loop.call_soon_threadsafe(hold.release)
    except RuntimeError:  # the loop has closed: nothing is served, nothing is counted
        pass
