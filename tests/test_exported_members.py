"""The public surface of client_sdk is exactly ``__all__``, and every name in it resolves."""

import client_sdk


def test_client_sdk_all_is_pinned():
    assert set(client_sdk.__all__) == {
        "APIConnectionError", "APIResponseValidationError", "APIStatusError", "APITimeoutError", "AsyncClient",
        "AsyncStream", "AuthenticationError", "BadRequestError", "ChatChoice", "ChatChunkChoice",
        "ChatCompletion", "ChatCompletionChunk", "ChatMessage", "ChoiceDelta", "CipherlmError", "Client",
        "Completion", "CompletionChoice", "InternalServerError", "Model", "NotFoundError",
        "PermissionDeniedError", "PrivacyModeError", "PromptTokensDetails", "RateLimitError", "RetryPolicy",
        "ServiceUnavailableError", "Stream", "TenantInfo", "Timeout", "Usage",
        "InvalidKeyStoreAccess", "KeyStore", "KeyStoreError", "PrivateModeError", "Progress", "ProgressPrinter",
        "print_progress",
    }
    assert sorted(client_sdk.__all__) == list(client_sdk.__all__)  # kept sorted, one place to look


def test_client_sdk_exports_resolve_and_are_public():
    for name in client_sdk.__all__:
        obj = getattr(client_sdk, name)
        assert not name.startswith("_")
        assert getattr(obj, "__module__", "client_sdk").startswith("client_sdk")


def test_exception_hierarchy():
    for name in client_sdk.__all__:
        obj = getattr(client_sdk, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, client_sdk.CipherlmError), name
