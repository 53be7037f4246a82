"""Key registration on the server: what a session's first key upload costs, step by step and as a client sees it.

    flock /tmp/cipherlm-bench.lock nice python bench/key_registration.py [--json out.json]

The e2e tests' geometry: the default plan's first layer at N = 16384, level-aware keys (what the encrypted
end-to-end tests and the SDK upload). Two parts, one client key set:

* ``worker``: one :class:`server.private.compute.PrivateCompute` in this process. ``inspect_key`` (parse +
  allow-list + canonical re-serialization), ``load_key`` of those canonical bytes in a fresh worker (a
  second parse) and the load right after ``inspect_key`` in the same worker (``load_screened_key``; before
  it existed, ``load_key`` of the canonical bytes) (medians of ``--repeats``);
* ``service``: the real app (``create_app``, one worker process) through Starlette's TestClient: the key
  upload (``POST /v1/private/keys/{id}``: inspection in the worker, the canonical bytes back, the registry's
  encrypted store) and the first session on it (``POST /v1/private/sessions``: the key set loaded into the
  worker), once each, after a junk upload has started the worker. Runs on a checkout without
  ``load_screened_key`` too (``PYTHONPATH=<that checkout>``): the before/after comparison.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from engine.default_model import default_model_dir
from fhe.backends.seal import wire
from fhe.backends.seal.keys import CKKSClient
from fhe.envelope import pack_key_upload
from fhe.params import CKKSParams
from fhe.plan import Plan
from server.private.feature import default_plan_path

API_KEY = "clm-bench-keyreg-0000000000000"


def _plan(folder: Path) -> str:
    full = Plan.load(default_plan_path())
    ckks = CKKSParams(16384, (48,) + (30,) * 11 + (60,), 30).to_dict()
    plan = Plan(full.model_id, full.weights_sha256, (full.layers[0],), ckks, "key registration bench",
                full.calibration)
    return str(plan.save(folder / "one-layer.plan.json"))


def _median(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def worker_part(model_dir: str, plan: str, repeats: int) -> tuple[dict, CKKSClient, bytes]:
    from server.private.compute import PrivateCompute

    state = PrivateCompute(model_dir, plan, 48)
    t = time.perf_counter()
    client = CKKSClient(state.params, state.key_levels.steps, levels=state.key_levels)
    keygen = time.perf_counter() - t
    upload = pack_key_upload(wire.dump_public_keys(client))
    verdict = state.inspect_key(upload)
    inspect = _median(lambda: state.inspect_key(upload), repeats)
    fresh = PrivateCompute(model_dir, plan, 48)
    load_fresh = _median(lambda: fresh.load_key("fp", verdict.canonical, verdict.key_set), repeats)
    state.inspect_key(upload)
    t = time.perf_counter()
    if hasattr(state, "load_screened_key"):   # the worker that screened the upload keeps what it parsed
        assert state.load_screened_key("fp", hashlib.sha256(verdict.canonical).hexdigest(), verdict.key_set)
    else:                                     # before: the stored bytes parsed again
        state.load_key("fp", verdict.canonical, verdict.key_set)
    load_after = time.perf_counter() - t
    return ({"upload_bytes": len(upload), "canonical_bytes": len(verdict.canonical), "keygen_s": keygen,
             "inspect_key_s": inspect, "load_key_fresh_s": load_fresh, "load_key_after_inspect_s": load_after},
            client, upload)


def service_part(model_dir: str, plan: str, upload: bytes, state_dir: Path, profile: bool = False) -> dict:
    from fastapi.testclient import TestClient

    from server.app import create_app
    from server.private.config import PrivateSettings
    from server.settings import Settings, TenantSettings
    from server.tenants import hash_api_key

    tenants = [TenantSettings(id="enc", api_key_hashes=[hash_api_key(API_KEY)], privacy_mode="encrypted")]
    private = PrivateSettings(enabled=True, workers=1, min_workers=1, plan=plan, state_dir=str(state_dir),
                              max_session_tokens=48, max_keys_per_worker=1)
    settings = Settings(model=model_dir, server_secret="keyreg-bench-secret", tenants=tenants, private=private,
                        engine={"device": "cpu", "num_kv_blocks": 16})
    auth = {"Authorization": f"Bearer {API_KEY}"}
    with TestClient(create_app(settings), base_url="http://testserver") as http:
        plan_hash = http.get("/v1/private/manifest", headers=auth).json()["plan_hash"]
        r = http.post("/v1/private/keys/junk", content=b"CLMK" + bytes(100), headers=auth)   # the worker is up
        assert r.status_code == 400, r.text
        if profile:
            import cProfile
            import pstats

            prof = cProfile.Profile()
            prof.enable()
        t = time.perf_counter()
        r = http.post("/v1/private/keys/bench", content=upload, headers=auth)
        register = time.perf_counter() - t
        assert r.status_code == 201, r.text
        if profile:
            prof.disable()
            pstats.Stats(prof).sort_stats("cumulative").print_stats(40)
        t = time.perf_counter()
        r = http.post("/v1/private/sessions", json={"key_id": "bench", "plan_hash": plan_hash}, headers=auth)
        first_session = time.perf_counter() - t
        assert r.status_code == 201, r.text
    return {"register_s": register, "first_session_s": first_session, "setup_s": register + first_session}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-worker", action="store_true", help="the service part only")
    ap.add_argument("--profile", action="store_true", help="cProfile of this process during the key upload")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model_dir = str(default_model_dir())
    out: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    with tempfile.TemporaryDirectory() as tmp:
        plan = _plan(Path(tmp))
        if args.skip_worker:
            from server.private.compute import PrivateCompute

            state = PrivateCompute(model_dir, plan, 48)
            client = CKKSClient(state.params, state.key_levels.steps, levels=state.key_levels)
            upload = pack_key_upload(wire.dump_public_keys(client))
            del state
        else:
            out["worker"], client, upload = worker_part(model_dir, plan, args.repeats)
        out["service"] = service_part(model_dir, plan, upload, Path(tmp) / "state", args.profile)
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
