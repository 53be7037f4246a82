"""Exceptions raised by the client SDK.

Hierarchy::

    CipherlmError
    ├── APIConnectionError            the server could not be reached / the connection broke
    │   └── APITimeoutError           a connect/read/write/pool timeout expired
    ├── APIStatusError                the server answered with an error status
    │   ├── BadRequestError           400 (also 413, 422)
    │   ├── AuthenticationError       401
    │   ├── PermissionDeniedError     403 (e.g. an encrypted-mode tenant sent a plaintext request)
    │   ├── NotFoundError             404
    │   ├── RateLimitError            429 (``retry_after`` seconds, from Retry-After)
    │   ├── InternalServerError       500 and other 5xx
    │   └── ServiceUnavailableError   503 (draining or starting; ``retry_after``)
    ├── APIResponseValidationError    the server's body is not what the API promises
    ├── PrivacyModeError              the call does not fit the client's privacy mode
    └── PrivateModeError              the encrypted-mode runtime cannot proceed (bad bundle, plan changed,
                                      unusable key, a request field it refuses: ``param`` names it)

HTTP statuses are mapped to classes in :func:`status_error` and transport failures in
:func:`map_transport_errors` — the only two places foreign errors become SDK errors.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

import httpx


class CipherlmError(Exception):
    """Base class of every SDK error."""


class APIConnectionError(CipherlmError):
    """The request did not get a response (DNS, refused, reset, protocol error)."""


class APITimeoutError(APIConnectionError):
    """A timeout of the client's :class:`~client_sdk.Timeout` expired."""


class APIResponseValidationError(CipherlmError):
    """The server's response does not have the documented shape."""


class PrivacyModeError(CipherlmError):
    """The requested operation does not fit the client's (or the tenant's) privacy mode."""


class PrivateModeError(CipherlmError):
    """The private runtime cannot proceed (bad bundle, plan changed, unusable key, invalid request field).

    Attributes:
        param: the offending request field, if any (the same name the server's 400 would give).
    """

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class APIStatusError(CipherlmError):
    """An error status from the server, with OpenAI's error fields.

    Attributes:
        status_code: the HTTP status.
        message: the server's message.
        type: OpenAI error type (``invalid_request_error``, ``rate_limit_error``, ...).
        param: the offending request field, if any.
        code: a machine-readable code, if any (e.g. ``privacy_mode_encrypted``).
        retry_after: seconds from the ``Retry-After`` header, if any.
        body: the decoded JSON body (or None).
    """

    def __init__(self, message: str, *, status_code: int, body: Any = None, type: str | None = None,
                 param: str | None = None, code: str | None = None, retry_after: float | None = None) -> None:
        super().__init__(f"{status_code}: {message}")
        self.message = message
        self.status_code = status_code
        self.body = body
        self.type = type
        self.param = param
        self.code = code
        self.retry_after = retry_after


class BadRequestError(APIStatusError):
    """400/413/422: the request is invalid; retrying it unchanged will fail again."""


class AuthenticationError(APIStatusError):
    """401: missing or invalid API key."""


class PermissionDeniedError(APIStatusError):
    """403: the tenant may not do this (e.g. plaintext requests of an encrypted-mode tenant)."""


class NotFoundError(APIStatusError):
    """404: unknown endpoint or model."""


class RateLimitError(APIStatusError):
    """429: a tenant limit or the server's queue; retry after ``retry_after`` seconds."""


class InternalServerError(APIStatusError):
    """5xx other than 503."""


class ServiceUnavailableError(APIStatusError):
    """503: the server is starting or draining; retry after ``retry_after`` seconds."""


_BY_STATUS: dict[int, type[APIStatusError]] = {
    400: BadRequestError, 401: AuthenticationError, 403: PermissionDeniedError, 404: NotFoundError,
    413: BadRequestError, 422: BadRequestError, 429: RateLimitError, 503: ServiceUnavailableError,
}


def parse_retry_after(value: str | None) -> float | None:
    """Seconds from a ``Retry-After`` header (delta-seconds form; HTTP dates are ignored)."""
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None
    return seconds if seconds >= 0 else None


def status_error(status_code: int, headers: httpx.Headers, content: bytes) -> APIStatusError:
    """The SDK exception for an error response (OpenAI-shaped body or not)."""
    try:
        body: Any = json.loads(content) if content else None
    except (ValueError, UnicodeDecodeError):
        body = None
    err = body.get("error") if isinstance(body, dict) and isinstance(body.get("error"), dict) else {}
    message = str(err.get("message") or (content[:200].decode("utf-8", "replace") if content else "")
                  or f"HTTP {status_code}")
    cls = _BY_STATUS.get(status_code) or (InternalServerError if status_code >= 500 else APIStatusError)
    return cls(message, status_code=status_code, body=body, type=err.get("type"), param=err.get("param"),
               code=err.get("code"), retry_after=parse_retry_after(headers.get("retry-after")))


@contextlib.contextmanager
def map_transport_errors() -> Iterator[None]:
    """Translate httpx transport exceptions into SDK exceptions (``raise ... from exc``)."""
    try:
        yield
    except httpx.TimeoutException as exc:
        raise APITimeoutError(f"request timed out: {exc}") from exc
    except httpx.TransportError as exc:
        raise APIConnectionError(f"connection error: {exc}") from exc
