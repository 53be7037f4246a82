"""The encrypted-session service end to end with its workers as Ray actors, against the local pool.

The real app, router, service, key registry and the real computation (a tiny random model, one 2Quad
layer, N = 16384: ``tests/server/private_app.py``), once with ``backend = "local"`` and once with
``backend = "ray"`` on a Ray head on 127.0.0.1. What it pins (issue 20): the same step gives the same
result ciphertext bytes through either backend (so the client decodes the same tokens); an actor killed
mid-step is a 503 ``session_lost`` (the SDK's replay signal), never a wrong answer; a replay on a new
session gives the local backend's bytes again; the server keeps serving.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

ray = pytest.importorskip("ray")

from tests.server.app_helpers import tiny_model_dir  # noqa: E402,F401
from tests.server.private_app import TinyClient, headers, private_settings, tiny_plan  # noqa: E402

pytestmark = pytest.mark.slow  # ~40 s on 2 cores: two app start-ups, a Ray head, two 158 MB key uploads


@pytest.fixture(scope="module")
def cluster():
    ray.init(address="local", num_cpus=2, _node_ip_address="127.0.0.1", include_dashboard=False,
             log_to_driver=False, namespace="cipherlm-test")
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def world(tiny_model_dir, tmp_path_factory):  # noqa: F811
    """The tiny model, its plan, one client key set and one fixed set of input ciphertexts."""
    from engine.loader import load_model
    from fhe.backends.seal import wire

    model = load_model(tiny_model_dir)
    plan = tiny_plan(model, tmp_path_factory.mktemp("plan"))
    client = TinyClient(model, plan)
    x = client.layer_input([5, 6, 7])
    blobs = tuple(wire.encrypt_to_wire(client.ckks, client.block.layout_input(row)) for row in x)
    return {"dir": tiny_model_dir, "plan": plan, "client": client, "x": x, "blobs": blobs,
            "tmp": tmp_path_factory}


def _app(world, backend: str):
    """A started app (TestClient) with the given worker backend and the pausable real state."""
    from fastapi.testclient import TestClient

    from server.app import create_app
    from server.private import feature

    settings = private_settings(world["dir"], world["plan"], world["tmp"].mktemp(backend), backend=backend,
                                ray={"num_cpus": 1.0})
    mp = pytest.MonkeyPatch()
    mp.setattr(feature, "WORKER_FACTORY", "tests.server.ray_states:make_state")
    http = TestClient(create_app(settings), base_url="http://testserver")
    http.__enter__()
    r = http.post("/v1/private/keys/main", content=world["client"].upload, headers=headers("enc-a"))
    assert r.status_code == 201, r.text
    http.plan_hash = http.get("/v1/private/manifest", headers=headers("enc-a")).json()["plan_hash"]
    return http, mp


def _open(http) -> str:
    r = http.post("/v1/private/sessions", json={"key_id": "main", "plan_hash": http.plan_hash},
                  headers=headers("enc-a"))
    assert r.status_code == 201, r.text
    return r.json()["session_id"]


def _step(http, world, sid: str, start: int, count: int):
    c = world["client"]
    body = c.step_body(sid, start, world["x"][start:start + count], world["blobs"][start:start + count])
    return http.post(f"/v1/private/sessions/{sid}/steps", content=body,
                     headers={**headers("enc-a"), "Content-Type": "application/octet-stream"})


def _results(http, world, sid: str) -> list[bytes]:
    """A prefill of two positions then a decode of the third: the result blobs of both steps."""
    from fhe.envelope import parse

    out = []
    for start, count in ((0, 2), (2, 1)):
        r = _step(http, world, sid, start, count)
        assert r.status_code == 200, r.text
        out.extend(parse(r.content, 1 << 30, 1 << 34).blobs)
    return out


@pytest.fixture(scope="module")
def local_results(world):
    http, mp = _app(world, "local")
    try:
        return _results(http, world, _open(http))
    finally:
        http.__exit__(None, None, None)
        mp.undo()


@pytest.fixture(scope="module")
def ray_app(cluster, world, local_results):  # after the local run: one app's workers at a time
    http, mp = _app(world, "ray")
    yield http
    http.__exit__(None, None, None)
    mp.undo()


def test_ray_backend_gives_the_local_backends_bytes(ray_app, world, local_results):
    from server.private.ray_backend import RayWorkerPool

    pool = ray_app.app.state.private.pool
    assert isinstance(pool, RayWorkerPool) and pool.pids()[0] != os.getpid()
    assert _results(ray_app, world, _open(ray_app)) == local_results
    metrics = ray_app.get("/metrics").text
    assert 'cipherlm:private_workers_running{backend="ray"} 1.0' in metrics
    assert 'cipherlm:private_worker_open_sessions{worker="0"}' in metrics


def test_actor_killed_mid_step_is_session_lost_then_replay_matches(ray_app, world, local_results):
    svc = ray_app.app.state.private
    sid = _open(ray_app)
    worker = svc.sessions.get(sid).worker
    ray_app.portal.call(svc.pool.submit, worker, "test", "arm_pause", 8.0)
    answer = {}
    t = threading.Thread(target=lambda: answer.setdefault("r", _step(ray_app, world, sid, 0, 2)))
    t.start()
    time.sleep(3.0)  # the step is inside the actor now (paused before its evaluation)
    os.kill(svc.pool.pids()[0], signal.SIGKILL)
    t.join(120)
    r = answer["r"]
    assert r.status_code == 503 and r.json()["error"]["code"] == "session_lost", r.text
    r = _step(ray_app, world, sid, 0, 2)  # the session's state died with the actor: told, not recomputed
    assert r.status_code in (410, 503) and r.json()["error"]["code"] == "session_lost", r.text
    # the SDK's replay: a new session (the key set is loaded again into the replacement actor)
    assert _results(ray_app, world, _open(ray_app)) == local_results
    assert ray_app.get("/health/ready").status_code == 200
