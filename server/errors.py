"""HTTP errors in OpenAI's JSON shape, and every exception handler of the app in one place.

Body of every error response::

    {"error": {"message": "...", "type": "invalid_request_error", "param": "temperature", "code": null}}

Hierarchy (each class fixes the status and the OpenAI ``type``)::

    APIError
    ├── InvalidRequestError      400 invalid_request_error
    ├── AuthenticationError      401 authentication_error
    ├── PermissionDeniedError    403 permission_error
    ├── NotFoundError            404 not_found_error
    ├── ConflictError            409 invalid_request_error (stale plan, step out of order)
    ├── GoneError                410 invalid_request_error (closed or lost encrypted session)
    ├── RequestTooLargeError     413 invalid_request_error
    ├── RateLimitError           429 rate_limit_error      (+ Retry-After)
    └── ServiceUnavailableError  503 service_unavailable   (+ Retry-After)

Foreign errors are translated in :func:`install_error_handlers`: request validation → 400 (never a
5xx for bad input), the engine's ``InvalidRequestError`` → 400, ``EngineOverloadedError`` → 429 with
``Retry-After``, Starlette's HTTP errors (404/405) → the same shape; anything else is a bug → 500.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("cipherlm.server")


class APIError(Exception):
    """An error response: status, OpenAI type, message, param, code and extra headers."""

    status_code = 500
    error_type = "server_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        """The OpenAI-shaped JSON body."""
        return error_body(self.message, self.error_type, self.param, self.code)


class InvalidRequestError(APIError):
    status_code = 400
    error_type = "invalid_request_error"


class AuthenticationError(APIError):
    status_code = 401
    error_type = "authentication_error"


class PermissionDeniedError(APIError):
    status_code = 403
    error_type = "permission_error"


class NotFoundError(APIError):
    status_code = 404
    error_type = "not_found_error"


class ConflictError(APIError):
    status_code = 409
    error_type = "invalid_request_error"


class GoneError(APIError):
    status_code = 410
    error_type = "invalid_request_error"


class RequestTooLargeError(APIError):
    status_code = 413
    error_type = "invalid_request_error"


class _RetryableError(APIError):
    """An error the client should retry after ``retry_after`` seconds (sent as ``Retry-After``)."""

    def __init__(self, message: str, *, retry_after: float, code: str | None = None) -> None:
        seconds = max(1, math.ceil(retry_after))  # Retry-After carries whole seconds
        super().__init__(message, code=code, headers={"Retry-After": str(seconds)})
        self.retry_after = seconds


class RateLimitError(_RetryableError):
    status_code = 429
    error_type = "rate_limit_error"


class ServiceUnavailableError(_RetryableError):
    status_code = 503
    error_type = "service_unavailable"


def error_body(message: str, error_type: str, param: str | None = None, code: str | None = None) -> dict:
    """``{"error": {...}}`` as OpenAI returns it."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_response(exc: APIError) -> JSONResponse:
    """The JSON response of an :class:`APIError`."""
    return JSONResponse(exc.body(), status_code=exc.status_code, headers=exc.headers)


def _validation_param(errors: list[dict]) -> str | None:
    loc = [str(p) for p in (errors[0].get("loc", ()) if errors else ()) if p != "body"]
    return ".".join(loc) or None


def _validation_message(errors: list[dict]) -> str:
    parts = []
    for e in errors[:5]:
        where = ".".join(str(p) for p in e.get("loc", ()) if p != "body") or "body"
        parts.append(f"{where}: {e.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request"


def from_engine_error(exc: Exception) -> APIError:
    """Translate an engine exception (engine.errors) into an :class:`APIError`."""
    from engine.errors import EngineOverloadedError
    from engine.errors import InvalidRequestError as EngineInvalidRequest

    if isinstance(exc, EngineOverloadedError):
        return RateLimitError(f"server overloaded: {exc}", retry_after=exc.retry_after,
                              code="engine_overloaded")
    if isinstance(exc, EngineInvalidRequest):
        return InvalidRequestError(str(exc))
    return APIError(f"engine error: {exc}")


async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return error_response(exc)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = list(exc.errors())
    if errors and errors[0].get("type") == "json_invalid":  # its loc is ("body", character offset): no param
        at = errors[0].get("loc", ("body",))[-1]
        reason = (errors[0].get("ctx") or {}).get("error", "JSON decode error")
        return error_response(InvalidRequestError(f"the request body is not valid JSON: {reason} (at character {at})"))
    return error_response(InvalidRequestError(_validation_message(errors), param=_validation_param(errors)))


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    if exc.status_code >= 500:
        kind = "server_error"
    return JSONResponse(error_body(str(exc.detail), kind), status_code=exc.status_code,
                        headers=getattr(exc, "headers", None))


async def _engine_error(request: Request, exc: Exception) -> JSONResponse:
    return error_response(from_engine_error(exc))


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return error_response(APIError("internal server error"))


def install_error_handlers(app: FastAPI) -> None:
    """Register every handler on ``app`` (the only place exceptions become responses)."""
    from engine.errors import EngineError

    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(EngineError, _engine_error)
    app.add_exception_handler(Exception, _unexpected)
