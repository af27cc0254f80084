"""The reward server's limits and their command-line flags, importable without aiohttp (the
command line builds its flags from here; `flowgrpo_eqx.reward_server` serves with them)."""

import argparse
from collections.abc import Mapping
from typing import Any


DEFAULT_MAX_REQUEST_BYTES = 256 << 20
"""The largest request body a server accepts by default (256 MiB, e.g. 1024 float32
256x256x3 images, or 4096 as uint8); a larger Content-Length gets 413 before any of it is read."""

DEFAULT_READ_TIMEOUT = 30.0
"""Seconds a connection gets to send a request's head, and then its body (408 beyond)."""

DEFAULT_MAX_CONCURRENT_REQUESTS = 4
"""`/score` requests held at once (read, decoded, queued or scored); more get 503."""

DEFAULT_MAX_CONNECTIONS = 256
"""Open connections kept by `serve`; beyond it the longest-idle connection is closed."""


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
        "--read-timeout",
        type=float,
        default=DEFAULT_READ_TIMEOUT,
        help=f"seconds for a request's head, then its body (default {DEFAULT_READ_TIMEOUT:g})",
    )
    parser.add_argument(
        "--max-concurrent-requests",
        type=int,
        default=DEFAULT_MAX_CONCURRENT_REQUESTS,
        help=f"/score requests held at once, 503 beyond "
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
        "--allow-unauthenticated",
        action="store_true",
        help="allow a --host off loopback without a token",
    )


def limit_settings(arguments: Mapping[str, Any]) -> dict[str, Any]:
    """`serve`'s limit keyword arguments from flags added by `add_limit_arguments`.

    **Arguments:**

    - `arguments`: the parsed arguments, as a mapping (`vars(namespace)`).

    **Returns:**

    The keyword arguments, by `serve`'s names.
    """
    names = (
        "max_request_bytes",
        "read_timeout",
        "max_concurrent_requests",
        "max_connections",
        "allow_unauthenticated",
    )
    return {name: arguments[name] for name in names}
