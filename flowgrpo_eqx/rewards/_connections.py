"""The reward server's connections: whose they are (`peer_key`), which are closed when idle,
too many or beyond a peer's share (`Connections`), the listening socket, and one log line
for a malformed request (needs aiohttp, as `flowgrpo_eqx.rewards.server`)."""

import asyncio
import ipaddress
import json
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any, final

from aiohttp import http_exceptions, web

from .limits import limit_text


def peer_key(peername: Any) -> str:
    """The peer a connection's address belongs to, for the per-peer limits: an IPv4
    address, or an IPv6 /64 (one host's usual allocation; an IPv4-mapped address is its
    IPv4 address); anything else (a Unix socket) as it is."""
    host = peername[0] if isinstance(peername, tuple) and peername else peername
    text = str(host or "local")
    try:
        address = ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return text
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.ip_network(f"{address}/64", strict=False))
    return str(address)


LOGGED_CLIENT_BYTES = 120


class OneLineProtocolErrors(logging.Filter):
    """Logs a malformed HTTP message (aiohttp answers it with a 400 naming the problem) as one
    line, without the parser's traceback and with at most `LOGGED_CLIENT_BYTES` of what the
    client sent: anyone who can connect could otherwise fill the server's log."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, http_exceptions.HttpProcessingError):
            said = " ".join(str(error).split())
            if len(said) > LOGGED_CLIENT_BYTES:
                said = said[:LOGGED_CLIENT_BYTES] + "..."
            record.msg = "refused a malformed HTTP request (%s: %s)"
            record.args = (type(error).__name__, said)
            record.exc_info = None
            record.exc_text = None
        return True


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket listening on `host:port`, or an `OSError` that says so in one line."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        return socket.create_server((host, port), family=family)
    except OSError as error:
        raise OSError(
            error.errno, f"cannot listen on {host}:{port}: {error.strerror or error}"
        ) from error


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@final
class Connections:
    """Closes connections that sit idle, the longest-idle one when there are too many, and
    a peer's connections beyond its share.

    A connection is idle from when it opens, or its last handler returns, until a request's
    head has arrived and its handler starts; idle for `read_timeout`, it is closed. aiohttp
    alone waits for a request head forever, so half-open connections could pile up until
    the process ran out of file descriptors and `/health` stopped answering. One peer (an
    IPv4 address or an IPv6 /64) keeps at most `per_peer` connections: beyond it, its
    longest-idle one on keep-alive is closed, or, when it has none (all busy, say with slow
    uploads, or just opened), the new one is answered 429 and closed, so that it cannot take
    the places of other clients.
    """

    def __init__(self, read_timeout: float, limit: int, per_peer: int):
        self.factory: Callable[[], Any] | None = None  # aiohttp's, once its runner is set up
        self.read_timeout = read_timeout
        self.limit = limit
        self.per_peer = per_peer
        self.idle_since: dict[Any, float] = {}  # idle connection -> loop time it went idle
        self.busy: set[Any] = set()
        self.connecting: set[Any] = set()
        self.peer_of: dict[Any, str] = {}  # connected connection -> its peer
        self.served: set[Any] = set()  # connections through one request or more

    def __call__(self) -> Any:
        """A new connection's protocol (asyncio's protocol factory)."""
        loop = asyncio.get_running_loop()
        assert self.factory is not None
        connection = self.factory()
        self.connecting.add(connection)  # no transport yet: asyncio connects it next
        self._idle(connection, loop)
        self._trim(loop, retries=4)
        loop.call_soon(self._place, connection, loop, 4)
        return connection

    def _place(self, connection: Any, loop: asyncio.AbstractEventLoop, retries: int) -> None:
        """Count a new connection for its peer once it is connected (a loop turn or two
        after the factory), and hold the peer to `per_peer`."""
        transport = connection.transport
        if transport is None:
            if connection in self.connecting and retries > 0:
                loop.call_soon(self._place, connection, loop, retries - 1)
            return
        peer = peer_key(transport.get_extra_info("peername"))
        self.peer_of[connection] = peer
        mine = [c for c, p in self.peer_of.items() if p == peer and c.transport is not None]
        if len(mine) <= self.per_peer:
            return
        # A connection idle on keep-alive after a reply can go; one not yet through its first
        # request's head is as new as this one, which is refused instead.
        idle = [c for c in mine if c in self.idle_since and c in self.served]
        if idle:
            self._close(min(idle, key=self.idle_since.__getitem__))
            return
        message = (
            f"your address already holds {len(mine) - 1} connections "
            f"({limit_text('max_connections_per_peer', self.per_peer)}): retry later."
        )
        body = json.dumps(
            {"error": "over_capacity", "message": message, "limit": "max_connections_per_peer"}
        ).encode()
        head = (
            "HTTP/1.1 429 Too Many Requests\r\nContent-Type: application/json; charset=utf-8\r\n"
            f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n"
        )
        # Sent, then the connection half-closed and read no more: the client reads the reply
        # before the connection goes, a second later, whatever it had sent meanwhile.
        transport.write(head.encode("ascii") + body)
        transport.pause_reading()
        if transport.can_write_eof():
            transport.write_eof()
        self.idle_since.pop(connection, None)
        self.peer_of.pop(connection, None)
        loop.call_later(1.0, transport.close)

    def _trim(self, loop: asyncio.AbstractEventLoop, retries: int) -> None:
        """Close the longest-idle connections beyond `limit`; connections still being
        connected (accepted in one batch) are counted once connected, a few loop turns on."""
        self._forget_closed()
        while len(self.idle_since) + len(self.busy) > self.limit:
            connected = [c for c in self.idle_since if c not in self.connecting]
            if not connected:
                if retries > 0:
                    loop.call_soon(self._trim, loop, retries - 1)
                return
            self._close(min(connected, key=self.idle_since.__getitem__))

    def _forget_closed(self) -> None:
        for connection in list(self.idle_since):
            if connection.transport is not None:
                self.connecting.discard(connection)
            elif connection not in self.connecting:
                del self.idle_since[connection]
        self.busy = {c for c in self.busy if c.transport is not None}
        self.peer_of = {c: p for c, p in self.peer_of.items() if c.transport is not None}
        self.served = {c for c in self.served if c.transport is not None}

    def _idle(self, connection: Any, loop: asyncio.AbstractEventLoop) -> None:
        since = loop.time()
        self.idle_since[connection] = since
        loop.call_later(self.read_timeout, self._expire, connection, since)

    def _expire(self, connection: Any, since: float) -> None:
        if self.idle_since.get(connection) == since:
            self._close(connection)

    def _close(self, connection: Any) -> None:
        self.idle_since.pop(connection, None)
        self.connecting.discard(connection)
        self.peer_of.pop(connection, None)
        self.served.discard(connection)
        if connection.transport is not None:
            connection.transport.close()

    @web.middleware
    async def middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """Marks the request's connection busy while its handler runs."""
        connection = request.protocol
        self.idle_since.pop(connection, None)
        self.connecting.discard(connection)
        self.busy.add(connection)
        try:
            return await handler(request)
        finally:
            self.busy.discard(connection)
            if connection.transport is not None:
                self.served.add(connection)
                self._idle(connection, asyncio.get_running_loop())
