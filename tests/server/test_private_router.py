"""``/v1/private`` refuses what it can from the headers before reading a body: plaintext-mode tenants,
unknown sessions, declared sizes over the endpoint's own cap, tenants over their limits, new work while
draining; bodies without a Content-Length are streamed and cut at the cap.

The real app (``create_app`` with the tiny engine and the encrypted-session service on a tiny plan) is
driven in process through ``httpx.ASGITransport``, whose request bodies are pulled chunk by chunk as the
app reads them, so :class:`Body` counts exactly how much of a body the server read.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from server.app import create_app
from server.audit import Event, iter_records
from server.limits import LimitRegistry
from server.settings import LimitSettings, Settings, TenantSettings
from server.tenants import hash_api_key
from tests.server.app_helpers import engine, tiny_loaded, tiny_model_dir  # noqa: F401 (fixtures)
from tests.server.private_helpers import private_settings, tiny_plan

KEYS = {"enc": "clm-router-enc", "plain": "clm-router-plain", "enc-limited": "clm-router-limited"}
MB = 1 << 20
STEPS = "/v1/private/sessions/ps_doesnotexist/steps"
PLAN_HASH = "0" * 64


class Body:
    """A lazily generated body of ``size`` bytes in 1 MB chunks; ``sent`` counts what was pulled."""

    def __init__(self, size: int) -> None:
        self.size, self.sent = size, 0

    async def __aiter__(self):
        while self.sent < self.size:
            chunk = b"\0" * min(MB, self.size - self.sent)
            self.sent += len(chunk)
            yield chunk


@pytest.fixture(scope="module")
def plan(tiny_model_dir, tmp_path_factory):  # noqa: F811
    return tiny_plan(tiny_model_dir, tmp_path_factory.mktemp("plan") / "tiny.plan.json")


@pytest.fixture()
async def client(engine, tiny_model_dir, plan, tmp_path):  # noqa: F811
    """An httpx client on the app, its lifespan running (no worker started: none is needed here)."""
    limited = LimitSettings(requests_per_minute=2, max_concurrent=1, steps_per_minute=3)
    tenants = [TenantSettings(id="enc", api_key_hashes=[hash_api_key(KEYS["enc"])], privacy_mode="encrypted"),
               TenantSettings(id="plain", api_key_hashes=[hash_api_key(KEYS["plain"])]),
               TenantSettings(id="enc-limited", api_key_hashes=[hash_api_key(KEYS["enc-limited"])],
                              privacy_mode="encrypted", limits=limited)]
    settings = Settings(model=str(tiny_model_dir), served_model_name="tiny", server_secret="s", tenants=tenants,
                        private=private_settings(plan, tmp_path / "state", max_key_bytes=4 * MB))
    app = create_app(settings, engine, limits=LimitRegistry(lambda: 1000.0))   # frozen: no bucket refills
    async with app.router.lifespan_context(app):
        assert app.state.private is not None and app.state.private.pool.running() == []
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            http.app = app
            yield http


def auth(tenant: str, **headers) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[tenant]}", **headers}


def code(r: httpx.Response) -> str:
    return r.json()["error"]["code"]


async def test_plaintext_tenants_cannot_use_the_private_endpoints(client):
    for method, path in (("GET", "/v1/private/manifest"), ("GET", "/v1/private/bundle"),
                         ("POST", "/v1/private/keys/k1"), ("POST", STEPS)):
        body = Body(1000)
        r = await client.request(method, path, headers=auth("plain"), content=body if method == "POST" else None)
        assert r.status_code == 403 and code(r) == "privacy_mode_plaintext", (path, r.text)
        assert body.sent == 0
    r = await client.post("/v1/private/sessions", headers=auth("plain"), json={"key_id": "k", "plan_hash": PLAN_HASH})
    assert r.status_code == 403
    assert (await client.get("/v1/private/manifest", headers=auth("enc"))).status_code == 200


async def test_300_mb_step_to_an_unknown_session_is_refused_unread(client):
    declared = Body(300 * MB)
    r = await client.post(STEPS, headers=auth("enc", **{"Content-Length": str(declared.size)}), content=declared)
    assert r.status_code == 413 and declared.sent == 0     # over the step cap (64 KB here), not the key cap
    chunked = Body(300 * MB)                                 # no Content-Length at all
    r = await client.post(STEPS, headers=auth("enc"), content=chunked)
    assert r.status_code == 404 and code(r) == "session_not_found" and chunked.sent == 0


async def test_the_step_cap_is_the_step_limit_not_the_key_upload_limit(client):
    cfg = client.app.state.settings.private
    size = cfg.max_step_bytes + 1   # far below max_key_bytes: the old shared limit let it through
    assert size < cfg.max_key_bytes
    body = Body(size)
    r = await client.post(STEPS, headers=auth("enc", **{"Content-Length": str(size)}), content=body)
    assert r.status_code == 413 and body.sent == 0


async def test_key_upload_without_content_length_is_cut_at_its_cap(client):
    body = Body(300 * MB)
    r = await client.post("/v1/private/keys/k1", headers=auth("enc"), content=body)
    assert r.status_code == 413
    assert body.sent <= 4 * MB + MB, f"read {body.sent} bytes of a body refused at 4 MB"
    declared = Body(300 * MB)
    r = await client.post("/v1/private/keys/k1", headers=auth("enc", **{"Content-Length": str(declared.size)}),
                          content=declared)
    assert r.status_code == 413 and declared.sent == 0
    # the tenant's upload cut mid-stream is audited; the declared one was refused before authentication
    log = Path(client.app.state.settings.private.state_dir) / "audit" / "audit.log"
    refused = [r for r in iter_records(log) if r["event"] == Event.KEY_UPLOAD_REFUSED]
    assert [(r["detail"]["reason"], r["detail"]["size"], r["key_id"]) for r in refused] == [
        ("too_large", 4 * MB + 1, "k1")]


async def test_tenant_limits_apply_to_private_calls(client):
    opened = [await client.post("/v1/private/sessions", headers=auth("enc-limited"),
                                json={"key_id": "none", "plan_hash": PLAN_HASH}) for _ in range(3)]
    assert [r.status_code for r in opened[:2]] == [409, 409]         # plan mismatch, after admission
    assert opened[2].status_code == 429 and code(opened[2]) == "requests_per_minute_exceeded"
    assert "retry-after" in opened[2].headers
    body = Body(1000)
    r = await client.post("/v1/private/keys/k1", headers=auth("enc-limited"), content=body)
    assert r.status_code == 429 and body.sent == 0


@pytest.fixture()
def open_steps(client, monkeypatch):
    """The service answers every step of session ``ps_open`` at once (no worker: only admission is tested)."""
    svc = client.app.state.private

    async def step(tenant, sid, body, *, request_id=None, times=None, digest=None):
        return b"result"

    monkeypatch.setattr(svc, "session_for", lambda tenant, sid: None)
    monkeypatch.setattr(svc, "step", step)
    return "/v1/private/sessions/ps_open/steps"


async def test_an_offload_generation_is_not_throttled_by_requests_per_minute(client, open_steps):
    """Issue 17 (session 10): the 28-layer offload plan sends 4 steps per server layer per token, 112 a token;
    counted as requests, the default 600 a minute let ~8 tokens through at GPU speed and then held the
    client to 10 steps a second (11 s a token). Steps of open sessions are metered by ``steps_per_minute``."""
    for n in range(6 * 28 * 4):   # six tokens' steps inside one (frozen) minute: over 600
        r = await client.post(open_steps, headers=auth("enc"), content=b"x")
        assert r.status_code == 200, (n, r.text)


async def test_steps_per_minute_limits_a_tenants_steps_apart_from_its_requests(client, open_steps):
    opened = [await client.post("/v1/private/sessions", headers=auth("enc-limited"),
                                json={"key_id": "none", "plan_hash": PLAN_HASH}) for _ in range(2)]
    assert [r.status_code for r in opened] == [409, 409]           # requests/min (2) spent
    steps = [await client.post(open_steps, headers=auth("enc-limited"), content=b"x") for _ in range(4)]
    assert [r.status_code for r in steps] == [200, 200, 200, 429]  # steps/min (3) is its own budget
    assert code(steps[3]) == "steps_per_minute_exceeded" and steps[3].headers["retry-after"] == "20"
    metrics = (await client.get("/metrics")).text
    assert 'cipherlm:rate_limited_total{limit="steps_per_minute_exceeded",tenant="enc-limited"} 1.0' in metrics


async def test_draining_refuses_new_keys_and_sessions(client):
    client.app.state.lifecycle.draining = True
    r = await client.post("/v1/private/sessions", headers=auth("enc"), json={"key_id": "k", "plan_hash": PLAN_HASH})
    assert r.status_code == 503 and code(r) == "server_draining" and r.headers["Retry-After"] == "1"
    body = Body(1000)
    r = await client.post("/v1/private/keys/k1", headers=auth("enc"), content=body)
    assert r.status_code == 503 and body.sent == 0
