"""Level-aware keys against full keys for a plan (default: the shipped one), in one run (issue 15, item 3/5).

    flock /tmp/cipherlm-bench.lock nice python bench/fhe_keys.py --context 40
    flock /tmp/cipherlm-bench.lock nice python bench/fhe_keys.py --plan fhe/data/smollm2-135m-instruct-polyexp.plan.json

One client key pair. "full": every Galois key and the relinearization key at the top of the chain (the
upload before level-aware keys). "levels": the same secret, each key made at the level where the block
uses it (``EncryptedAttentionLayer.key_levels``: what the SDK now uploads). Reports the public-key bytes
of each (exact upload blobs, seeded), key generation time, one decode step at ``--context`` with each
key set on the same input ciphertext and the same cache (alternated, ``--repeats`` each, median), the
largest difference between the two decrypted outputs, and the download bytes of one result.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import statistics
import time

import numpy as np
import torch

from bench.fhe_attention import fill_cache
from engine.default_model import default_model_dir
from engine.loader import load_model
from fhe.attention import BlockClient, EncryptedAttentionLayer
from fhe.backends.seal import wire
from fhe.backends.seal.keys import CKKSClient, _level_blobs
from fhe.params import CKKSParams, ckks_params_for
from fhe.plan import Plan, load_default_plan


def _mb(blobs) -> float:
    return sum(len(b) for b in blobs.values()) / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layer", type=int, default=None, help="plan layer (default: the first)")
    ap.add_argument("--context", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--plan", default=None, help="plan file (default: the shipped plan)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = load_model(default_model_dir())
    plan = Plan.load(args.plan) if args.plan else load_default_plan()
    index = plan.layer_indices[0] if args.layer is None else args.layer
    lp = plan.layer(index)
    params = CKKSParams.from_dict(plan.ckks) if plan.ckks else ckks_params_for(lp.approx.kind, lp.approx.squarings)
    layer = EncryptedAttentionLayer.from_plan(model, plan, index, params, max_tokens=1024)
    levels = layer.key_levels
    t = time.perf_counter()
    client = CKKSClient(params, levels.steps)                               # full keys (before)
    t_full = time.perf_counter() - t
    t = time.perf_counter()
    level_blobs = {"public_key": client.public_blobs["public_key"],
                   **_level_blobs(client.kit, client.keys.secret, levels)}  # after: same secret
    t_levels = time.perf_counter() - t
    full_up = wire.dump_public_keys(client)
    level_up = {n: wire._pack(wire._kind(n), params, None, b) for n, b in level_blobs.items()}
    keys = {"full": wire.load_server_keys(full_up, params, levels.steps),
            "levels": wire.load_server_keys(level_up, params, levels)}
    bc = BlockClient.for_model(client, model.config, lp.approx.kind, lp.approx.squarings)
    x = torch.randn(1, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    ct = bc.encrypt_input(x / x.pow(2).mean().sqrt())[0]
    base = layer.new_cache()
    fill_cache(layer, client, base, args.context - 1)
    times, outs = {"full": [], "levels": []}, {}
    for _ in range(args.repeats):
        for name in ("full", "levels"):
            cache = copy.copy(base)
            cache.k_blocks, cache.v_blocks = list(base.k_blocks), list(base.v_blocks)
            t = time.perf_counter()
            outs[name] = layer.forward(cache, ct, args.context - 1, keys[name])
            times[name].append(time.perf_counter() - t)
    dec = {n: client.decrypt(c) for n, c in outs.items()}
    y, _ = bc.layout.split_output(dec["full"])
    res = {
        "date": str(datetime.date.today()), "plan": plan.content_hash, "params": params.to_dict(), "layer": index,
        "context": args.context,
        "levels": {"relin": levels.relin, "galois": {str(s): lv for s, lv in levels.galois}},
        "bytes": {"full": {n: len(b) for n, b in full_up.items()}, "levels": {n: len(b) for n, b in level_up.items()}},
        "total_mb": {"full": _mb(full_up), "levels": _mb(level_up)},
        "keygen_s": {"full": t_full, "levels_extra": t_levels},
        "decode_s": {n: statistics.median(v) for n, v in times.items()}, "decode_all_s": times,
        "max_abs_diff": float(np.abs(dec["full"] - dec["levels"]).max()), "max_abs_y": float(np.abs(y).max()),
        "output_level": layer.ev.level(outs["levels"]),
        "download_bytes": len(wire.dump_ciphertext(outs["levels"], params, client.fingerprint)),
    }
    print(json.dumps(res, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
