"""FastAPI dependencies shared by routers: the engine, the draining gate, limits, metrics, fallbacks.

Everything lives on ``app.state`` (set up by :func:`server.app.create_app`), never in module globals.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, Request

from server.errors import RateLimitError, ServiceUnavailableError
from server.limits import LimitRegistry, TenantLimiter
from server.metrics import ServerMetrics
from server.settings import SettingsDep
from server.tenants import FallbackEvent, Tenant, get_registry, get_tenant, require_plaintext_access


async def get_engine(request: Request):
    """The running engine (``AsyncLLM``); 503 while it is starting or gone."""
    engine = getattr(request.app.state, "engine", None)
    if engine is None:
        raise ServiceUnavailableError("the engine is not running", retry_after=5, code="engine_not_ready")
    return engine


def get_metrics(request: Request) -> ServerMetrics:
    """The app's metrics."""
    return request.app.state.metrics


async def ensure_admitting(request: Request, settings: SettingsDep) -> None:
    """503 + Retry-After once the server drains (SIGTERM): in-flight requests finish, new ones go away."""
    if request.app.state.lifecycle.draining:
        raise ServiceUnavailableError("the server is shutting down; retry on another replica",
                                      retry_after=settings.retry_after_s, code="server_draining")


def admit_request(request: Request, tenant: Tenant) -> TenantLimiter:
    """Requests/min + concurrency for the tenant (429 before any work). The caller must ``release()``.

    Called from the handler, not as a dependency: FastAPI validates the body after the dependencies,
    and a request refused for its body must not hold a concurrency slot.
    """
    return _admitted(request, tenant, TenantLimiter.admit)


def admit_step(request: Request, tenant: Tenant) -> TenantLimiter:
    """:func:`admit_request` for a step of an open encrypted session: steps/min (not requests/min) and
    concurrency. The caller must ``release()``."""
    return _admitted(request, tenant, TenantLimiter.admit_step)


def _admitted(request: Request, tenant: Tenant, admit) -> TenantLimiter:
    """The tenant's limiter after ``admit(limiter)``; a refusal is counted in the metrics and re-raised."""
    limits: LimitRegistry = request.app.state.limits
    limiter = limits.for_tenant(tenant.id, tenant.limits)
    try:
        admit(limiter)
    except RateLimitError as exc:
        get_metrics(request).rate_limited.labels(tenant.id, exc.code or "limit").inc()
        raise
    return limiter


def charge_tokens(request: Request, tenant: Tenant, limiter: TenantLimiter, tokens: int) -> None:
    """Tokens/min for the tenant (429 / 400), counted in the metrics when refused."""
    try:
        limiter.charge_tokens(tokens)
    except RateLimitError as exc:
        get_metrics(request).rate_limited.labels(tenant.id, exc.code or "limit").inc()
        raise


def record_fallback(request: Request, tenant: Tenant, request_id: str, endpoint: str) -> None:
    """Hand a plaintext fallback to every recorder (the audit log) and count it.

    A recorder that fails refuses the request (503): an unrecorded fallback must not happen.
    """
    event = FallbackEvent(tenant_id=tenant.id, request_id=request_id, endpoint=endpoint,
                          reason="request marked non-sensitive; tenant policy allows plaintext fallback")
    for recorder in request.app.state.fallback_recorders:
        try:
            recorder.record_fallback(event)
        except Exception as exc:
            raise ServiceUnavailableError("cannot record the plaintext fallback; request refused",
                                          retry_after=5, code="fallback_not_recorded") from exc
    get_metrics(request).fallbacks.labels(tenant.id).inc()


EngineDep = Annotated[Any, Depends(get_engine)]


class PlaintextCall:
    """What a plaintext OpenAI endpoint needs: the tenant (authenticated, allowed plaintext), the
    settings and the running engine."""

    __slots__ = ("tenant", "settings", "engine")

    def __init__(self, tenant: Tenant, settings: Any, engine: Any) -> None:
        self.tenant, self.settings, self.engine = tenant, settings, engine


async def plaintext_call(request: Request, settings: SettingsDep) -> PlaintextCall:
    """One FastAPI dependency for ``/v1/completions`` and ``/v1/chat/completions``: the draining gate (503),
    the tenant (401), its privacy mode (403) and the engine (503), in the order the separate dependencies
    ran them (``ensure_admitting`` → ``require_plaintext_access`` ← ``get_tenant`` ← ``get_registry`` →
    ``get_engine``); only the settings stay a dependency of their own (tests override ``get_settings``).

    FastAPI solves every dependency through the same generic machinery (cache keys, signature checks,
    the request's query, path and cookie parameters looked up for each): nine of them cost the API
    process about a fifth of a streamed request's own CPU (``bench/serve_request_cpu.py``), and at 256
    streamed users the requests arrive in bursts of hundreds."""
    await ensure_admitting(request, settings)
    tenant = await get_tenant(request, await get_registry(request, settings))
    await require_plaintext_access(request, tenant)
    return PlaintextCall(tenant, settings, await get_engine(request))


PlaintextCallDep = Annotated[PlaintextCall, Depends(plaintext_call)]
