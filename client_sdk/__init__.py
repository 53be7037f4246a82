"""cipherlm's client SDK.

Plaintext half (OpenAI-style, for tenants in ``plaintext`` mode)::

    from client_sdk import Client
    with Client(api_key="clm-...", base_url="http://127.0.0.1:8000") as client:
        print(client.chat.completions.create(messages=[{"role": "user", "content": "Hi"}]).choices[0].message)

``Client``/``AsyncClient`` take ``privacy="plaintext" | "encrypted"``; an encrypted-mode client runs the same
calls privately (local layers + CKKS steps on the server, ``docs/sdk.md``) unless a call passes
``non_sensitive=True`` for a plaintext fallback its tenant's policy allows.
``client.tenant()`` tells which mode the server enforces for the key. Exceptions: see
:mod:`client_sdk._exceptions` (all importable from here). ``progress=print_progress`` (or a
:class:`ProgressPrinter`, or any callable taking a :class:`Progress`) shows the encrypted mode's
one-time setup: bundle download, key generation, key upload.
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
    PrivateModeError,
    RateLimitError,
    ServiceUnavailableError,
)
from client_sdk._keystore_errors import InvalidKeyStoreAccess, KeyStoreError
from client_sdk._progress import ProgressPrinter, print_progress
from client_sdk._protocol import Progress
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
from client_sdk.keystore import KeyStore

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
    "InvalidKeyStoreAccess",
    "KeyStore",
    "KeyStoreError",
    "Model",
    "NotFoundError",
    "PermissionDeniedError",
    "PrivacyModeError",
    "PrivateModeError",
    "Progress",
    "ProgressPrinter",
    "PromptTokensDetails",
    "RateLimitError",
    "RetryPolicy",
    "ServiceUnavailableError",
    "Stream",
    "TenantInfo",
    "Timeout",
    "Usage",
    "print_progress",
]
