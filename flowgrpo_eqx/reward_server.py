"""Serve a reward over HTTP, for `flowgrpo_eqx.HttpReward` (needs the `server` extra: aiohttp).

    python -m flowgrpo_eqx.reward_server package.module:reward --port 8000 [--token T]

Endpoints: `GET /health` answers `{"status": "ok", "reward": name}`; `POST /score` takes the
wire format that `HttpReward` sends and answers the `[N]` float64 scores as `.npy`,
or a JSON `{"error": kind, "message": text}` with status 400 (`malformed_body`,
`pickled_array`), 401 (`unauthorized`), 413 (`too_large`) or 500 (`reward_failed`). Bodies
are read with `allow_pickle=False`: nothing a client sends is ever unpickled.
"""

import argparse
import asyncio
import hmac
import ipaddress
import os
import signal
import socket
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from ._reward import FlowReward, RewardError, load_reward, reward_name, score
from ._reward_wire import (
    NPY_CONTENT_TYPE,
    TOKEN_ENV,
    WireError,
    decode_request,
    npy_bytes,
)


try:
    from aiohttp import web
except ModuleNotFoundError as _missing:
    raise ModuleNotFoundError(
        "flowgrpo_eqx.reward_server needs aiohttp: pip install 'flowgrpo_eqx[server]'."
    ) from _missing


DEFAULT_MAX_REQUEST_BYTES = 1 << 30
"""The largest request body a server accepts by default (1 GiB); larger ones get 413."""


def _error(web_status: int, kind: str, message: str) -> web.Response:
    return web.json_response({"error": kind, "message": message}, status=web_status)


def _authorized(header: str | None, token: str) -> bool:
    scheme, _, given = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.encode(), token.encode())


def make_app(
    reward: FlowReward,
    *,
    token: str | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
) -> web.Application:
    """The aiohttp application serving `reward`.

    Rewards are called one at a time on one worker thread (models on accelerators are
    rarely safe to call concurrently), so the server keeps answering `/health` and
    rejecting bad requests while a batch is scored. Scores go through the
    same checks as a reward called in process, so a reward that raises, or returns a wrong shape or
    non-finite scores, gives a 500 naming it; the server keeps serving after any request.

    **Arguments:**

    - `reward`: the reward.
    - `token`: if set, `/score` requires `Authorization: Bearer <token>`.
    - `max_request_bytes`: the largest request body accepted (413 beyond).

    **Returns:**

    The application (run it with `serve`, or aiohttp's own runners).

    **Raises:**

    - `ValueError`: for a non-positive `max_request_bytes` or an empty `token`.
    """
    if max_request_bytes <= 0:
        raise ValueError(f"`max_request_bytes` must be positive, got {max_request_bytes}.")
    if token is not None and not token:
        raise ValueError("`token` must be None or a non-empty string.")
    name = reward_name(reward)
    scorer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward")

    async def health(request: web.Request) -> web.Response:
        del request
        return web.json_response({"status": "ok", "reward": name})

    async def score_batch(request: web.Request) -> web.Response:
        if token is not None and not _authorized(request.headers.get("Authorization"), token):
            return _error(401, "unauthorized", "missing or wrong bearer token.")
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return _error(413, "too_large", f"the body exceeds {max_request_bytes} bytes.")
        try:
            # On the loop: decoding is a copy of the body, cheaper than a hop to a thread.
            samples, rows = decode_request(body)
        except WireError as error:
            return _error(400, error.kind, str(error))
        loop = asyncio.get_running_loop()
        try:
            scores = await loop.run_in_executor(scorer, score, reward, samples, rows)
        except RewardError as error:
            return _error(500, "reward_failed", str(error))
        return web.Response(body=npy_bytes(scores), content_type=NPY_CONTENT_TYPE)

    async def stop_scorer(app: web.Application) -> None:
        del app
        scorer.shutdown(wait=False, cancel_futures=True)

    app = web.Application(client_max_size=max_request_bytes)
    app.router.add_get("/health", health)
    app.router.add_post("/score", score_batch)
    app.on_cleanup.append(stop_scorer)
    return app


def _listening_socket(host: str, port: int) -> socket.socket:
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    return socket.create_server((host, port), family=family)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve(
    reward: FlowReward,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    token: str | None = None,
    ready: Callable[[int], None] | None = None,
) -> None:
    """Serve `reward` until SIGINT or SIGTERM.

    Prints `serving <name> on http://host:port` once listening. A request whose client has
    gone (e.g. timed out) is dropped before its reward starts. Call from the main thread:
    the signals are handled there.

    **Arguments:**

    - `reward`: the reward.
    - `host`: the address to bind; the loopback default keeps the server off the network.
    - `port`: the port; 0 picks a free one.
    - `token`: if set, `/score` requires `Authorization: Bearer <token>`.
    - `ready`: called with the bound port once the server accepts requests.
    """
    asyncio.run(_serve(reward, host=host, port=port, token=token, ready=ready))


async def _serve(
    reward: FlowReward,
    *,
    host: str,
    port: int,
    token: str | None,
    ready: Callable[[int], None] | None,
) -> None:
    runner = web.AppRunner(make_app(reward, token=token), handler_cancellation=True)
    await runner.setup()
    try:
        listener = _listening_socket(host, port)
        await web.SockSite(runner, listener).start()
        bound = int(listener.getsockname()[1])
        shown = f"[{host}]" if ":" in host else host
        if token is None and not _is_loopback(host):
            print(f"warning: serving on {host} without a token.", file=sys.stderr, flush=True)
        print(f"serving {reward_name(reward)} on http://{shown}:{bound}", flush=True)
        if ready is not None:
            ready(bound)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for stop_signal in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(stop_signal, stop.set)
        try:
            await stop.wait()
        finally:
            for stop_signal in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(stop_signal)
    finally:
        await runner.cleanup()


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m flowgrpo_eqx.reward_server REWARD [--host H] [--port P] [--token T]`.

    Loads `REWARD` with `load_reward` and serves it with `serve` until SIGINT or SIGTERM.
    The token defaults to the `FLOWGRPO_REWARD_TOKEN` environment variable.

    **Arguments:**

    - `argv`: the command-line arguments after the program name; `None` reads `sys.argv`.

    **Returns:**

    0, the exit status, once the server has stopped.

    **Raises:**

    - `SystemExit`: with status 2 and a usage message, for bad arguments or a reward that
        cannot be loaded.
    """
    parser = argparse.ArgumentParser(
        prog="python -m flowgrpo_eqx.reward_server", description="Serve a reward over HTTP."
    )
    parser.add_argument("reward", help="package.module:callable (see load_reward)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port; 0 picks a free one")
    parser.add_argument(
        "--token", default=None, help=f"required bearer token (default: ${TOKEN_ENV}, if set)"
    )
    args = parser.parse_args(argv)
    token = args.token if args.token is not None else os.environ.get(TOKEN_ENV) or None
    try:
        reward = load_reward(args.reward)
    except ValueError as error:
        parser.error(str(error))
    serve(reward, host=args.host, port=args.port, token=token)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
