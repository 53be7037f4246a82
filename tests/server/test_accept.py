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


async def _hello(scope, receive, send) -> None:
    """A minimal ASGI app: lifespan accepted, every request answered 200 "ok"."""
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


def _started(monkeypatch, fits: bool | None) -> tuple[type, str]:
    """Start `cipherlm serve`'s uvicorn server on a free port (``fits``: force what the internals check says;
    None: the real check), answer one request; return the type of its listeners and the reply's first line."""
    import uvicorn

    from server import cli_serve

    if fits is not None:
        monkeypatch.setattr(cli_serve, "uvicorn_internals_fit", lambda server: fits)

    async def run():
        config = uvicorn.Config(_hello, host="127.0.0.1", port=0, log_level="warning", lifespan="on")
        config.load()
        server = cli_serve._server_class()(config, lifecycle=None, drain_timeout_s=1.0)
        server.lifespan = config.lifespan_class(config)  # as uvicorn.Server._serve sets it before startup()
        assert cli_serve.uvicorn_internals_fit(server) is (True if fits is None else fits)
        await server.startup()
        listener = server.servers[0]
        port = listener.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        status = (await reader.readline()).decode().strip()
        writer.close()
        await server.shutdown()
        return type(listener), status

    return asyncio.run(run())


def test_serve_listens_through_the_batch_accept_server_on_this_uvicorn(monkeypatch):
    """The installed uvicorn has every internal the batch-accept start-up restates (a release that changes
    them fails here first), and `cipherlm serve`'s server then listens through BatchAcceptServer."""
    kind, status = _started(monkeypatch, None)
    assert kind is BatchAcceptServer and status == "HTTP/1.1 200 OK"


def test_serve_falls_back_to_uvicorns_start_up_when_its_internals_differ(monkeypatch, capsys):
    """A uvicorn whose internals differ gets its own start-up back (one accept per loop turn), with a warning,
    and the server still answers."""
    kind, status = _started(monkeypatch, False)
    assert kind is not BatchAcceptServer and status == "HTTP/1.1 200 OK"
    assert "listening through uvicorn's own" in capsys.readouterr().err


def test_internals_check_refuses_a_protocol_without_the_keywords_it_passes():
    """A protocol class whose constructor no longer takes ``app_state`` (say) is not started by hand."""
    import types

    from server import cli_serve

    class Protocol:
        def __init__(self, config, server_state, _loop=None):
            pass

    server = types.SimpleNamespace(config=types.SimpleNamespace(http_protocol_class=Protocol),
                                   lifespan=types.SimpleNamespace(startup=lambda: None), server_state=object(),
                                   _log_started_message=lambda sockets: None)
    assert not cli_serve.uvicorn_internals_fit(server)
    Protocol.__init__ = lambda self, config, server_state, app_state, _loop=None: None
    assert cli_serve.uvicorn_internals_fit(server)
