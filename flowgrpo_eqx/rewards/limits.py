"""The reward server's limits and their command-line flags, importable without aiohttp (the
command line builds its flags from here; `flowgrpo_eqx.rewards.server` serves with them).

Per request, a body is bounded by `max_request_bytes`, its rows (the samples' leading axis)
by `max_request_rows` and its arrays as the reward gets them by `max_decoded_bytes` (413
beyond each). In total, the server holds at most `max_total_bytes` of request data at once
(bodies as their bytes arrive, and the arrays of requests waiting for or in the reward) and
at most `max_total_rows` rows waiting for or in the reward (429 beyond, retried by
`HttpReward`), in at most `max_concurrent_requests` requests (503 beyond). A request takes a
place among those only once its whole body has arrived, so clients that send slowly hold
nothing but their connection (bounded by `max_connections`) and what they have sent, and
only for `read_timeout`.

Each peer (a client address: an IPv4 address, or an IPv6 /64) holds at most half of each
total by default: `max_connections_per_peer` connections, `max_bytes_per_peer` bytes,
`max_rows_per_peer` rows and `max_requests_per_peer` places (429 beyond), so that one
misbehaving client cannot starve the others. The reward is called on chunks of at most
`score_chunk_bytes` of samples as it gets them, so that its own working memory (and uint8
samples' float32) is bounded by a chunk, not by a request.
"""

import argparse
import dataclasses
import os
from collections.abc import Mapping
from typing import Any, final

from .._misc import check_int, check_number
from ._wire import TOKEN_ENV


DEFAULT_MAX_REQUEST_BYTES = 256 << 20
"""The largest request body a server accepts by default (256 MiB, e.g. 1024 float32
256x256x3 images); a larger Content-Length gets 413 before any of it is read."""

DEFAULT_MAX_REQUEST_ROWS = 65536
"""The most rows (samples) one request may hold by default; more get 413. Rewards do work per
row, and one thread scores every request: 200000 rows of 1x1 uint8 "images" (a 200 kB
body) held it for 8.6 to 13 s under `JpegIncompressibility`; 65536 rows hold it for a few
seconds at that rate, and leave room for 128 MiB of float32 16x16x3 images (43690)."""

DEFAULT_MAX_DECODED_BYTES = 256 << 20
"""The most bytes one request's arrays may take as the reward gets them, by default (256
MiB: the same 1024 256x256x3 images whether they travel as float32 or as uint8, which become
float32, four times their bytes); more get 413."""

DEFAULT_MAX_TOTAL_BYTES = 512 << 20
"""The most bytes of request data the server holds at once by default (512 MiB, twice
`DEFAULT_MAX_REQUEST_BYTES`): bodies as their bytes arrive, and the body and decoded arrays
of each request waiting for or in the reward; beyond it, 429."""

DEFAULT_MAX_TOTAL_ROWS = 131072
"""The most rows of requests waiting for or in the reward at once by default (twice
`DEFAULT_MAX_REQUEST_ROWS`); beyond it, 429."""

DEFAULT_READ_TIMEOUT = 30.0
"""Seconds a connection gets to send a request's head, and then its body (408 beyond)."""

DEFAULT_MAX_CONCURRENT_REQUESTS = 4
"""`/score` requests held at once once their bodies have arrived (decoded, waiting for the
reward or in it); more get 503. Bodies still arriving take no place."""

DEFAULT_MAX_CONNECTIONS = 256
"""Open connections kept by `serve`; beyond it the longest-idle connection is closed."""

DEFAULT_MAX_CONNECTIONS_PER_PEER = 32
"""Open connections one peer may hold under `serve` by default; beyond it that peer's
longest-idle connection is closed, or the new one is answered 429 and closed."""

DEFAULT_MAX_BYTES_PER_PEER = DEFAULT_MAX_REQUEST_BYTES
"""The most bytes of request data one peer may hold at once by default (half of
`DEFAULT_MAX_TOTAL_BYTES`, and room for one request of `DEFAULT_MAX_REQUEST_BYTES`); 429
beyond."""

DEFAULT_MAX_ROWS_PER_PEER = DEFAULT_MAX_REQUEST_ROWS
"""The most rows one peer may have waiting for or in the reward by default (half of
`DEFAULT_MAX_TOTAL_ROWS`); 429 beyond."""

DEFAULT_MAX_REQUESTS_PER_PEER = 2
"""The most places one peer may take at once by default (half of
`DEFAULT_MAX_CONCURRENT_REQUESTS`); 429 beyond."""

DEFAULT_SCORE_CHUNK_BYTES = 32 << 20
"""The most bytes of samples (as the reward gets them: uint8 as float32) one call of the
reward scores by default; a larger request is scored in chunks of rows."""


@final
@dataclasses.dataclass(frozen=True)
class ServerLimits:
    """The limits a reward server holds `/score` requests to, each one and all at once: the
    `limits` of `flowgrpo_eqx.rewards.server.make_app` and `serve` (`serve` adds
    `max_connections`).

    **Arguments:**

    - `max_request_bytes`: the largest request body accepted (413 beyond).
    - `read_timeout`: seconds a request's body may take to arrive (408 beyond); under
        `serve`, also for a request's head.
    - `max_concurrent_requests`: `/score` requests with whole bodies held at once (503
        beyond).
    - `max_request_rows`: the most rows (samples) in one request (413 beyond).
    - `max_decoded_bytes`: the most bytes of one request's arrays as the reward gets them
        (413 beyond).
    - `max_total_bytes`: the most bytes of request data held at once (429 beyond; 413 for a
        request that alone needs more).
    - `max_total_rows`: the most rows waiting for or in the reward at once (429 beyond; 413
        for a request that alone holds more).
    - `max_connections_per_peer`: under `serve`, the open connections one peer may hold
        (beyond it its longest-idle connection is closed, or the new one answered 429).
    - `max_bytes_per_peer`: the most bytes of request data one peer may hold at once (429
        beyond; 413 for a request that alone needs more).
    - `max_rows_per_peer`: the most rows one peer may have waiting for or in the reward (429
        beyond; 413 for a request that alone holds more).
    - `max_requests_per_peer`: the most places one peer may take at once (429 beyond).
    - `score_chunk_bytes`: the most bytes of samples, as the reward gets them, per call of
        the reward: a larger request is scored in chunks of rows, each decoded only when it
        is scored. A reward whose score of a sample depends on the other samples of its call
        must be served with this at least `max_decoded_bytes`.

    **Raises:**

    - `ValueError`: naming the field, for a limit that is not a positive int, or a
        `read_timeout` that is not a positive finite number.
    """

    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    read_timeout: float = DEFAULT_READ_TIMEOUT
    max_concurrent_requests: int = DEFAULT_MAX_CONCURRENT_REQUESTS
    max_request_rows: int = DEFAULT_MAX_REQUEST_ROWS
    max_decoded_bytes: int = DEFAULT_MAX_DECODED_BYTES
    max_total_bytes: int = DEFAULT_MAX_TOTAL_BYTES
    max_total_rows: int = DEFAULT_MAX_TOTAL_ROWS
    max_connections_per_peer: int = DEFAULT_MAX_CONNECTIONS_PER_PEER
    max_bytes_per_peer: int = DEFAULT_MAX_BYTES_PER_PEER
    max_rows_per_peer: int = DEFAULT_MAX_ROWS_PER_PEER
    max_requests_per_peer: int = DEFAULT_MAX_REQUESTS_PER_PEER
    score_chunk_bytes: int = DEFAULT_SCORE_CHUNK_BYTES

    def __post_init__(self) -> None:
        check_int("max_request_bytes", self.max_request_bytes, 1)
        check_number("read_timeout", self.read_timeout, minimum=0, include_minimum=False)
        for name in (
            "max_concurrent_requests",
            "max_request_rows",
            "max_decoded_bytes",
            "max_total_bytes",
            "max_total_rows",
            "max_connections_per_peer",
            "max_bytes_per_peer",
            "max_rows_per_peer",
            "max_requests_per_peer",
            "score_chunk_bytes",
        ):
            check_int(name, getattr(self, name), 1)


LIMIT_FLAGS: dict[str, str] = {
    "max_request_bytes": "--max-request-bytes",
    "max_request_rows": "--max-request-rows",
    "max_decoded_bytes": "--max-decoded-bytes",
    "max_total_bytes": "--max-total-bytes",
    "max_total_rows": "--max-total-rows",
    "read_timeout": "--read-timeout",
    "max_concurrent_requests": "--max-concurrent-requests",
    "max_connections": "--max-connections",
    "max_connections_per_peer": "--max-connections-per-peer",
    "max_bytes_per_peer": "--max-bytes-per-peer",
    "max_rows_per_peer": "--max-rows-per-peer",
    "max_requests_per_peer": "--max-requests-per-peer",
    "score_chunk_bytes": "--score-chunk-bytes",
}
"""Each limit's flag, by its name as a field of `ServerLimits` or an argument of `serve`
(the server's refusals name both)."""


def add_limit_arguments(parser: argparse.ArgumentParser) -> None:
    """Add `serve`'s limits as flags to `parser` (read back with `limit_settings`).

    **Arguments:**

    - `parser`: the command's parser.
    """
    parser.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help=f"largest body accepted, 413 beyond (default {DEFAULT_MAX_REQUEST_BYTES})",
    )
    parser.add_argument(
        "--max-request-rows",
        type=int,
        default=DEFAULT_MAX_REQUEST_ROWS,
        help=f"most rows (samples) in one request, 413 beyond (default {DEFAULT_MAX_REQUEST_ROWS})",
    )
    parser.add_argument(
        "--max-decoded-bytes",
        type=int,
        default=DEFAULT_MAX_DECODED_BYTES,
        help=f"most bytes of one request's arrays as the reward gets them (uint8 images "
        f"count as float32), 413 beyond (default {DEFAULT_MAX_DECODED_BYTES})",
    )
    parser.add_argument(
        "--max-total-bytes",
        type=int,
        default=DEFAULT_MAX_TOTAL_BYTES,
        help=f"most bytes of request data held at once (bodies arriving, arrays waiting "
        f"for or in the reward), 429 beyond (default {DEFAULT_MAX_TOTAL_BYTES})",
    )
    parser.add_argument(
        "--max-total-rows",
        type=int,
        default=DEFAULT_MAX_TOTAL_ROWS,
        help=f"most rows waiting for or in the reward at once, 429 beyond "
        f"(default {DEFAULT_MAX_TOTAL_ROWS})",
    )
    parser.add_argument(
        "--read-timeout",
        type=float,
        default=DEFAULT_READ_TIMEOUT,
        help=f"seconds for a request's head, then its body (default {DEFAULT_READ_TIMEOUT:g})",
    )
    parser.add_argument(
        "--max-concurrent-requests",
        type=int,
        default=DEFAULT_MAX_CONCURRENT_REQUESTS,
        help=f"/score requests held at once once their bodies have arrived, 503 beyond "
        f"(default {DEFAULT_MAX_CONCURRENT_REQUESTS})",
    )
    parser.add_argument(
        "--max-connections",
        type=int,
        default=DEFAULT_MAX_CONNECTIONS,
        help=f"open connections kept; the longest-idle is closed beyond "
        f"(default {DEFAULT_MAX_CONNECTIONS})",
    )
    parser.add_argument(
        "--max-connections-per-peer",
        type=int,
        default=DEFAULT_MAX_CONNECTIONS_PER_PEER,
        help=f"open connections one client address keeps; beyond, its longest-idle is closed "
        f"or the new one gets 429 (default {DEFAULT_MAX_CONNECTIONS_PER_PEER})",
    )
    parser.add_argument(
        "--max-bytes-per-peer",
        type=int,
        default=DEFAULT_MAX_BYTES_PER_PEER,
        help=f"most bytes of request data one client address holds at once, 429 beyond "
        f"(default {DEFAULT_MAX_BYTES_PER_PEER})",
    )
    parser.add_argument(
        "--max-rows-per-peer",
        type=int,
        default=DEFAULT_MAX_ROWS_PER_PEER,
        help=f"most rows one client address has waiting for or in the reward, 429 beyond "
        f"(default {DEFAULT_MAX_ROWS_PER_PEER})",
    )
    parser.add_argument(
        "--max-requests-per-peer",
        type=int,
        default=DEFAULT_MAX_REQUESTS_PER_PEER,
        help=f"/score requests one client address has held at once, 429 beyond "
        f"(default {DEFAULT_MAX_REQUESTS_PER_PEER})",
    )
    parser.add_argument(
        "--score-chunk-bytes",
        type=int,
        default=DEFAULT_SCORE_CHUNK_BYTES,
        help=f"most bytes of samples (uint8 as float32) per call of the reward; larger "
        f"requests are scored in chunks of rows (default {DEFAULT_SCORE_CHUNK_BYTES})",
    )
    parser.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        help="allow a --host off loopback without a token",
    )


def limit_settings(arguments: Mapping[str, Any]) -> dict[str, Any]:
    """`serve`'s limit keyword arguments from flags added by `add_limit_arguments`.

    **Arguments:**

    - `arguments`: the parsed arguments, as a mapping (`vars(namespace)`).

    **Returns:**

    The keyword arguments, by `serve`'s names: `limits` (a `ServerLimits`),
    `max_connections` and `allow_unauthenticated`.

    **Raises:**

    - `ValueError`: naming the limit, for one out of range (see `ServerLimits`).
    """
    fields = [field.name for field in dataclasses.fields(ServerLimits)]
    return {
        "limits": ServerLimits(**{name: arguments[name] for name in fields}),
        "max_connections": arguments["max_connections"],
        "allow_unauthenticated": arguments["allow_unauthenticated"],
    }


def server_token(flag: str | None) -> str | None:
    """The token a command that serves a reward requires: its `--token` flag, else the
    `FLOWGRPO_REWARD_TOKEN` environment variable, else none.

    An empty `--token` is refused: it would otherwise serve with no token at all, which is
    almost surely a mistake (leave the flag out to serve without one). An empty variable
    means none.

    **Arguments:**

    - `flag`: the `--token` flag's value (`None` when it was not given).

    **Returns:**

    The token, or `None`.

    **Raises:**

    - `ValueError`: naming `--token`, when it is given as an empty string.
    """
    if flag is not None:
        if not flag:
            raise ValueError(
                "`--token` is empty: give the token clients must send, or leave --token out "
                "to serve without one (on loopback only)."
            )
        return flag
    return os.environ.get(TOKEN_ENV) or None


def limit_text(name: str, value: int) -> str:
    """The limit `name` (a field of `ServerLimits`) as the server's refusals name it."""
    return f"the server's {name} ({LIMIT_FLAGS[name]}) {value}"
