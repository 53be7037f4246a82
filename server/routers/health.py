"""Liveness, readiness and Prometheus metrics.

* ``/health/live``: 200 while the process serves HTTP at all.
* ``/health/ready``: 200 when the engine runs and the server admits requests; 503 while starting or
  draining (SIGTERM), so a load balancer stops sending traffic before the process exits.
* ``/metrics``: Prometheus text format (see :mod:`server.metrics`).
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

router = APIRouter(tags=["health"])


@router.get("/health/live")
async def live() -> dict[str, str]:
    """The process is up."""
    return {"status": "ok"}


@router.get("/health/ready")
async def ready(request: Request) -> JSONResponse:
    """Ready to take requests (503 while the engine starts or the server drains)."""
    lifecycle = request.app.state.lifecycle
    if lifecycle.draining:
        return JSONResponse({"status": "draining", "in_flight": lifecycle.in_flight}, status_code=503,
                            headers={"Retry-After": "1"})
    if getattr(request.app.state, "engine", None) is None:
        return JSONResponse({"status": "starting"}, status_code=503, headers={"Retry-After": "1"})
    if not getattr(request.app.state.engine, "healthy", True):  # the engine core process died
        return JSONResponse({"status": "engine_failed"}, status_code=503)
    return JSONResponse({"status": "ready", "in_flight": lifecycle.in_flight})


@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request) -> Response:
    """Prometheus scrape endpoint."""
    return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE_LATEST)
