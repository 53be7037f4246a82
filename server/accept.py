"""The API's listening socket, accepting every waiting connection in one event-loop turn.

uvicorn runs on uvloop, whose libuv accepts one connection per readiness event since libuv 1.45 (libuv pull
3696: the next one waits for the next poll). While the API's loop turns quickly that costs nothing; at
hundreds of streamed users a turn takes tens of milliseconds, and a burst of new connections then waits one
turn each: on the 2-core box 178 of 256 opening requests were accepted 0.5-3.2 s late, with the loop never
blocked that long (docs/benchmarks.md, "Session 29"). asyncio's own server accepts up to its backlog per
event; :class:`BatchAcceptServer` does the same on any loop, handing each connection to uvicorn's protocol
through ``loop.connect_accepted_socket``. It offers the part of ``asyncio.Server`` uvicorn's shutdown uses.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable

log = logging.getLogger(__name__)

ACCEPT_BATCH = 512  # connections taken per readiness event at most (then the loop's other work gets its turn)
RETRY_S = 1.0       # out of descriptors or buffers: stop accepting this long (what asyncio's server does)


def listen(host: str, port: int, backlog: int) -> list[socket.socket]:
    """Non-blocking TCP sockets listening on every address of ``host`` at ``port`` (as asyncio's create_server:
    "localhost" is 127.0.0.1 and ::1)."""
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, addr in dict.fromkeys(socket.getaddrinfo(
                host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as asyncio's create_server on Unix
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(addr)
            sock.listen(backlog)
            sock.setblocking(False)
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


class BatchAcceptServer:
    """Accepts up to ``batch`` waiting connections per readiness event of ``sock`` and connects each to a
    protocol from ``protocol_factory``."""

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: socket.socket,
                 protocol_factory: Callable[[], asyncio.Protocol], batch: int = ACCEPT_BATCH) -> None:
        self.loop, self.sockets, self.factory, self.batch = loop, [sock], protocol_factory, batch
        self._connecting: set[asyncio.Task] = set()
        self._open = True
        loop.add_reader(sock.fileno(), self.accept)

    def accept(self) -> int:
        """Take every waiting connection (up to ``batch``); how many were taken."""
        sock, n = self.sockets[0], 0
        while n < self.batch:
            try:
                conn, _ = sock.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                break
            except OSError as exc:  # EMFILE, ENOBUFS...: the socket stays readable, so pause or spin
                log.warning("accept failed (%s); not accepting for %.0f s", exc, RETRY_S)
                self.loop.remove_reader(sock.fileno())
                self.loop.call_later(RETRY_S, self._resume)
                break
            conn.setblocking(False)
            task = self.loop.create_task(self._connect(conn))
            self._connecting.add(task)
            task.add_done_callback(self._connecting.discard)
            n += 1
        return n

    async def _connect(self, conn: socket.socket) -> None:
        try:
            await self.loop.connect_accepted_socket(self.factory, conn)
        except OSError as exc:  # the peer left before its transport was made
            log.debug("dropped a connection before it started: %s", exc)
            conn.close()

    def _resume(self) -> None:
        if self._open:
            self.loop.add_reader(self.sockets[0].fileno(), self.accept)

    def close(self) -> None:
        """Stop accepting and close the listening socket (connections already made stay open)."""
        if self._open:
            self._open = False
            self.loop.remove_reader(self.sockets[0].fileno())
            self.sockets[0].close()

    async def wait_closed(self) -> None:
        """Until the connections being handed over are made."""
        if self._connecting:
            await asyncio.gather(*self._connecting, return_exceptions=True)
