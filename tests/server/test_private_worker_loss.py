"""The worker lifecycle seen through the encrypted-session API, on real parts: a tiny plan, real SEAL keys
(N = 16384), a real worker process started by the first key upload.

* a worker killed while idle loses its sessions as ``session_lost`` (which the SDK replays), never as the
  client's ``bad_ciphertext``; the pool replaces it;
* a step body with no Content-Length is cut at ``max_step_bytes`` for a real session;
* a worker stopped for idleness is started again, and the key reloaded, by the next session;
* ``max_keys_per_worker`` bounds the keys a worker holds: a key beyond every worker's bound waits (429
  ``worker_keys_full``) while the loaded keys have open sessions, and gets a worker — the idle key dropped
  there — once one of them closes.
"""

from __future__ import annotations

import asyncio
import os
import signal

import httpx
import pytest

from fhe.envelope import Envelope
from server.app import create_app
from server.settings import Settings, TenantSettings
from server.tenants import hash_api_key
from tests.server.app_helpers import engine, tiny_loaded, tiny_model_dir  # noqa: F401 (fixtures)
from tests.server.private_helpers import private_settings, tiny_key_upload, tiny_plan
from tests.server.test_private_router import Body
from tests.server.test_worker_lifecycle import until

pytestmark = pytest.mark.slow  # ~10 s of key generation and a worker start on 2 busy cores

KEY = "clm-worker-loss-enc"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def plan(tiny_model_dir, tmp_path_factory):  # noqa: F811
    return tiny_plan(tiny_model_dir, tmp_path_factory.mktemp("plan") / "tiny.plan.json")


@pytest.fixture(scope="module")
def upload(tiny_model_dir):  # noqa: F811
    return tiny_key_upload(tiny_model_dir)


@pytest.fixture()
async def http(request, engine, tiny_model_dir, plan, tmp_path):  # noqa: F811
    """The app with one worker, or with the ``[private]`` overrides a test passes as the indirect param."""
    overrides = {"worker_idle_s": 1.0, **getattr(request, "param", {})}
    tenants = [TenantSettings(id="enc", api_key_hashes=[hash_api_key(KEY)], privacy_mode="encrypted")]
    settings = Settings(model=str(tiny_model_dir), served_model_name="tiny", server_secret="s", tenants=tenants,
                        private=private_settings(plan, tmp_path / "state", **overrides))
    app = create_app(settings, engine)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                     headers=AUTH, timeout=120) as client:
            client.svc = app.state.private
            yield client


async def open_session(http: httpx.AsyncClient, key_id: str = "k1") -> dict:
    r = await try_open(http, key_id)
    assert r.status_code == 201, r.text
    return r.json()


async def try_open(http: httpx.AsyncClient, key_id: str) -> httpx.Response:
    plan_hash = (await http.get("/v1/private/manifest")).json()["plan_hash"]
    return await http.post("/v1/private/sessions", json={"key_id": key_id, "plan_hash": plan_hash})


def step_body(session: dict, layer: int = 1) -> bytes:
    """A well-formed one-position step envelope (its ciphertext never reaches a worker in these tests)."""
    return Envelope(session["session_id"], session["key_fingerprint"], layer, "prefill", (0, 1),
                    (b"\0" * 64,)).to_bytes()


async def test_worker_killed_while_idle_gives_session_lost_and_is_replaced(http, upload):
    assert http.svc.pool.running() == []
    assert (await http.post("/v1/private/keys/k1", content=upload)).status_code == 201
    session = await open_session(http)
    [pid] = http.svc.pool.pids()

    body = Body(http.svc.cfg.max_step_bytes * 4)   # no Content-Length: cut at the cap while streaming
    r = await http.post(f"/v1/private/sessions/{session['session_id']}/steps", content=body)
    assert r.status_code == 413 and body.sent <= http.svc.cfg.max_step_bytes + (1 << 20)

    os.kill(pid, signal.SIGKILL)
    await until(lambda: http.svc.pool.restarts == 1, 5)  # noticed with no task queued (the sentinel)
    r = await http.post(f"/v1/private/sessions/{session['session_id']}/steps", content=step_body(session))
    assert r.status_code == 410 and r.json()["error"]["code"] == "session_lost", r.text  # not bad_ciphertext
    await until(lambda: len(http.svc.pool.pids()) == 1, 60)   # replaced: its clients are about to replay
    assert http.svc.pool.pids() != [pid]


async def test_idle_worker_stops_and_the_next_session_starts_it_with_the_key(http, upload):
    assert (await http.post("/v1/private/keys/k1", content=upload)).status_code == 201
    session = await open_session(http)
    await asyncio.sleep(1.5)
    assert len(http.svc.pool.pids()) == 1        # an open session keeps its worker
    r = await http.delete(f"/v1/private/sessions/{session['session_id']}")
    assert r.status_code == 204
    await until(lambda: http.svc.pool.running() == [], 10)
    again = await open_session(http)             # a new process, the key loaded into it again
    assert again["key_fingerprint"] == session["key_fingerprint"] and len(http.svc.pool.pids()) == 1


@pytest.mark.parametrize("http", [{"workers": 2, "max_keys_per_worker": 1, "worker_idle_s": 60.0}], indirect=True)
async def test_a_key_beyond_every_workers_bound_waits_until_one_is_idle(http, upload, tiny_model_dir):  # noqa: F811
    second, third = (tiny_key_upload(tiny_model_dir, fresh=True) for _ in range(2))   # three distinct keys
    for key_id, body in (("k1", upload), ("k2", second), ("k3", third)):
        assert (await http.post(f"/v1/private/keys/{key_id}", content=body)).status_code == 201
    first, other = await open_session(http, "k1"), await open_session(http, "k2")
    assert len(http.svc.pool.pids()) == 2                    # one key per worker
    r = await try_open(http, "k3")
    assert r.status_code == 429 and r.json()["error"]["code"] == "worker_keys_full", r.text
    assert r.headers["retry-after"] == "5"
    assert (await http.delete(f"/v1/private/sessions/{first['session_id']}")).status_code == 204
    await open_session(http, "k3")                           # k1 was idle: dropped from its worker
    r = await try_open(http, "k1")
    assert r.status_code == 429, r.text                      # both workers' keys are in use again
    assert (await http.delete(f"/v1/private/sessions/{other['session_id']}")).status_code == 204
    await open_session(http, "k1")
