"""Where the service places a new encrypted session (``PrivateService._pick_worker``), on the real service,
registry and audit log over an unstarted three-slot pool (placement reads only the pool's queue lengths)."""

from __future__ import annotations

import secrets

import pytest

from server.keys import EvalKeyStorage, KeyRegistry, RegistryConfig
from server.private.config import PrivateSettings
from server.private.feature import open_audit
from server.private.service import PrivateService
from server.private.sessions import Session
from server.private.workers import WorkerPool


@pytest.fixture()
def service(tmp_path):
    def make(**cfg) -> PrivateService:
        audit = open_audit(tmp_path / "audit", secrets.token_bytes(32), 64)
        registry = KeyRegistry(RegistryConfig(state_path=tmp_path / "registry.json"), audit,
                               EvalKeyStorage(tmp_path / "material", secrets.token_bytes(32)))
        pool = WorkerPool(3, "tests.server.worker_states:make_probe", ("t",))
        return PrivateService(PrivateSettings(workers=3, **cfg), "plan", (1,), pool, registry, audit)
    return make


def _hold(svc: PrivateService, worker: int, fp: str, sessions: int) -> None:
    """Worker ``worker`` holds key set ``fp`` with ``sessions`` open sessions on it."""
    svc._loaded[(worker, fp)] = {("t", "k", 1)}
    for _ in range(sessions):
        s = Session(svc.sessions.new_id(), "t", "k", 1, fp, worker, 0.0, 0.0)
        svc.sessions.add(s)


def test_a_holder_is_preferred_until_it_is_crowded(service):
    svc = service(spill_sessions=3, max_keys_per_worker=1)
    _hold(svc, 1, "hot", 2)
    assert svc._pick_worker("hot") == 1  # the key is there: no upload
    _hold(svc, 1, "hot", 1)  # three open sessions now
    assert svc._pick_worker("hot") in (0, 2)  # a second copy where there is room


def test_a_crowded_holder_is_still_used_when_no_worker_has_room(service):
    svc = service(spill_sessions=1, max_keys_per_worker=1)
    _hold(svc, 0, "hot", 2)
    _hold(svc, 1, "b", 1)
    _hold(svc, 2, "c", 1)
    assert svc._pick_worker("hot") == 0  # queueing behind it beats evicting nothing (no idle key)


def test_spill_off_keeps_pure_affinity(service):
    svc = service(spill_sessions=None)
    _hold(svc, 2, "hot", 50)
    assert svc._pick_worker("hot") == 2


def test_among_equals_the_worker_with_fewer_open_sessions_wins(service):
    svc = service(max_keys_per_worker=2)
    _hold(svc, 0, "a", 2)
    _hold(svc, 1, "b", 1)
    _hold(svc, 2, "c", 2)
    assert svc._pick_worker("new") == 1  # all have room; no task is pending anywhere


def test_offload_key_sets_count_toward_the_key_limit(service):
    import asyncio

    from server.errors import RateLimitError

    svc = service(max_keys_per_worker=2)
    _hold(svc, 0, "att", 1)                        # one session's attention key ...
    svc._loaded[(0, "off")] = {("t", "k.mlp", 1)}
    svc.sessions.on_worker(0)[0].mlp_fingerprint = "off"   # ... and its offload key: worker 0 is full
    assert sorted(svc._keys_in(0)) == ["att", "off"]
    with pytest.raises(RateLimitError):
        asyncio.run(svc._make_room(0, "t"))
    _hold(svc, 1, "b", 1)                          # one key of two, in use
    _hold(svc, 2, "c", 0)
    _hold(svc, 2, "d", 0)                          # two idle keys: evictable
    assert svc._pick_worker("new") == 1            # room for one key set
    assert svc._pick_worker("new", need=2) == 2    # an attention + offload session: make room where idle


@pytest.mark.parametrize(("device", "batched"), [("cpu", False), ("cpu-reference", True)])
def test_linear_steps_go_to_the_pool_with_a_batch_key_on_the_gpu_backend(service, device, batched):
    import asyncio

    from fhe import envelope

    svc, calls = service(device=device), []

    async def submit(worker, tenant, method, *args, batch=None, timeout=None, stages=None):
        calls.append((method, batch))
        return [b"out"]

    svc.pool.submit = submit
    s = Session(svc.sessions.new_id(), "t", None, 1, None, 0, 0.0, 0.0, mlp_fingerprint="off")
    env = envelope.Envelope(s.id, "off", 3, "decode", (5, 1), (b"x",), "seal", "p", "mlp_up")
    asyncio.run(svc._run_mlp(s, env, "req"))
    assert calls == [("mlp_step", ("mlp_step", 3, "mlp_up", False) if batched else None)]
