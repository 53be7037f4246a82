"""The encrypted-session service in-process: the real app (``create_app``), the real router, service,
key registry and worker pool running the real computation, reached through Starlette's TestClient (and
``httpx.ASGITransport`` on the app's loop for concurrent requests), at the smallest real configuration
(``tests/server/private_app.py``: a tiny random model, one 2Quad layer, N = 16384).

What it pins: worker failures are typed by code (a server-side ``ValueError`` is a 500 with a request id,
a malformed ciphertext a 400 ``bad_ciphertext``); key uploads are screened by the production inspector in
a worker; one tenant revoking its copy of another's key leaves the other's session working (issue 12.3);
step retries are checked against the request body and concurrent identical steps share one answer
(issue 12.9).
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from tests.server.app_helpers import tiny_model_dir  # noqa: F401
from tests.server.private_app import LAYER, TinyClient, asgi_client, headers, private_settings, tiny_plan

# ~25 s in all on 2 cores: ~12 s of start-up (worker, bundle, a 151 MB key upload), then 1-4 s per test


@pytest.fixture(scope="module")
def env(tiny_model_dir, tmp_path_factory):  # noqa: F811
    from fastapi.testclient import TestClient

    from engine.loader import load_model
    from server.app import create_app
    from server.private import feature

    model = load_model(tiny_model_dir)
    plan = tiny_plan(model, tmp_path_factory.mktemp("plan"))
    client = TinyClient(model, plan)
    settings = private_settings(tiny_model_dir, plan, tmp_path_factory.mktemp("state"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(feature, "WORKER_FACTORY", "tests.server.private_states:make_state", raising=False)
        app = create_app(settings)
        with TestClient(app, base_url="http://testserver") as http:
            r = http.post("/v1/private/keys/main", content=client.upload, headers=headers("enc-a"))
            assert r.status_code == 201, _why(r)
            assert r.json()["fingerprint"] == client.fingerprint
            yield {"http": http, "app": app, "client": client, "model": model,
                   "plan_hash": http.get("/v1/private/manifest", headers=headers("enc-a")).json()["plan_hash"]}


def _open(env, tenant: str = "enc-a", key_id: str = "main") -> str:
    r = env["http"].post("/v1/private/sessions", json={"key_id": key_id, "plan_hash": env["plan_hash"]},
                         headers=headers(tenant))
    assert r.status_code == 201, _why(r)
    return r.json()["session_id"]


def _step(env, sid: str, body: bytes, tenant: str = "enc-a", request_id: str | None = None):
    return env["http"].post(f"/v1/private/sessions/{sid}/steps", content=body,
                            headers={**headers(tenant, request_id), "Content-Type": "application/octet-stream"})


def _expected(env, x: torch.Tensor) -> torch.Tensor:
    """The plaintext simulator of the same approximated block."""
    from fhe.simulator import finish, simulate_block

    model, plan = env["model"], env["client"].plan
    y, z, _ = simulate_block(model.layers[LAYER], model.rotary, x.double(), torch.arange(len(x)), None,
                             plan.layer(LAYER))
    return finish(y, z)


def _error(r) -> dict:
    return r.json()["error"]


def _why(r) -> str:
    """A response in an assertion message (a result envelope is binary: its size only)."""
    if r.headers.get("content-type", "").startswith("application/json"):
        return f"{r.status_code} {r.text[:300]}"
    return f"{r.status_code} <{len(r.content)} bytes>"


def test_malformed_ciphertext_is_400_bad_ciphertext(env):
    sid = _open(env)
    x = env["client"].layer_input([5, 6])
    for blobs in ((b"garbage" * 64,), (b"CLMC" + bytes(200),)):
        r = _step(env, sid, env["client"].step_body(sid, 0, x[:1], blobs))
        assert r.status_code == 400 and _error(r)["code"] == "bad_ciphertext", _why(r)


def test_server_side_value_error_in_a_worker_is_500_with_a_request_id(env):
    """The worker's computation raises ValueError (a bug, not the client's bytes): 500 naming the request
    id, in the body and the X-Request-Id header; the session is unharmed and the same step then works."""
    sid = _open(env)
    x = env["client"].layer_input([7, 8])
    body = env["client"].step_body(sid, 0, x)
    pool = env["app"].state.private.pool
    for request_id in ("req-privsvc-test-1", None):
        env["http"].portal.call(pool.submit, 0, "test", "arm_bug")
        r = _step(env, sid, body, request_id=request_id)
        assert r.status_code == 500, _why(r)
        err = _error(r)
        assert err["code"] == "internal_error" and err["type"] == "server_error"
        rid = r.headers["x-request-id"]
        assert rid in err["message"] and (request_id is None or rid == request_id)
        assert "broadcast" not in err["message"]  # the worker's exception text stays on the server
    r = _step(env, sid, body)
    assert r.status_code == 200, _why(r)
    assert (env["client"].attention(r.content) - _expected(env, x)).abs().max() < 1e-4


def test_a_repeated_step_must_repeat_the_body(env):
    """Issue 12.9: a retry gets the stored answer only when its bytes are those of the answered step."""
    sid = _open(env)
    c = env["client"]
    x = c.layer_input([9, 10, 11])
    body = c.step_body(sid, 0, x)
    first = _step(env, sid, body)
    assert first.status_code == 200, _why(first)
    assert (c.attention(first.content) - _expected(env, x)).abs().max() < 1e-4
    again = _step(env, sid, body)
    assert again.status_code == 200 and again.content == first.content
    garbage = c.step_body(sid, 0, x, blobs=(b"garbage" * 64,) * 3)
    r = _step(env, sid, garbage)
    assert r.status_code == 409 and _error(r)["code"] == "step_mismatch", _why(r)
    other = c.step_body(sid, 0, x)  # the same values, encrypted afresh: other bytes, also refused
    assert _step(env, sid, other).status_code == 409
    assert _step(env, sid, body).content == first.content  # and the stored answer is still there


def test_two_identical_steps_at_once_get_the_same_answer(env):
    sid = _open(env)
    c = env["client"]
    body = c.step_body(sid, 0, c.layer_input([12, 13]))

    async def both():
        async with asgi_client(env["app"]) as http:
            url = f"/v1/private/sessions/{sid}/steps"
            return await asyncio.gather(*(http.post(url, content=body, headers=headers("enc-a")) for _ in range(2)))

    a, b = env["http"].portal.call(both)
    assert (a.status_code, b.status_code) == (200, 200), (_why(a), _why(b))
    assert a.content == b.content


def test_revoking_a_copy_of_a_key_keeps_its_owners_sessions(env):
    """Issue 12.3: tenant B registers a byte-identical copy of A's public keys (same fingerprint) and
    revokes it; A's open session keeps working (its key set stays loaded in the worker)."""
    http, c = env["http"], env["client"]
    sid_a = _open(env)
    r = http.post("/v1/private/keys/copy", content=c.upload, headers=headers("enc-b"))
    assert r.status_code == 201 and r.json()["fingerprint"] == c.fingerprint, _why(r)
    sid_b = _open(env, "enc-b", "copy")
    r = http.post("/v1/private/keys/copy/revoke", json={}, headers=headers("enc-b"))
    assert r.status_code == 200 and r.json()["state"] == "deactivated", _why(r)
    x = c.layer_input([14, 15])
    r = _step(env, sid_a, c.step_body(sid_a, 0, x))
    assert r.status_code == 200, _why(r)
    assert (c.attention(r.content) - _expected(env, x)).abs().max() < 1e-4
    r = _step(env, sid_b, c.step_body(sid_b, 0, x), tenant="enc-b")
    assert r.status_code == 410 and _error(r)["code"] == "session_closed", _why(r)


def test_key_uploads_are_screened_by_the_production_inspector(env):
    """Through the worker: a secret key beside the public blobs is 403, garbage is 400, both audited."""
    from fhe.backends.seal import hazmat as seal
    from tests.server.test_keys_secret_upload import _pack_any

    c, http = env["client"], env["http"]
    from fhe.backends.seal import wire

    with_secret = _pack_any({**wire.dump_public_keys(c.ckks), "sk": seal.to_bytes(c.ckks.keys.secret)})
    r = http.post("/v1/private/keys/leak", content=with_secret, headers=headers("enc-a"))
    assert r.status_code == 403 and _error(r)["code"] == "secret_key_refused", _why(r)
    r = http.post("/v1/private/keys/junk", content=b"CLMK" + bytes(100), headers=headers("enc-a"))
    assert r.status_code == 400 and _error(r)["code"] == "malformed_key", _why(r)
    keys = http.get("/v1/private/keys", headers=headers("enc-a")).json()["data"]
    assert [k["key_id"] for k in keys] == ["main"]


def test_a_packed_prefill_step_answers_one_result_per_position(env):
    """Issue 15: the prompt goes up as one ciphertext per chunk (kind ``packed``), the answer is one
    ciphertext per position, and the next step is an ordinary decode step on the cache it filled."""
    from fhe.envelope import parse

    c = env["client"]
    chunk = env["http"].get("/v1/private/manifest", headers=headers("enc-a")).json()["limits"]["packed_chunk"]
    assert chunk == c.block.geo.packed_chunk > 3
    sid = _open(env)
    x = c.layer_input([5, 9, 2, 7])
    r = _step(env, sid, c.packed_body(sid, 0, x[:3]))
    assert r.status_code == 200, _why(r)
    assert len(parse(r.content, 1 << 30, 1 << 34).blobs) == 3
    want = _expected(env, x)
    assert (c.attention(r.content) - want[:3]).abs().max().item() <= 1e-3
    r = _step(env, sid, c.step_body(sid, 3, x[3:]))
    assert r.status_code == 200, _why(r)
    assert (c.attention(r.content) - want[3:]).abs().max().item() <= 1e-3


def test_bad_packed_steps_are_400_bad_step(env):
    c = env["client"]
    sid = _open(env)
    x = c.layer_input([5, 9, 2])
    one = c.packed_body(sid, 0, x)
    blob = parse_blobs(one)
    for body in (c.packed_body(sid, 0, x, blobs=blob + blob),      # two ciphertexts for 3 positions
                 c.packed_body(sid, 1, x)):                         # not on a block boundary
        r = _step(env, sid, body)
        assert r.status_code == 400 and _error(r)["code"] == "bad_step", _why(r)
    assert _step(env, sid, one).status_code == 200                  # the session was not disturbed


def parse_blobs(body: bytes) -> tuple[bytes, ...]:
    from fhe.envelope import parse

    return parse(body, 1 << 30, 1 << 34).blobs
