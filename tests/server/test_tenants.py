"""Tenants: keys, privacy-mode enforcement, plaintext fallback, limits, per-tenant prefix-cache salts."""

from __future__ import annotations

import httpx
import pytest

from server.app import create_app
from server.limits import LimitRegistry, TenantLimiter, TokenBucket
from server.settings import LimitSettings, Settings, TenantSettings
from server.tenants import (
    FallbackEvent,
    TenantRegistry,
    derive_cache_salt,
    generate_api_key,
    hash_api_key,
)
from tests.server.app_helpers import auth, engine, make_settings, tiny_loaded, tiny_model_dir  # noqa: F401

LONG_PROMPT = "The quick brown fox jumps over the lazy dog. " * 12  # > several 16-token blocks


class Recorder:
    """A FallbackRecorder that keeps the events (what the audit log will receive)."""

    def __init__(self, fail: bool = False) -> None:
        self.events: list[FallbackEvent] = []
        self.fail = fail

    def record_fallback(self, event: FallbackEvent) -> None:
        if self.fail:
            raise OSError("audit log unavailable")
        self.events.append(event)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


# --- keys and salts ---------------------------------------------------------------------------------


def test_keys_are_hashed_and_looked_up():
    key = generate_api_key()
    assert key.startswith("clm-") and len(key) > 40 and generate_api_key() != key
    settings = Settings(server_secret="s", tenants=[TenantSettings(id="a", api_key_hashes=[hash_api_key(key)])])
    reg = TenantRegistry(settings, b"s")
    assert reg.authenticate(key).id == "a"
    assert reg.authenticate(key + "x") is None and reg.authenticate("") is None
    assert key not in settings.model_dump_json()


def test_settings_reject_bad_hashes_and_duplicates():
    with pytest.raises(ValueError):
        TenantSettings(id="a", api_key_hashes=["md5:abc"])
    h = hash_api_key("k")
    with pytest.raises(ValueError):
        Settings(tenants=[TenantSettings(id="a", api_key_hashes=[h]), TenantSettings(id="b", api_key_hashes=[h])])


def test_cache_salt_is_per_tenant_and_secret_bound():
    assert derive_cache_salt(b"s", "a") != derive_cache_salt(b"s", "b")
    assert derive_cache_salt(b"s", "a") == derive_cache_salt(b"s", "a")
    assert derive_cache_salt(b"s", "a") != derive_cache_salt(b"t", "a")


# --- enforcement over HTTP --------------------------------------------------------------------------


async def test_wrong_or_missing_key_is_401(engine, tiny_model_dir):  # noqa: F811
    async with _client(create_app(make_settings(tiny_model_dir), engine)) as c:
        r = await c.post("/v1/completions", json={"prompt": "hi"}, headers={"Authorization": "Bearer clm-nope"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        r = await c.post("/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "missing_api_key"


async def test_encrypted_tenant_plaintext_request_is_403(engine, tiny_model_dir):  # noqa: F811
    recorder = Recorder()
    app = create_app(make_settings(tiny_model_dir), engine, fallback_recorders=[recorder])
    async with _client(app) as c:
        for path, body in (("/v1/completions", {"prompt": "secret"}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "secret"}]})):
            r = await c.post(path, json=body, headers=auth("enc"))
            err = r.json()["error"]
            assert r.status_code == 403 and err["code"] == "privacy_mode_encrypted"
            assert "encrypted" in err["message"] and "privacy='encrypted'" in err["message"]
        # marking non-sensitive does not help when the policy is "never"
        r = await c.post("/v1/completions", json={"prompt": "x"},
                         headers={**auth("enc"), "X-Cipherlm-Sensitivity": "non-sensitive"})
        assert r.status_code == 403
        # a fallback-allowed tenant that does not mark the request is refused, and told how
        r = await c.post("/v1/completions", json={"prompt": "x"}, headers=auth("enc-fallback"))
        assert r.status_code == 403 and "X-Cipherlm-Sensitivity" in r.json()["error"]["message"]
    assert recorder.events == []


async def test_non_sensitive_fallback_is_served_and_recorded(engine, tiny_model_dir):  # noqa: F811
    recorder = Recorder()
    app = create_app(make_settings(tiny_model_dir), engine, fallback_recorders=[recorder])
    headers = {**auth("enc-fallback"), "X-Cipherlm-Sensitivity": "non-sensitive"}
    async with _client(app) as c:
        r = await c.post("/v1/completions", json={"prompt": "public text", "max_tokens": 3}, headers=headers)
        assert r.status_code == 200, r.text
        metrics = (await c.get("/metrics")).text
    assert [(e.tenant_id, e.request_id, e.endpoint) for e in recorder.events] == \
        [("enc-fallback", r.json()["id"], "/v1/completions")]
    assert 'cipherlm:plaintext_fallback_total{tenant="enc-fallback"} 1.0' in metrics


async def test_unrecordable_fallback_is_refused(engine, tiny_model_dir):  # noqa: F811
    app = create_app(make_settings(tiny_model_dir), engine, fallback_recorders=[Recorder(fail=True)])
    headers = {**auth("enc-fallback"), "X-Cipherlm-Sensitivity": "non-sensitive"}
    async with _client(app) as c:
        r = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=headers)
    assert r.status_code == 503 and r.json()["error"]["code"] == "fallback_not_recorded"


async def test_whoami(engine, tiny_model_dir):  # noqa: F811
    async with _client(create_app(make_settings(tiny_model_dir), engine)) as c:
        body = (await c.get("/v1/tenant", headers=auth("enc-fallback"))).json()
    assert body["id"] == "enc-fallback" and body["privacy_mode"] == "encrypted"
    assert body["fallback"] == "non_sensitive" and "hash" not in str(body) and "salt" not in str(body)


async def test_tenants_never_share_prefix_cache(engine, tiny_model_dir):  # noqa: F811
    body = {"prompt": LONG_PROMPT, "max_tokens": 1}
    async with _client(create_app(make_settings(tiny_model_dir), engine)) as c:
        first = (await c.post("/v1/completions", json=body, headers=auth("plain"))).json()
        same = (await c.post("/v1/completions", json=body, headers=auth("plain"))).json()
        other = (await c.post("/v1/completions", json=body, headers=auth("plain2"))).json()
        other_again = (await c.post("/v1/completions", json=body, headers=auth("plain2"))).json()

    def cached(resp):
        return resp["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached(first) == 0
    assert cached(same) >= 16  # the tenant's own blocks are reused
    assert cached(other) == 0  # same prompt, other tenant: no hit
    assert cached(other_again) >= 16


# --- limits -----------------------------------------------------------------------------------------


def test_token_bucket_retry_after_is_exact():
    b = TokenBucket.per_minute(60, now=0.0)  # 1 unit per second
    assert b.take(60, 0.0) == 0.0
    assert b.take(1, 0.0) == pytest.approx(1.0)
    assert b.take(1, 1.0) == 0.0
    assert b.take(5, 1.0) == pytest.approx(5.0)
    b.give_back(100, 1.0)
    assert b.level == 60


def test_steps_have_their_own_bucket_and_share_the_concurrency_slots():
    clock = FakeClock()
    lim = TenantLimiter(LimitSettings(requests_per_minute=1, steps_per_minute=120, max_concurrent=2), clock)
    lim.admit()
    for _ in range(119):              # requests/min is spent; steps are not requests (issue 17, session 10)
        lim.admit_step()
        lim.release()
    lim.admit_step()                  # the 120th: the step bucket is empty now, one slot in use
    with pytest.raises(Exception) as info:
        lim.admit_step()
    assert info.value.status_code == 429 and info.value.code == "concurrency_limit_exceeded"
    lim.release()
    with pytest.raises(Exception) as info:
        lim.admit_step()
    assert info.value.code == "steps_per_minute_exceeded" and info.value.retry_after == 1   # 0.5 s, whole seconds
    clock.now += 0.5                  # 120 a minute refill one step in 0.5 s
    lim.admit_step()


def test_limiter_concurrency_and_refund():
    clock = FakeClock()
    lim = TenantLimiter(LimitSettings(requests_per_minute=None, max_concurrent=1, tokens_per_minute=100), clock)
    lim.admit()
    with pytest.raises(Exception) as info:
        lim.admit()
    assert info.value.status_code == 429 and info.value.code == "concurrency_limit_exceeded"
    lim.release()
    lim.admit()
    lim.charge_tokens(100)
    lim.refund_tokens(40)
    lim.charge_tokens(40)
    with pytest.raises(Exception) as info:
        lim.charge_tokens(30)
    assert info.value.status_code == 429 and info.value.retry_after == 18  # 30 tokens at 100/60 per s
    with pytest.raises(Exception) as info:
        lim.charge_tokens(101)
    assert info.value.status_code == 400


async def test_requests_per_minute_gives_429_with_retry_after(engine, tiny_model_dir):  # noqa: F811
    clock = FakeClock()
    app = create_app(make_settings(tiny_model_dir), engine, limits=LimitRegistry(clock))
    body = {"prompt": "hi", "max_tokens": 2}
    async with _client(app) as c:
        for _ in range(2):  # limited: 2 requests per minute
            assert (await c.post("/v1/completions", json=body, headers=auth("limited"))).status_code == 200
        r = await c.post("/v1/completions", json=body, headers=auth("limited"))
        assert r.status_code == 429 and r.headers["Retry-After"] == "30"
        assert r.json()["error"]["type"] == "rate_limit_error"
        assert (await c.post("/v1/completions", json=body, headers=auth("plain"))).status_code == 200
        clock.now += 30
        assert (await c.post("/v1/completions", json=body, headers=auth("limited"))).status_code == 200
        metrics = (await c.get("/metrics")).text
    assert 'cipherlm:rate_limited_total{limit="requests_per_minute_exceeded",tenant="limited"} 1.0' in metrics


async def test_tokens_per_minute_and_max_tokens(engine, tiny_model_dir):  # noqa: F811
    settings = make_settings(tiny_model_dir)
    limited = settings.tenants[-1]
    limited.limits = limited.limits.model_copy(update={"requests_per_minute": None})
    app = create_app(settings, engine, limits=LimitRegistry(FakeClock()))
    async with _client(app) as c:
        r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 65}, headers=auth("limited"))
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"  # over the tenant's cap
        r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 64, "n": 7},
                         headers=auth("limited"))
        assert r.status_code == 400 and r.json()["error"]["code"] == "request_too_large"  # 448 > 400/min
        r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 64, "n": 6, "ignore_eos": True},
                         headers=auth("limited"))
        assert r.status_code == 200
        r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 64}, headers=auth("limited"))
        assert r.status_code == 429 and r.json()["error"]["code"] == "tokens_per_minute_exceeded"
        assert int(r.headers["Retry-After"]) >= 1


async def test_concurrency_limit_over_http(engine, tiny_model_dir):  # noqa: F811
    """limited allows one request at a time: a second one while a stream is open gets 429."""
    import asyncio

    app = create_app(make_settings(tiny_model_dir), engine, limits=LimitRegistry(FakeClock()))
    limiter = app.state.limits.for_tenant("limited", app.state.settings.tenants[-1].limits)
    limiter.admit()  # an in-flight request holds the only slot
    async with _client(app) as c:
        r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=auth("limited"))
        assert r.status_code == 429 and r.json()["error"]["code"] == "concurrency_limit_exceeded"
        limiter.release()
        r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=auth("limited"))
        assert r.status_code == 200
        await asyncio.sleep(0)
    assert limiter.in_flight == 0


async def test_refused_after_reservation_refunds_tokens(engine, tiny_model_dir):  # noqa: F811
    """A request refused after its tokens were reserved (here: the fallback cannot be recorded) costs none."""
    settings = make_settings(tiny_model_dir)
    fb = settings.tenants[3]
    fb.limits = settings.limits_default.model_copy(update={"tokens_per_minute": 100})
    app = create_app(settings, engine, fallback_recorders=[Recorder(fail=True)], limits=LimitRegistry(FakeClock()))
    headers = {**auth("enc-fallback"), "X-Cipherlm-Sensitivity": "non-sensitive"}
    async with _client(app) as c:
        for _ in range(3):  # each reserves ~60 of 100 tokens; without the refund the second would be a 429
            r = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 59}, headers=headers)
            assert r.status_code == 503
    limiter = app.state.limits.for_tenant("enc-fallback", fb.limits)
    assert limiter.in_flight == 0
