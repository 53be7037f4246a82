"""What the sync and async clients share: configuration, timeouts, retries, request bodies, SSE parsing.

The I/O-free parts live here; :mod:`client_sdk._client` adds the httpx calls (one blocking, one async).
The privacy seam: every plaintext call goes through :meth:`BaseClient._plaintext_headers`, which
refuses plaintext calls on a client in ``encrypted`` mode and adds the non-sensitive marker when a call
opts into the fallback. The encrypted transport (``client_sdk._private``) plugs in here.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
from collections.abc import Callable, Iterable
from typing import Any, Literal

import httpx

from client_sdk._exceptions import (
    APIConnectionError,
    APIResponseValidationError,
    APIStatusError,
    APITimeoutError,
    PrivacyModeError,
    RateLimitError,
    ServiceUnavailableError,
    status_error,
)

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
SENSITIVITY_HEADER = "X-Cipherlm-Sensitivity"
ClientPrivacy = Literal["plaintext", "encrypted"]


@dataclasses.dataclass(frozen=True)
class Timeout:
    """Finite timeouts (seconds) for every call; ``read`` bounds the wait for each streamed chunk too."""

    connect: float = 5.0
    read: float = 120.0
    write: float = 30.0
    pool: float = 5.0

    def __post_init__(self) -> None:
        for name in ("connect", "read", "write", "pool"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ValueError(f"Timeout.{name} must be a finite positive number, got {value!r}")

    def to_httpx(self, read: float | None = None) -> tuple[float, float, float, float]:
        """httpx's ``(connect, read, write, pool)`` form; ``read`` overrides the read timeout (the private
        path's plan-derived waits). A plain tuple, not an ``httpx.Timeout``: a caller's ``http_client`` may
        be an httpx2 client (Starlette's TestClient, openai's own), whose requests refuse httpx's class."""
        return (self.connect, self.read if read is None else read, self.write, self.pool)


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """Retries of 429/503 and of failed connections, with exponential backoff and full jitter.

    A ``Retry-After`` from the server is honoured (up to ``max_wait``) instead of the backoff.
    """

    max_retries: int = 2
    backoff_base: float = 0.5
    backoff_max: float = 8.0
    max_wait: float = 60.0

    def delay(self, attempt: int, error: Exception, rand: Callable[[], float] = random.random) -> float:
        """Seconds to wait before retry number ``attempt + 1``."""
        retry_after = getattr(error, "retry_after", None)
        if retry_after is not None:
            return min(float(retry_after), self.max_wait)
        return rand() * min(self.backoff_max, self.backoff_base * 2**attempt)

    def should_retry(self, attempt: int, error: Exception) -> bool:
        """True for a retryable error while retries remain."""
        if attempt >= self.max_retries:
            return False
        if isinstance(error, (RateLimitError, ServiceUnavailableError)):
            return True
        # a refused/unreachable connection never reached the server; a timeout may have: not retried
        return isinstance(error, APIConnectionError) and not isinstance(error, APITimeoutError) \
            and isinstance(error.__cause__, httpx.ConnectError)


def drop_none(d: dict[str, Any]) -> dict[str, Any]:
    """``d`` without None values (fields left to the server's defaults)."""
    return {k: v for k, v in d.items() if v is not None}


class BaseClient:
    """Configuration shared by :class:`~client_sdk.Client` and :class:`~client_sdk.AsyncClient`.

    Args:
        api_key: the tenant's key; default ``$CIPHERLM_API_KEY``.
        base_url: the server's root URL; default ``$CIPHERLM_BASE_URL`` or ``http://127.0.0.1:8000``.
        timeout: a :class:`Timeout` (finite defaults).
        max_retries: retries of 429/503/connection failures (0 disables).
        privacy: ``"plaintext"`` (OpenAI-compatible endpoints) or ``"encrypted"`` (plaintext calls are
            run privately through ``client_sdk._private``).
        default_headers: sent with every request.
        key_store: encrypted mode only: an open :class:`client_sdk.KeyStore` that keeps the CKKS key set
            (secret encrypted at rest) across processes; None: a fresh key set per client.
        progress: encrypted mode only: called with a :class:`client_sdk.Progress` during the one-time
            setup (bundle download, key generation, key upload); None (default): silent.
            :func:`client_sdk.print_progress` prints a progress line to stderr.
    """

    def __init__(self, api_key: str | None = None, base_url: str | None = None, *,
                 timeout: Timeout | None = None, max_retries: int = 2, privacy: ClientPrivacy = "plaintext",
                 default_headers: dict[str, str] | None = None, key_store: Any = None,
                 progress: Callable[[Any], None] | None = None) -> None:
        self.api_key = api_key or os.environ.get("CIPHERLM_API_KEY")
        if not self.api_key:
            raise ValueError("no API key: pass api_key= or set CIPHERLM_API_KEY")
        self.base_url = (base_url or os.environ.get("CIPHERLM_BASE_URL") or DEFAULT_BASE_URL).rstrip("/")
        self.timeout = timeout or Timeout()
        self.retry = RetryPolicy(max_retries=max_retries)
        if privacy not in ("plaintext", "encrypted"):
            raise ValueError(f"privacy must be 'plaintext' or 'encrypted', got {privacy!r}")
        self.privacy: ClientPrivacy = privacy
        self.key_store = key_store
        self.progress = progress
        self._headers = {"Authorization": f"Bearer {self.api_key}", "User-Agent": "cipherlm-sdk/0.1",
                         **(default_headers or {})}
        self._rand: Callable[[], float] = random.random

    def _plaintext_headers(self, non_sensitive: bool) -> dict[str, str]:
        """Headers of a plaintext inference call (the privacy seam)."""
        if self.privacy == "encrypted" and not non_sensitive:
            raise PrivacyModeError(
                "this client is in 'encrypted' mode: plaintext completions would reveal the prompt to the "
                "server. Completions of an encrypted-mode Client run privately; pass non_sensitive=True "
                "only for a request your tenant's policy allows to fall back to plaintext.")
        return {SENSITIVITY_HEADER: "non-sensitive"} if non_sensitive else {}

    def _build(self, http: Any, method: str, path: str, json: Any, headers: dict[str, str] | None,
               content: bytes | None, read_timeout: float | None, progress: str | None,
               is_async: bool) -> httpx.Request:
        """An httpx request; a labelled binary body is sent in chunks that report progress."""
        all_headers = {**self._headers, **(headers or {})}
        body: Any = content
        if content is not None and progress and self.progress is not None:
            all_headers["Content-Length"] = str(len(content))
            chunks = _chunks(content, progress, self.progress)
            body = _async_iter(chunks) if is_async else chunks
        return http.build_request(method, self.base_url + path, json=json, content=body, headers=all_headers,
                                  timeout=self.timeout.to_httpx(read_timeout))

    def _report(self, label: str | None, done: int, total: int | None) -> None:
        if label and self.progress is not None:
            from client_sdk._protocol import Progress

            self.progress(Progress(label, done, total))

    @staticmethod
    def _check(response: httpx.Response) -> None:
        """Raise the mapped SDK error for an error status (body already read)."""
        if response.status_code >= 400:
            raise status_error(response.status_code, response.headers, response.content)

    @staticmethod
    def _json(response: httpx.Response) -> dict[str, Any]:
        try:
            body = response.json()
        except ValueError as exc:
            raise APIResponseValidationError(f"response is not JSON: {response.text[:200]!r}") from exc
        if not isinstance(body, dict):
            raise APIResponseValidationError("response is not a JSON object")
        return body


def completion_body(prompt: Any, params: dict[str, Any], extra_body: dict[str, Any] | None) -> dict[str, Any]:
    """The JSON body of ``POST /v1/completions``."""
    return {"prompt": prompt, **drop_none(params), **(extra_body or {})}


def chat_body(messages: Iterable[dict[str, Any]], params: dict[str, Any],
              extra_body: dict[str, Any] | None) -> dict[str, Any]:
    """The JSON body of ``POST /v1/chat/completions``."""
    return {"messages": list(messages), **drop_none(params), **(extra_body or {})}


def parse_sse_line(line: str) -> dict[str, Any] | None | Literal[False]:
    """One line of an SSE stream: the event's JSON, None for a non-data line, False at ``[DONE]``.

    Raises:
        APIStatusError: the server reported an error in the stream.
        APIResponseValidationError: the data is not JSON.
    """
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == "[DONE]":
        return False
    try:
        event = json.loads(data)
    except ValueError as exc:
        raise APIResponseValidationError(f"bad stream event: {data[:200]!r}") from exc
    if isinstance(event, dict) and isinstance(event.get("error"), dict):
        err = event["error"]
        raise APIStatusError(str(err.get("message")), status_code=500, body=event, type=err.get("type"),
                             code=err.get("code"))
    return event


PROGRESS_CHUNK = 1 << 20


def _chunks(data: bytes, label: str, progress: Callable[[Any], None]):
    """``data`` in 1 MiB pieces, reporting the bytes handed to the transport."""
    from client_sdk._protocol import Progress

    view = memoryview(data)
    for start in range(0, len(data), PROGRESS_CHUNK):
        yield bytes(view[start:start + PROGRESS_CHUNK])
        progress(Progress(label, min(start + PROGRESS_CHUNK, len(data)), len(data)))


async def _async_iter(chunks):
    for chunk in chunks:
        yield chunk


def content_length(response: httpx.Response) -> int | None:
    """The response's declared length, if any."""
    value = response.headers.get("content-length")
    return int(value) if value and value.isdigit() else None
