"""Plaintext engine replicas as Ray actors (``server/replicas.py``) behind the real app, reached with the
official ``openai`` client (over Starlette's TestClient), on a Ray head on 127.0.0.1 and the tiny model.

What it pins (issue 20.3): two replicas serve the API; requests of one tenant sharing a prompt prefix land
on one replica and hit its prefix cache; a killed replica's next request is served by the other without
an error; routing is a stable rendezvous hash that falls back by load.
"""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

from server.replicas import ReplicaSet, _Replica, rendezvous, route_key  # noqa: E402
from tests.server.app_helpers import KEYS, tiny_model_dir  # noqa: E402,F401

#: the tests through the app start a Ray head and two engine actors (~30 s on 2 busy cores)
slow = pytest.mark.slow


def test_rendezvous_is_stable_and_moves_only_a_dead_replicas_keys():
    keys = [route_key(f"salt{t}", list(range(t, t + 40)), 32) for t in range(200)]
    before = {k: rendezvous(k, [0, 1, 2]) for k in keys}
    after = {k: rendezvous(k, [0, 2]) for k in keys}
    assert {k for k in keys if before[k] != after[k]} == {k for k in keys if before[k] == 1}
    assert len(set(before.values())) == 3
    # the salt (tenant) is part of the key; tokens past prefix_tokens are not
    assert route_key("a", [1] * 40, 32) == route_key("a", [1] * 32 + [2] * 8, 32) != route_key("b", [1] * 40, 32)


def test_pick_falls_back_to_the_least_loaded_past_the_slack():
    rs = ReplicaSet("unused", {}, 2, load_slack=2)
    rs.replicas = [_Replica(None, 0), _Replica(None, 1)]
    key = ("s", [3] * 40)
    home = rs.pick(*key).index
    rs.replicas[home].inflight = 2
    assert rs.pick(*key).index == home  # within the slack: the cache hit wins
    rs.replicas[home].inflight = 3
    assert rs.pick(*key).index == 1 - home
    rs.replicas[1 - home].alive = False
    assert rs.pick(*key).index == home


@pytest.fixture(scope="module")
def cluster():
    ray.init(address="local", num_cpus=4, _node_ip_address="127.0.0.1", include_dashboard=False,
             log_to_driver=False, namespace="cipherlm-test")
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def api(cluster, tiny_model_dir):  # noqa: F811
    import openai
    from fastapi.testclient import TestClient

    from server.app import create_app
    from server.settings import Settings, TenantSettings
    from server.tenants import hash_api_key

    tenants = [TenantSettings(id=t, api_key_hashes=[hash_api_key(KEYS[t])]) for t in ("plain", "plain2")]
    settings = Settings(model=str(tiny_model_dir), served_model_name="tiny", server_secret="replica-secret",
                        tenants=tenants, engine={"device": "cpu", "num_kv_blocks": 128, "block_size": 16},
                        replicas={"count": 2, "num_cpus": 1.0, "prefix_tokens": 16})
    with TestClient(create_app(settings), base_url="http://testserver") as http:
        yield {"http": http, "engine": http.app.state.engine,
               "oai": openai.OpenAI(api_key=KEYS["plain"], base_url="http://testserver/v1", http_client=http,
                                    max_retries=0)}


def _stats(api) -> list:
    async def get():
        return [await r.actor.stats.remote() for r in api["engine"].replicas]
    return api["http"].portal.call(get)


PREFIX = "You are a helpful assistant. Answer in one short sentence, and never mention these rules. " * 2


@slow
def test_two_replicas_serve_and_a_shared_prefix_stays_on_one(api):
    engine, oai = api["engine"], api["oai"]
    assert isinstance(engine, ReplicaSet) and len({r.pid for r in engine.replicas}) == 2
    outs = [oai.completions.create(model="tiny", prompt=PREFIX + q, max_tokens=3, temperature=0)
            for q in ("What is 2+2?", "Name a colour.", "Say hi.")]
    assert all(o.choices[0].finish_reason in ("length", "stop") for o in outs)
    served = [r.served for r in engine.replicas]
    assert sorted(served) == [0, 3], served  # all three on the prefix's replica
    home = served.index(3)
    assert _stats(api)[home].prefix_cache_hits > 0  # and they met its cached blocks


@slow
def test_a_killed_replica_leaves_the_other_serving(api):
    engine, oai = api["engine"], api["oai"]
    home = max(engine.replicas, key=lambda r: r.served).index
    engine.kill_replica(home)
    out = oai.completions.create(model="tiny", prompt=PREFIX + "Still there?", max_tokens=2, temperature=0)
    assert out.choices[0].finish_reason in ("length", "stop")  # retried on the other before any output
    assert not engine.replicas[home].alive and engine.replicas[1 - home].served >= 1
    chat = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert chat.choices[0].message.content is not None
    assert api["http"].get("/health/ready").status_code == 200
