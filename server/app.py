"""The FastAPI application: :func:`create_app` wires settings, engine, tenants, limits, metrics, routers.

``create_app(settings)`` builds the engine in its lifespan (and shuts it down); ``create_app(settings,
engine)`` uses an engine the caller started and owns (tests share one engine across apps). Everything
per-app lives on ``app.state``; nothing is module-global. Routers beyond the OpenAI/health ones (the
encrypted-session and key routers) are passed in ``routers=`` or added later with
``app.include_router``; fallback recorders (the audit log) in ``fallback_recorders=`` or appended to
``app.state.fallback_recorders``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import re
import time
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any, TypeVar

from fastapi import APIRouter, FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.errors import RequestTooLargeError, ServiceUnavailableError, error_response, install_error_handlers
from server.limits import LimitRegistry
from server.metrics import ServerMetrics
from server.private import feature as private_feature
from server.private.router import router as private_router
from server.routers import DEFAULT_ROUTERS
from server.routers.openai import served_model_name
from server.settings import Settings
from server.tenants import FallbackRecorder, server_secret_bytes

log = logging.getLogger("cipherlm.server")
_UNTRACKED = ("/health/", "/metrics")  # not counted as in-flight work
T = TypeVar("T")


@dataclasses.dataclass
class Lifecycle:
    """Admission state of the server: in-flight requests, the draining flag (SIGTERM), and the moment
    the drain window ends (``cut()``), when responses still streaming end with an error event."""

    started_at: int = dataclasses.field(default_factory=lambda: int(time.time()))
    draining: bool = False
    in_flight: int = 0
    closing: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    # streams that end themselves when told (``until_cut(..., interrupt=)``): no future raced per item
    interrupts: set[Callable[[BaseException], None]] = dataclasses.field(default_factory=set)

    async def drain(self, timeout_s: float, poll_s: float = 0.05) -> bool:
        """Stop admitting and wait for in-flight requests; True if all finished within ``timeout_s``."""
        self.draining = True
        deadline = time.monotonic() + timeout_s
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(poll_s)
        return self.in_flight == 0

    def cut(self) -> None:
        """The drain window is over: streams still running end now, with an in-band error event."""
        self.draining = True
        self.closing.set()
        for interrupt in list(self.interrupts):
            interrupt(_cut_error())

    def reset(self) -> None:
        """Admit again (a test client starting the app's lifespan anew)."""
        self.draining = False
        self.closing = asyncio.Event()

    def until_cut(self, items: AsyncIterator[T],
                  interrupt: Callable[[BaseException], None] | None = None) -> AsyncIterator[T]:
        """``items`` until :meth:`cut`; then :class:`ServiceUnavailableError` ``server_shutdown`` (a stream's
        generator turns it into its error event). However it ends, ``items`` is closed (which aborts the
        engine requests behind it) and no item is left pending.

        ``interrupt``: a callable that makes ``items`` raise the error it is given (the engine's
        ``OutputStream.interrupt``); with it the items are passed through as they are, and a cut calls it,
        instead of racing a future against every item (which costs a task per streamed chunk)."""
        if interrupt is not None:
            return self._interruptible(items, interrupt)
        return self._raced(items)

    async def _raced(self, items: AsyncIterator[T]) -> AsyncIterator[T]:
        closing = asyncio.ensure_future(self.closing.wait())
        nxt: asyncio.Future | None = None
        try:
            while True:
                nxt = asyncio.ensure_future(anext(items))
                await asyncio.wait((nxt, closing), return_when=asyncio.FIRST_COMPLETED)
                if not nxt.done():
                    raise _cut_error()
                try:
                    item = nxt.result()
                except StopAsyncIteration:
                    return
                yield item
        finally:
            closing.cancel()
            if nxt is not None and not nxt.done():
                nxt.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):  # cleanup: the cause is reported
                    await nxt
            aclose = getattr(items, "aclose", None)
            if aclose is not None:
                await aclose()

    async def _interruptible(self, items: AsyncIterator[T],
                             interrupt: Callable[[BaseException], None]) -> AsyncIterator[T]:
        if self.closing.is_set():
            interrupt(_cut_error())
        self.interrupts.add(interrupt)
        try:
            async for item in items:
                yield item
        finally:
            self.interrupts.discard(interrupt)
            aclose = getattr(items, "aclose", None)
            if aclose is not None:
                await aclose()


def _cut_error() -> ServiceUnavailableError:
    return ServiceUnavailableError("the server shut down before this response finished; retry",
                                   retry_after=1, code="server_shutdown")


class _ServingMiddleware:
    """Pure ASGI middleware: body-size limit, in-flight count (until the last byte is sent), HTTP metrics."""

    def __init__(self, app: ASGIApp, state: Any) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        limit = body_limit(self.state.settings, path)
        length = dict(scope.get("headers", [])).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            too_large = RequestTooLargeError(f"request body over {limit} bytes", code="request_too_large")
            await error_response(too_large)(scope, receive, send)
            return
        tracked = not path.startswith(_UNTRACKED)
        status = {"code": 500}

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        lifecycle: Lifecycle = self.state.lifecycle
        lifecycle.in_flight += tracked
        try:
            await self.app(scope, _limited(receive, limit), send_wrapper)
        finally:
            lifecycle.in_flight -= tracked
            route = scope.get("route")
            endpoint = getattr(route, "path", "unmatched")
            self.state.metrics.http_requests.labels(endpoint, str(status["code"])).inc()


_STEP_PATH = re.compile(r"^/v1/private/sessions/[^/]+/steps$")
_KEY_UPLOAD_PATH = re.compile(r"^/v1/private/keys/[^/]+$")


def body_limit(settings: Settings, path: str) -> int:
    """Largest request body for ``path``: each binary endpoint has its own cap (a step's is far below a
    key upload's); every other endpoint, JSON, gets ``max_request_bytes``."""
    if _STEP_PATH.match(path):
        return settings.private.max_step_bytes
    if _KEY_UPLOAD_PATH.match(path):
        return settings.private.max_key_bytes
    return settings.max_request_bytes


def _limited(receive: Receive, limit: int) -> Receive:
    """``receive`` that refuses bodies streamed past ``limit`` bytes (chunked uploads)."""
    seen = 0

    async def wrapped() -> Message:
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise RequestTooLargeError(f"request body over {limit} bytes", code="request_too_large")
        return message

    return wrapped


def build_engine(settings: Settings) -> Any:
    """The engine the settings describe (not started)."""
    from engine.async_llm import AsyncLLM
    from engine.engine_config import EngineConfig

    model = settings.model
    if model is None:
        from engine.default_model import default_model_dir

        model = str(default_model_dir())
    reps = settings.replicas
    if reps.count > 1:  # data parallel: one engine per Ray actor behind the same front
        from server.replicas import ReplicaSet

        return ReplicaSet(model, dict(settings.engine), reps.count, address=settings.private.ray.address,
                          num_cpus=reps.num_cpus, num_gpus=reps.num_gpus, prefix_tokens=reps.prefix_tokens,
                          load_slack=reps.load_slack)
    if settings.engine_process:  # the core off the API's interpreter (engine/core_client.py)
        from engine.core_client import ProcessAsyncLLM

        llm = ProcessAsyncLLM(model, EngineConfig(**settings.engine))
        llm.load_coalescing = settings.stream_coalesce_streams
        return llm
    return AsyncLLM(model, EngineConfig(**settings.engine))


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Start and stop the engine when the app owns it (restartable: test clients cycle lifespans)."""
    app.state.lifecycle.reset()
    if app.state.owns_engine:
        engine = build_engine(app.state.settings)
        await engine.start()
        _attach_engine(app, engine)
    await private_feature.start(app)
    watcher = asyncio.create_task(app.state.metrics.watch_event_loop())
    try:
        yield
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
        app.state.lifecycle.cut()  # anything still streaming ends with an error event, not silently
        await private_feature.stop(app)
        if app.state.owns_engine and app.state.engine is not None:
            engine, app.state.engine = app.state.engine, None
            app.state.metrics.watch_engine(None)
            await engine.shutdown()


def _attach_engine(app: FastAPI, engine: Any) -> None:
    app.state.engine = engine
    app.state.metrics.model_name = served_model_name(app.state.settings, engine)
    app.state.metrics.watch_engine(getattr(engine, "stats", None))


def create_app(settings: Settings, engine: Any = None, *, routers: Iterable[APIRouter] = (),
               fallback_recorders: Iterable[FallbackRecorder] = (),
               limits: LimitRegistry | None = None) -> FastAPI:
    """The cipherlm HTTP app.

    Args:
        settings: server settings (also served to handlers through ``Depends(get_settings)``).
        engine: a started ``AsyncLLM`` owned by the caller; None: the app builds, starts and stops one.
        routers: extra routers mounted after the default ones (encrypted sessions, keys, admin).
        fallback_recorders: told about every plaintext fallback of an encrypted tenant (the audit log).
        limits: the per-tenant limit state (inject one with a fake clock in tests).
    """
    app = FastAPI(title="cipherlm", version="0.1.0", lifespan=_lifespan,
                  description="OpenAI-compatible plaintext inference; encrypted tenants use the SDK.")
    app.state.settings = settings
    app.state.server_secret = server_secret_bytes(settings)
    app.state.lifecycle = Lifecycle()
    app.state.limits = limits or LimitRegistry()
    app.state.metrics = ServerMetrics(served_model_name(settings))
    app.state.fallback_recorders = list(fallback_recorders)
    app.state.owns_engine = engine is None
    app.state.engine = None
    if engine is not None:
        _attach_engine(app, engine)
    install_error_handlers(app)
    app.state.private = None
    for router in (*DEFAULT_ROUTERS, private_router, *routers):
        app.include_router(router)
    app.add_middleware(_ServingMiddleware, state=app.state)
    return app
