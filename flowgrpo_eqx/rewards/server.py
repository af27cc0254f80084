"""Serve a reward over HTTP, for `flowgrpo_eqx.HttpReward` (needs the `server` extra: aiohttp).

    python -m flowgrpo_eqx.rewards.server package.module:reward --port 8000 [--token T]

Endpoints: `GET /health` answers `{"status": "ok", "reward": name}`; `POST /score` takes the
wire format that `HttpReward` sends and answers the `[N]` float64 scores as `.npy`, or a JSON
`{"error": kind, "message": text}` with status 400 (`malformed_body`, `pickled_array`,
`unsupported_dtype`), 401 (`unauthorized`), 408 (`read_timeout`), 411 (`length_required`),
413 (`too_large`), 429 (`over_capacity`), 500 (`reward_failed`) or 503 (`busy`); a refusal
by one of the limits (`flowgrpo_eqx.rewards.limits`) adds `"limit": name` and names the
limit and its flag in the message. Nothing a client sends is ever unpickled, and every
length in a body is checked before anything is allocated; samples must be real float or
integer arrays, rows may also be bool or strings, and no array may be empty (so no declared
axis exceeds the body's length: `_wire.parse_request`).
"""

import argparse
import asyncio
import functools
import logging
import signal
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import final

from .._misc import check_int, is_int
from ._connections import (
    Connections,
    OneLineProtocolErrors,
    is_loopback,
    listening_socket,
    peer_key,
)
from ._reward import FlowReward, RewardError, load_reward, reward_name
from ._server_requests import (
    Hold,
    OverCapacity,
    PeerUse,
    Truncated,
    authorized,
    beyond_body,
    error_reply,
    read_body,
    refusal_reply,
    release_on,
    score_decoded,
)
from ._wire import (
    NPY_CONTENT_TYPE,
    TOKEN_ENV,
    WireError,
    WireRequest,
    npy_bytes,
    parse_request,
)
from .limits import (
    DEFAULT_MAX_CONNECTIONS,
    ServerLimits,
    add_limit_arguments,
    limit_settings,
    limit_text,
    server_token,
)


try:
    from aiohttp import web
except ModuleNotFoundError as _missing:
    raise ModuleNotFoundError(
        "flowgrpo_eqx.rewards.server needs aiohttp: pip install aiohttp (in a checkout of "
        "flowgrpo_eqx: pip install -e '.[server]')."
    ) from _missing


# Bodies up to this size are decoded on the event loop (a hop to a thread costs more);
# larger ones on a thread, so that `/health` never waits behind a decode.
_DECODE_ON_LOOP_BYTES = 1 << 20


def make_app(
    reward: FlowReward,
    *,
    token: str | None = None,
    limits: ServerLimits = ServerLimits(),
) -> web.Application:
    """The aiohttp application serving `reward`.

    Rewards are called one at a time on one worker thread (models on accelerators are
    rarely safe to call concurrently), so the server keeps answering `/health` and
    rejecting bad requests while a batch is scored. Scores go through the
    same checks as a reward called in process, so a reward that raises, or returns a wrong shape or
    non-finite scores, gives a 500 naming it; the server keeps serving after any request.

    A `/score` request is held to the fields of `limits`. It is refused before its body is
    read, and its connection closed, when the token is wrong (401), it has no Content-Length
    (411), or the Content-Length exceeds `max_request_bytes`, `max_total_bytes` or
    `max_bytes_per_peer` (413). A body that takes longer than `read_timeout` gets 408 and
    its connection is closed. The body is read into one buffer, each chunk counted as it
    arrives against `max_total_bytes` across all requests and `max_bytes_per_peer` across
    its peer's (429 beyond), and the arrays are views of it. Once the whole body has
    arrived it is checked (400 for anything that is not the wire format) and held to the
    limits: more than `max_request_rows` rows or `max_decoded_bytes` of arrays as the reward
    gets them (uint8 samples count as the float32 they become) get 413;
    `max_concurrent_requests` requests already waiting for or in the reward give 503; its
    peer's `max_requests_per_peer` places already taken, or its rows or bytes on top of
    those its peer holds past `max_rows_per_peer` or `max_bytes_per_peer`, or on top of
    all held past `max_total_rows` or `max_total_bytes`, give 429. Only then does it take a
    place, so clients that send their bodies slowly cannot keep a fair request from the
    reward, and one peer (an IPv4 address or an IPv6 /64) holds at most its share of each
    total. Every refusal by a limit names it (and its flag) in its message and as
    `"limit"`.

    The reward is called on chunks of the request's rows of at most `score_chunk_bytes` of
    arrays as it gets them (uint8 samples become float32 a chunk at a time, on the reward's
    thread, just before the call), and the scores are joined: what a reward scores sample
    by sample is the same, and its working memory is that of a chunk. So the server holds
    at most `max_total_bytes` of request data (plus arrays that arrive unaligned, copied
    while a body is parsed, at most one body each), and on top of it the reward's working
    memory for one chunk.

    **Arguments:**

    - `reward`: the reward.
    - `token`: if set, `/score` requires `Authorization: Bearer <token>`.
    - `limits`: the limits above (`ServerLimits`; its defaults by default).

    **Returns:**

    The application (run it with `serve`, or aiohttp's own runners).

    **Raises:**

    - `ValueError`: naming the argument, for an empty `token` or `limits` that is not a
        `ServerLimits`.
    """
    if token is not None and not token:
        raise ValueError("`token` must be None or a non-empty string.")
    if not isinstance(limits, ServerLimits):
        raise ValueError(f"`limits` must be a ServerLimits, got {limits!r}.")
    server = _Server(reward, token, limits)
    # The Content-Length check refuses large bodies before reading them; aiohttp's own limit
    # stays as a second guard.
    app = web.Application(client_max_size=limits.max_request_bytes)
    app.router.add_get("/health", server.health)
    app.router.add_post("/score", server.score_batch)
    app.on_cleanup.append(server.stop_scorer)
    return app


@final
class _Server:
    """The handlers of `make_app`'s application, the limits they hold requests to, what the
    requests hold of them, and the one worker thread that calls the reward."""

    def __init__(self, reward: FlowReward, token: str | None, limits: ServerLimits):
        self.reward = reward
        self.name = reward_name(reward)
        self.token = token
        self.limits = limits
        self.scorer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward")
        self.placed = 0  # requests waiting for or in the reward
        self.rows_held = 0  # their rows
        self.bytes_held = 0  # bodies as they arrive, and the arrays of those requests
        self.peers: dict[str, PeerUse] = {}  # the same, by peer

    async def health(self, request: web.Request) -> web.Response:
        del request
        return web.json_response({"status": "ok", "reward": self.name})

    async def score_batch(self, request: web.Request) -> web.StreamResponse:
        """`POST /score`: refused before its body is read, refused by a limit once it has
        arrived, or scored."""
        refusal = self._refusal_before_reading(request)
        if refusal is not None:
            return refusal
        length = request.content_length
        assert length is not None  # refused above otherwise
        transport = request.transport
        hold = Hold(self, peer_key(transport.get_extra_info("peername") if transport else None))
        try:
            return await self._score(request, length, hold)
        finally:
            if not hold.handed_over:
                hold.release()

    def _refusal_before_reading(self, request: web.Request) -> web.Response | None:
        """The reply to a request refused before its body is read (wrong token, no or too
        large Content-Length), or `None`."""
        token = self.token
        if token is not None and not authorized(request.headers.get("Authorization"), token):
            return refusal_reply(401, "unauthorized", "missing or wrong bearer token.")
        length = request.content_length
        if length is None:
            return refusal_reply(411, "length_required", "send the body with a Content-Length.")
        limits = self.limits
        for name, value in (
            ("max_request_bytes", limits.max_request_bytes),
            ("max_total_bytes", limits.max_total_bytes),
            ("max_bytes_per_peer", limits.max_bytes_per_peer),
        ):
            if length > value:
                return refusal_reply(
                    413,
                    "too_large",
                    f"the body's Content-Length {length} exceeds {limit_text(name, value)}.",
                    name,
                )
        return None

    async def _score(self, request: web.Request, length: int, hold: Hold) -> web.StreamResponse:
        limits = self.limits
        try:
            body = await asyncio.wait_for(read_body(request, length, hold), limits.read_timeout)
        except TimeoutError:
            response = refusal_reply(
                408, "read_timeout", f"the body did not arrive within {limits.read_timeout:g} s."
            )
            # Answer, then drop the connection at once: its client is too slow to wait for.
            await response.prepare(request)
            await response.write_eof()
            request.protocol.force_close()
            return response
        except OverCapacity as over:
            held = (
                f"your address already holds {hold.use.bytes} bytes of requests"
                if over.limit == "max_bytes_per_peer"
                else f"the server already holds {self.bytes_held} bytes of requests"
            )
            return refusal_reply(
                429,
                "over_capacity",
                f"{held}; this body's {length} would pass "
                f"{limit_text(over.limit, getattr(limits, over.limit))}: retry later.",
                over.limit,
            )
        except (Truncated, ConnectionError):
            # A connection lost mid-body (a reset, or a client that gave up) is answered as
            # one that ended early, if its client can still read.
            return refusal_reply(400, "malformed_body", "the body ended before its Content-Length.")
        loop = asyncio.get_running_loop()
        try:
            if length <= _DECODE_ON_LOOP_BYTES:
                parsed = parse_request(body)
            else:
                parsed = await loop.run_in_executor(None, parse_request, body)
        except WireError as error:
            return error_reply(400, error.kind, str(error))
        refusal = self._admit(parsed, beyond_body(parsed, body, limits.score_chunk_bytes), hold)
        del body  # the arrays keep what they view
        if refusal is not None:
            return refusal
        future = self.scorer.submit(score_decoded, self.reward, parsed, limits.score_chunk_bytes)
        del parsed
        hold.handed_over = True
        future.add_done_callback(functools.partial(release_on, loop, hold))
        try:
            scores = await asyncio.wrap_future(future)
        except RewardError as error:
            return error_reply(500, "reward_failed", str(error))
        return web.Response(body=npy_bytes(scores), content_type=NPY_CONTENT_TYPE)

    def _admit(self, parsed: WireRequest, beyond: int, hold: Hold) -> web.Response | None:
        """Give the request whose body `hold` holds a place, with `beyond` more bytes for
        its arrays, or the reply that refuses it: 413 for what no wait can help, 503 when
        every place is taken, 429 when its peer's places are taken or the rows or bytes held
        would pass its peer's share or the totals."""
        limits = self.limits
        rows = parsed.count
        decoded = parsed.decoded_bytes()
        needed = f"{hold.bytes + beyond} bytes with its body"
        too_large = [
            (rows > limits.max_request_rows, "max_request_rows", f"{rows} rows"),
            (decoded > limits.max_decoded_bytes, "max_decoded_bytes", self._decoded(parsed)),
            (rows > limits.max_total_rows, "max_total_rows", f"{rows} rows"),
            (rows > limits.max_rows_per_peer, "max_rows_per_peer", f"{rows} rows"),
            (hold.bytes + beyond > limits.max_total_bytes, "max_total_bytes", needed),
            (hold.bytes + beyond > limits.max_bytes_per_peer, "max_bytes_per_peer", needed),
        ]
        for over, name, what in too_large:
            if over:
                value = getattr(limits, name)
                message = f"the request holds {what}, over {limit_text(name, value)}."
                return error_reply(413, "too_large", message, name)
        if self.placed >= limits.max_concurrent_requests:
            return error_reply(
                503,
                "busy",
                f"{self.placed} requests are already being served "
                f"({limit_text('max_concurrent_requests', limits.max_concurrent_requests)}).",
                "max_concurrent_requests",
            )
        use = hold.use
        if use.requests >= limits.max_requests_per_peer:
            return error_reply(
                429,
                "over_capacity",
                f"your address already has {use.requests} requests being served "
                f"({limit_text('max_requests_per_peer', limits.max_requests_per_peer)}): retry "
                "later.",
                "max_requests_per_peer",
            )
        if use.rows + rows > limits.max_rows_per_peer:
            return error_reply(
                429,
                "over_capacity",
                f"your address's requests being served hold {use.rows} rows; this one's "
                f"{rows} would pass {limit_text('max_rows_per_peer', limits.max_rows_per_peer)}: "
                "retry later.",
                "max_rows_per_peer",
            )
        if self.rows_held + rows > limits.max_total_rows:
            return error_reply(
                429,
                "over_capacity",
                f"the requests being served hold {self.rows_held} rows; this one's {rows} "
                f"would pass {limit_text('max_total_rows', limits.max_total_rows)}: retry later.",
                "max_total_rows",
            )
        refused = hold.take(beyond)
        if refused is not None:
            held = (
                f"your address already holds {use.bytes} bytes of requests"
                if refused == "max_bytes_per_peer"
                else f"the server already holds {self.bytes_held} bytes of requests"
            )
            return error_reply(
                429,
                "over_capacity",
                f"{held}; this one's {beyond} more for its arrays would pass "
                f"{limit_text(refused, getattr(limits, refused))}: retry later.",
                refused,
            )
        hold.admit(rows)
        return None

    @staticmethod
    def _decoded(parsed: WireRequest) -> str:
        """The bytes of `parsed`'s arrays as the reward gets them, in words."""
        samples = parsed.samples
        how = f"uint8 samples {samples.shape}, as float32" if parsed.uint8 else "arrays"
        return f"{parsed.decoded_bytes()} bytes of {how}"

    async def stop_scorer(self, app: web.Application) -> None:
        del app
        self.scorer.shutdown(wait=False, cancel_futures=True)


def serve(
    reward: FlowReward,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    token: str | None = None,
    ready: Callable[[int], None] | None = None,
    limits: ServerLimits = ServerLimits(),
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    allow_unauthenticated: bool = False,
) -> None:
    """Serve `reward` until SIGINT or SIGTERM.

    Prints `serving <name> on http://host:port` once listening. A request whose client has
    gone (e.g. timed out) is dropped before its reward starts. Call from the main thread:
    the signals are handled there.

    Besides `make_app`'s limits, a connection must send each request's head within
    `limits.read_timeout` of opening (or of its previous reply) or it is closed, when
    `max_connections` are open the longest-idle one is closed for a new one, and one peer
    keeps at most `limits.max_connections_per_peer` connections (beyond, its longest-idle
    one is closed, or the new one answered 429), so slow or half-open connections cannot
    exhaust the file descriptors, and one client's cannot crowd out the others: `/health`
    and other clients keep being answered.

    **Arguments:**

    - `reward`: the reward.
    - `host`: the address to bind; the loopback default keeps the server off the network.
    - `port`: the port; 0 picks a free one.
    - `token`: if set, `/score` requires `Authorization: Bearer <token>`.
    - `ready`: called with the bound port once the server accepts requests.
    - `limits`: the limits each request is held to, as in `make_app` (`ServerLimits`).
    - `max_connections`: open connections kept; the longest-idle one is closed beyond.
    - `allow_unauthenticated`: allow a `host` other than loopback without a `token`.

    **Raises:**

    - `ValueError`: naming the argument, for a `port` outside 0..65535, a `host` off
        loopback without a `token` (unless `allow_unauthenticated`), a `max_connections`
        below 1, or an empty `token` or bad `limits` (as in `make_app`).
    - `OSError`: naming the address, when it cannot be listened on (the port is in use, the
        host is not this machine's).
    """
    if not (is_int(port) and 0 <= port <= 65535):
        raise ValueError(f"`port` must be an int in 0..65535 (0: any free port), got {port!r}.")
    if token is None and not is_loopback(host) and not allow_unauthenticated:
        raise ValueError(
            f"`host` {host!r} is not loopback and no `token` is set: anyone who can reach it "
            "could score with your reward. Set a token (FLOWGRPO_REWARD_TOKEN), or pass "
            "allow_unauthenticated=True (--allow-unauthenticated) to mean it."
        )
    check_int("max_connections", max_connections, 1)
    app = make_app(reward, token=token, limits=limits)
    asyncio.run(_serve(app, reward_name(reward), host, port, token, ready, limits, max_connections))


async def _serve(
    app: web.Application,
    name: str,
    host: str,
    port: int,
    token: str | None,
    ready: Callable[[int], None] | None,
    limits: ServerLimits,
    max_connections: int,
) -> None:
    read_timeout = limits.read_timeout
    runner = web.AppRunner(
        app,
        handler_cancellation=True,
        keepalive_timeout=read_timeout,
        # A refused body is drained (so the client reads its reply) for at most this long.
        lingering_time=min(10.0, read_timeout),
    )
    protocol_log = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, OneLineProtocolErrors) for f in protocol_log.filters):
        protocol_log.addFilter(OneLineProtocolErrors())
    connections = Connections(read_timeout, max_connections, limits.max_connections_per_peer)
    app.middlewares.append(connections.middleware)
    await runner.setup()
    assert runner.server is not None
    connections.factory = runner.server
    loop = asyncio.get_running_loop()
    server = None
    try:
        listener = listening_socket(host, port)
        server = await loop.create_server(connections, sock=listener)
        bound = int(listener.getsockname()[1])
        shown = f"[{host}]" if ":" in host else host
        if token is None and not is_loopback(host):
            print(f"warning: serving on {host} without a token.", file=sys.stderr, flush=True)
        print(f"serving {name} on http://{shown}:{bound}", flush=True)
        if ready is not None:
            ready(bound)
        stop = asyncio.Event()
        for stop_signal in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(stop_signal, stop.set)
        try:
            await stop.wait()
        finally:
            for stop_signal in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(stop_signal)
    finally:
        if server is not None:
            server.close()
        await runner.cleanup()


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m flowgrpo_eqx.rewards.server REWARD [--host H] [--port P] [--token T] ...`.

    Loads `REWARD` with `load_reward` and serves it with `serve` until SIGINT or SIGTERM.
    The token defaults to the `FLOWGRPO_REWARD_TOKEN` environment variable (an empty
    `--token` is refused); `serve`'s limits are flags (`--max-request-bytes`,
    `--max-request-rows`, `--max-decoded-bytes`, `--max-total-bytes`, `--max-total-rows`,
    `--read-timeout`, `--max-concurrent-requests`, `--max-connections`,
    `--max-connections-per-peer`, `--max-bytes-per-peer`, `--max-rows-per-peer`,
    `--max-requests-per-peer`, `--score-chunk-bytes`, `--allow-unauthenticated`).

    **Arguments:**

    - `argv`: the command-line arguments after the program name; `None` reads `sys.argv`.

    **Returns:**

    0, the exit status, once the server has stopped.

    **Raises:**

    - `SystemExit`: with status 2 and a usage message, for bad arguments, an empty
        `--token`, a reward that cannot be loaded, a port outside 0..65535, or a host off
        loopback without a token (see `serve`); with status 1 and one line, when the address
        cannot be listened on.
    """
    parser = argparse.ArgumentParser(
        prog="python -m flowgrpo_eqx.rewards.server", description="Serve a reward over HTTP."
    )
    parser.add_argument("reward", help="package.module:callable (see load_reward)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port; 0 picks a free one")
    parser.add_argument(
        "--token", default=None, help=f"required bearer token (default: ${TOKEN_ENV}, if set)"
    )
    add_limit_arguments(parser)
    args = parser.parse_args(argv)
    try:
        token = server_token(args.token)
        reward = load_reward(args.reward)
        serve(reward, host=args.host, port=args.port, token=token, **limit_settings(vars(args)))
    except ValueError as error:
        parser.error(str(error))
    except OSError as error:
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
