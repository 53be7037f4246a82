"""cipherlm's client SDK.

Plaintext half (OpenAI-style, for tenants in ``plaintext`` mode)::

    from client_sdk import Client
    with Client(api_key="clm-...", base_url="http://127.0.0.1:8000") as client:
        print(client.chat.completions.create(messages=[{"role": "user", "content": "Hi"}]).choices[0].message)

``Client``/``AsyncClient`` take ``privacy="plaintext" | "encrypted"``; an encrypted-mode client refuses
plaintext calls locally (``PrivacyModeError``) unless a call passes ``non_sensitive=True``.
``client.tenant()`` tells which mode the server enforces for the key. Exceptions: see
:mod:`client_sdk._exceptions` (all importable from here).
"""

from client_sdk._base import RetryPolicy, Timeout
from client_sdk._client import AsyncClient, AsyncStream, Client, Stream
from client_sdk._exceptions import (
    APIConnectionError,
    APIResponseValidationError,
    APIStatusError,
    APITimeoutError,
    AuthenticationError,
    BadRequestError,
    CipherlmError,
    InternalServerError,
    NotFoundError,
    PermissionDeniedError,
    PrivacyModeError,
    RateLimitError,
    ServiceUnavailableError,
)
from client_sdk._types import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatMessage,
    ChoiceDelta,
    Completion,
    CompletionChoice,
    Model,
    PromptTokensDetails,
    TenantInfo,
    Usage,
)

__all__ = [
    "APIConnectionError",
    "APIResponseValidationError",
    "APIStatusError",
    "APITimeoutError",
    "AsyncClient",
    "AsyncStream",
    "AuthenticationError",
    "BadRequestError",
    "ChatChoice",
    "ChatChunkChoice",
    "ChatCompletion",
    "ChatCompletionChunk",
    "ChatMessage",
    "ChoiceDelta",
    "CipherlmError",
    "Client",
    "Completion",
    "CompletionChoice",
    "InternalServerError",
    "Model",
    "NotFoundError",
    "PermissionDeniedError",
    "PrivacyModeError",
    "PromptTokensDetails",
    "RateLimitError",
    "RetryPolicy",
    "ServiceUnavailableError",
    "Stream",
    "TenantInfo",
    "Timeout",
    "Usage",
]
