"""Key registration on the server, step by step: what a session's first key upload costs the worker.

    flock /tmp/cipherlm-bench.lock nice python bench/key_registration.py

Uses the e2e tests' geometry (the default plan's first layer at N = 16384, level-aware keys: what the
encrypted end-to-end tests upload). Times, median of ``--repeats``: the client's key generation, the
worker's ``inspect_key`` (parse + allow-list + canonical re-serialization), ``load_key`` of the canonical
bytes in a fresh worker state (a second parse), and ``load_key`` right after ``inspect_key`` in the same
worker (what the service does when one worker inspects and then loads).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from engine.default_model import default_model_dir
from fhe.backends.seal import wire
from fhe.backends.seal.keys import CKKSClient
from fhe.envelope import pack_key_upload
from fhe.params import CKKSParams
from fhe.plan import Plan
from server.private.feature import default_plan_path


def _plan(tmp: str) -> str:
    full = Plan.load(default_plan_path())
    ckks = CKKSParams(16384, (48,) + (30,) * 11 + (60,), 30).to_dict()
    plan = Plan(full.model_id, full.weights_sha256, (full.layers[0],), ckks, "key registration bench",
                full.calibration)
    return str(plan.save(f"{tmp}/one-layer.plan.json"))


def _time(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def main() -> None:
    import tempfile

    from server.private.compute import PrivateCompute

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model_dir = default_model_dir()
    with tempfile.TemporaryDirectory() as tmp:
        state = PrivateCompute(str(model_dir), _plan(tmp), 48)
        t = time.perf_counter()
        client = CKKSClient(state.params, state.key_levels.steps, levels=state.key_levels)
        keygen = time.perf_counter() - t
        upload = pack_key_upload(wire.dump_public_keys(client))
        inspect, verdict = _time(lambda: state.inspect_key(upload), args.repeats)
        fresh = PrivateCompute(str(model_dir), _plan(tmp), 48)
        load_fresh, _ = _time(lambda: fresh.load_key("fp", verdict.canonical, verdict.key_set), args.repeats)

        def inspect_then_load():
            v = state.inspect_key(upload)
            t0 = time.perf_counter()
            state.load_key("fp", v.canonical, v.key_set)
            return time.perf_counter() - t0
        _, load_after = _time(inspect_then_load, 1)
    out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "upload_bytes": len(upload),
           "canonical_bytes": len(verdict.canonical), "keygen_s": keygen, "inspect_key_s": inspect,
           "load_key_fresh_s": load_fresh, "load_key_after_inspect_s": load_after,
           "registration_s": inspect + load_after}
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
