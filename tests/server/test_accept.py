"""The API's listening socket (``server.accept``): one readiness event takes every waiting connection (uvloop's
libuv takes one a loop turn, which left a burst of new connections waiting seconds on a busy API process),
and running out of descriptors pauses accepting instead of spinning (``cipherlm serve`` itself: the live-server
tests, tests/server/app_helpers.py)."""

from __future__ import annotations

import asyncio
import errno
import socket

import pytest

from server import accept
from server.accept import BatchAcceptServer, listen


class _Counting(asyncio.Protocol):
    made: list[asyncio.Transport] = []

    def connection_made(self, transport) -> None:
        _Counting.made.append(transport)


def test_one_readiness_event_takes_every_waiting_connection():
    _Counting.made = []

    async def run() -> tuple[int, int]:
        (sock,) = listen("127.0.0.1", 0, 128)
        port = sock.getsockname()[1]
        clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(40)]  # queued by the kernel
        server = BatchAcceptServer(asyncio.get_running_loop(), sock, _Counting)
        taken, again = server.accept(), server.accept()  # all 40 at once; none left for a second call
        await server.wait_closed()
        server.close()
        for c in clients:
            c.close()
        for t in _Counting.made:
            t.close()
        with pytest.raises(ConnectionRefusedError):  # closed: nothing listens any more
            socket.create_connection(("127.0.0.1", port), timeout=1)
        return taken, again

    taken, again = asyncio.run(run())
    assert (taken, again) == (40, 0) and len(_Counting.made) == 40


class _Exhausted:
    """A listening socket whose accept runs out of descriptors once, then behaves."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.failed = sock, False

    def fileno(self) -> int:
        return self.sock.fileno()

    def accept(self):
        if not self.failed:
            self.failed = True
            raise OSError(errno.EMFILE, "Too many open files")
        return self.sock.accept()

    def close(self) -> None:
        self.sock.close()


def test_out_of_descriptors_pauses_accepting_then_resumes(monkeypatch):
    monkeypatch.setattr(accept, "RETRY_S", 0.05)
    _Counting.made = []

    async def run() -> int:
        (real,) = listen("127.0.0.1", 0, 16)
        client = socket.create_connection(("127.0.0.1", real.getsockname()[1]))
        server = BatchAcceptServer(asyncio.get_running_loop(), _Exhausted(real), _Counting)
        first = server.accept()        # EMFILE: nothing taken, the reader removed for RETRY_S
        await asyncio.sleep(0.3)       # the reader is back and takes the waiting connection
        await server.wait_closed()
        server.close()
        client.close()
        for t in _Counting.made:
            t.close()
        return first

    assert asyncio.run(run()) == 0 and len(_Counting.made) == 1


def test_a_name_listens_on_each_of_its_addresses():
    socks = listen("localhost", 0, 8)
    try:
        families = {s.family for s in socks}
        assert socket.AF_INET in families  # 127.0.0.1 at least (and ::1 where the box has IPv6)
        assert all(not s.getblocking() for s in socks)
    finally:
        for s in socks:
            s.close()
