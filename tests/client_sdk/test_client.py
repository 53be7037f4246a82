"""The plaintext SDK: against a live `cipherlm serve` (sync), the in-process app (async), and mock
transports for retries and error mapping."""

from __future__ import annotations

import httpx
import pytest

import client_sdk
from client_sdk import (
    AsyncClient,
    AuthenticationError,
    BadRequestError,
    Client,
    PermissionDeniedError,
    PrivacyModeError,
    RateLimitError,
    ServiceUnavailableError,
    Timeout,
)
from tests.server.app_helpers import (  # noqa: F401 (fixtures)
    KEYS,
    engine,
    live_server,
    make_settings,
    tiny_loaded,
    tiny_model_dir,
)


@pytest.fixture
def client(live_server):  # noqa: F811
    with Client(api_key=KEYS["plain"], base_url=live_server.url, max_retries=0) as c:
        yield c


# --- against the live server ------------------------------------------------------------------------


def test_sync_completion_and_stream(client):
    full = client.completions.create(prompt="Hello", max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    assert isinstance(full, client_sdk.Completion) and full.usage.completion_tokens == 5
    with client.completions.create(prompt="Hello", max_tokens=5, temperature=0, stream=True, include_usage=True,
                                   extra_body={"ignore_eos": True}) as stream:
        chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].usage.total_tokens == full.usage.total_tokens


def test_sync_chat_and_stream(client):
    msgs = [{"role": "user", "content": "Hi"}]
    full = client.chat.completions.create(messages=msgs, max_tokens=4, temperature=0, top_k=3)
    assert full.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(messages=msgs, max_tokens=4, temperature=0, top_k=3, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content
    assert full.usage.prompt_tokens_details.cached_tokens >= 0


def test_models_and_tenant(client, live_server):  # noqa: F811
    assert [m.id for m in client.models.list()] == ["tiny"]
    info = client.tenant()
    assert info.id == "plain" and info.privacy_mode == "plaintext"
    with Client(api_key=KEYS["enc"], base_url=live_server.url) as enc:
        assert enc.tenant().privacy_mode == "encrypted"


def test_typed_errors(live_server):  # noqa: F811
    with Client(api_key="clm-bad", base_url=live_server.url, max_retries=0) as bad:
        with pytest.raises(AuthenticationError) as info:
            bad.models.list()
    assert info.value.status_code == 401 and info.value.code == "invalid_api_key"
    with Client(api_key=KEYS["enc"], base_url=live_server.url, max_retries=0) as enc:
        with pytest.raises(PermissionDeniedError) as info:
            enc.completions.create(prompt="secret", max_tokens=2)
        assert info.value.code == "privacy_mode_encrypted"
        with pytest.raises(PermissionDeniedError):  # marking is not enough when the policy is "never"
            enc.completions.create(prompt="public", max_tokens=2, non_sensitive=True)
    with Client(api_key=KEYS["plain"], base_url=live_server.url, max_retries=0) as ok:
        with pytest.raises(BadRequestError) as info:
            ok.completions.create(prompt="x", temperature=-3)
        assert info.value.param == "temperature"


def test_non_sensitive_fallback(live_server):  # noqa: F811
    with Client(api_key=KEYS["enc-fallback"], base_url=live_server.url, privacy="encrypted") as c:
        with pytest.raises(PrivacyModeError):  # refused locally: nothing was sent
            c.completions.create(prompt="secret", max_tokens=2)
        resp = c.completions.create(prompt="public text", max_tokens=2, non_sensitive=True)
    assert resp.usage.completion_tokens >= 1


# --- async, in-process ------------------------------------------------------------------------------


async def test_async_client_in_process(engine, tiny_model_dir):  # noqa: F811
    from server.app import create_app

    app = create_app(make_settings(tiny_model_dir), engine)
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app))
    async with AsyncClient(api_key=KEYS["plain"], base_url="http://test", http_client=http) as c:
        full = await c.chat.completions.create(messages=[{"role": "user", "content": "Yo"}], max_tokens=3,
                                               temperature=0, ignore_eos=True)
        stream = await c.chat.completions.create(messages=[{"role": "user", "content": "Yo"}], max_tokens=3,
                                                 temperature=0, ignore_eos=True, stream=True, include_usage=True)
        chunks = [ch async for ch in stream]
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == \
            full.choices[0].message.content
        assert chunks[-1].usage.completion_tokens == 3
        comp = await c.completions.create(prompt=[1, 2, 3], max_tokens=2)
        assert comp.usage.prompt_tokens == 3
        assert (await c.tenant()).id == "plain" and [m.id for m in await c.models.list()] == ["tiny"]


# --- retries and mapping (mock transports) ----------------------------------------------------------


def _ok_completion() -> dict:
    return {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "text": "ok", "finish_reason": "stop", "logprobs": None}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}


def _scripted(responses: list[httpx.Response]):
    calls: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        return responses[len(calls) - 1]

    return httpx.MockTransport(handler), calls


def _client_with(transport, **kw) -> Client:
    c = Client(api_key="k", base_url="http://x", http_client=httpx.Client(transport=transport), **kw)
    c._sleeps = []
    c._sleep = c._sleeps.append
    c._rand = lambda: 0.5
    return c


def test_retries_honour_retry_after():
    err = {"error": {"message": "slow down", "type": "rate_limit_error", "param": None, "code": "x"}}
    transport, calls = _scripted([httpx.Response(429, json=err, headers={"Retry-After": "3"}),
                                  httpx.Response(503, json=err),
                                  httpx.Response(200, json=_ok_completion())])
    c = _client_with(transport, max_retries=2)
    assert c.completions.create(prompt="p").choices[0].text == "ok"
    assert len(calls) == 3 and c._sleeps == [3.0, 0.5 * 0.5 * 2]  # Retry-After, then jittered backoff
    assert calls[0].headers["authorization"] == "Bearer k"


def test_retries_give_up_with_typed_error():
    err = {"error": {"message": "busy", "type": "rate_limit_error", "param": None, "code": None}}
    transport, calls = _scripted([httpx.Response(429, json=err, headers={"Retry-After": "1"})] * 3)
    c = _client_with(transport, max_retries=2)
    with pytest.raises(RateLimitError) as info:
        c.completions.create(prompt="p")
    assert info.value.retry_after == 1.0 and len(calls) == 3
    transport, calls = _scripted([httpx.Response(503, text="upstream gone")])
    with pytest.raises(ServiceUnavailableError) as info:
        _client_with(transport, max_retries=0).completions.create(prompt="p")
    assert "upstream gone" in info.value.message


def test_bad_request_is_not_retried():
    transport, calls = _scripted([httpx.Response(400, json={"error": {"message": "no", "type": "x"}})] * 3)
    with pytest.raises(BadRequestError):
        _client_with(transport, max_retries=2).completions.create(prompt="p")
    assert len(calls) == 1


def test_connection_errors_are_mapped_and_retried():
    attempts = []

    def refuse(request):
        attempts.append(request)
        raise httpx.ConnectError("refused", request=request)

    c = _client_with(httpx.MockTransport(refuse), max_retries=1)
    with pytest.raises(client_sdk.APIConnectionError) as info:
        c.models.list()
    assert isinstance(info.value.__cause__, httpx.ConnectError) and len(attempts) == 2

    def slow(request):
        raise httpx.ReadTimeout("slow", request=request)

    with pytest.raises(client_sdk.APITimeoutError):
        _client_with(httpx.MockTransport(slow), max_retries=3).models.list()


def test_in_band_stream_error_and_bad_body():
    sse = b'data: {"error": {"message": "engine failed", "type": "server_error"}}\n\n'
    transport, _ = _scripted([httpx.Response(200, content=sse, headers={"content-type": "text/event-stream"})])
    with pytest.raises(client_sdk.APIStatusError, match="engine failed"):
        list(_client_with(transport).completions.create(prompt="p", stream=True))
    transport, _ = _scripted([httpx.Response(200, json={"id": 3})])
    with pytest.raises(client_sdk.APIResponseValidationError):
        _client_with(transport).completions.create(prompt="p")


def test_timeout_is_finite_and_configuration_checked(monkeypatch):
    assert Timeout().read < float("inf")
    with pytest.raises(ValueError):
        Timeout(read=float("inf"))
    monkeypatch.delenv("CIPHERLM_API_KEY", raising=False)
    with pytest.raises(ValueError):
        Client()
    with pytest.raises(ValueError):
        Client(api_key="k", privacy="homomorphic")
    monkeypatch.setenv("CIPHERLM_API_KEY", "from-env")
    with Client() as c:
        assert c.api_key == "from-env" and c.base_url == "http://127.0.0.1:8000"
