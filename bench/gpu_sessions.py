"""Aggregate encrypted decode throughput on one GPU with the sessions spread over P worker processes.

One process steps its sessions one after another (the sessions row of ``bench/gpu_attention.py``: flat
7.8 tokens/s per layer from 1 to 32 sessions). Several worker processes on one card (``[private] workers =
P, device = "cuda"``: each worker holds its own sessions, keys and block) could overlap one another's
launch gaps without any batched kernel, if the GPU has gaps to fill. This measures whether it does
(2026-12-02 on an H200: no, 8.1-8.3 tokens/s per layer for P = 1..8; docs/benchmarks.md):

    python3 bench/gpu_sessions.py --weights .carry/gpufhe/packed --procs 1,2,4,8 --sessions 1,8,32

The parent makes one SEAL client's level-aware keys (the shipped plan's layer) and hands every worker the
public blobs; each worker expands them on the device (one key set per worker, as the server does), builds
the block on the real layer weights (on-device encoder), fills each of its sessions' caches to context
``--context`` - 1 with random residues and steps one decode token per session per round (a step's cost
does not depend on the values). Workers start each configuration at a barrier; aggregate = tokens over
(last end - first start). Device bytes per session (its KV cache) and per worker (keys + plaintexts) too.
``--own-keys`` (session 20): each session steps with its own copy of the key set in device memory, as sessions
of distinct clients do (their whole-step graphs then copy each session's keys in; its bytes are reported per
session); without it every session of a worker uses the worker's one key set.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import time
from pathlib import Path


def _random_ct(ev, level: int):
    """A size-2 ciphertext of random residues at ``level`` (the decode step's timing ignores values)."""
    import torch

    from fhe.backends.gpu.evaluator import GpuCiphertext

    q = ev.ctx.q[:level].reshape(1, level, 1)
    data = torch.randint(0, 2 ** 62, (2, level, ev.params.poly_modulus_degree), device=ev.device) % q
    return GpuCiphertext(data, ev.scale)


def _fill(block, tokens: int) -> object:
    cache, geo, lay = block.new_cache(), block.geo, block.geo.layout
    full, rest = divmod(tokens, lay.block_tokens)
    for _ in range(full + (1 if rest else 0)):
        cache.k_blocks.append(_random_ct(block.ev, geo.level_qk))
        cache.v_blocks.append(_random_ct(block.ev, geo.level_p))
    cache.length = tokens
    return cache


def _copy_keys(keys):
    """The same key set in new device memory (another client's keys occupy their own)."""
    from fhe.backends.gpu.keys import GpuKeys

    return GpuKeys(keys.params, keys.relin.clone(), {e: k.clone() for e, k in keys.galois.items()},
                   keys.rotation_steps, keys.fingerprint)


def worker(rank: int, args: dict, blobs: dict, barrier, commands, results) -> None:
    """One GPU worker: block + keys once, then one timed round per command."""
    import torch

    from bench.gpu_attention import load_layer
    from fhe.attention import EncryptedAttentionLayer
    from fhe.backends.gpu import GpuEvaluator, whole_step
    from fhe.params import ckks_params_for
    from fhe.plan import load_default_plan

    whole_step.CAPTURE_AFTER = 1            # the steady state: the warm-up step captures, the timed rounds replay
    torch.set_num_threads(1)
    cfg, layer, rope, _ = load_layer(Path(args["weights"]), args["layer"])
    lp = load_default_plan().layer(args["layer"])
    params = ckks_params_for(lp.approx.kind, lp.approx.squarings)
    ev = GpuEvaluator(params, device="cuda", encoder="fft")
    base = torch.cuda.memory_allocated()
    block = EncryptedAttentionLayer(layer, rope, lp, cfg, params, max_tokens=1024, evaluator=ev)
    keys = ev.load_keys(blobs, block.key_levels)
    torch.cuda.synchronize()
    worker_bytes = torch.cuda.memory_allocated() - base
    ctx = args["context"]
    warm = _fill(block, ctx - 1)
    block.forward(warm, _random_ct(ev, ev.top), ctx - 1, keys)          # Triton compiles, graphs captured
    del warm
    results.put(("ready", rank, worker_bytes))
    while (cmd := commands.get()) is not None:
        n, rounds = cmd
        before = torch.cuda.memory_allocated()
        caches = [_fill(block, ctx - 1) for _ in range(n)]
        snaps = [(list(c.k_blocks), list(c.v_blocks), c.length) for c in caches]
        cts = [_random_ct(ev, ev.top) for _ in range(n)]
        torch.cuda.synchronize()
        per_session = (torch.cuda.memory_allocated() - before) / n if n else 0.0
        # each session its own key set (a copy on the device, as distinct clients' keys are) or all the worker's
        own = [_copy_keys(keys) for _ in range(n)] if args.get("own_keys") else [keys] * n
        torch.cuda.synchronize()
        per_session_keys = (torch.cuda.memory_allocated() - before) / n - per_session if n else 0.0
        barrier.wait()
        t0 = time.time()
        for _ in range(rounds):
            for cache, snap, ct, k in zip(caches, snaps, cts, own, strict=True):
                cache.k_blocks, cache.v_blocks, cache.length = list(snap[0]), list(snap[1]), snap[2]
                block.forward(cache, ct, ctx - 1, k)
        torch.cuda.synchronize()
        results.put(("done", rank, t0, time.time(), n * rounds, per_session, per_session_keys))
        del caches, snaps, cts, own


def run_config(procs: list, commands, results, barrier_n: int, sessions: int, active: int, rounds: int) -> dict:
    """``sessions`` spread over the first ``active`` workers (the others idle at the barrier)."""
    share = [sessions // active + (1 if i < sessions % active else 0) if i < active else 0
             for i in range(len(procs))]
    for q, n in zip(commands, share, strict=True):
        q.put((n, rounds))
    done = [results.get() for _ in procs]
    busy = [d for d in done if d[4]]
    start, end = min(d[2] for d in busy), max(d[3] for d in busy)
    tokens = sum(d[4] for d in busy)
    return {"sessions": sessions, "workers": active, "rounds": rounds, "seconds": end - start,
            "tokens_per_s_per_layer": tokens / (end - start),
            "device_bytes_per_session_cache": max(d[5] for d in busy),
            "device_bytes_per_session_keys": max(d[6] for d in busy)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", type=Path, default=Path(".carry/gpufhe/packed"))
    ap.add_argument("--layer", type=int, default=3)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--procs", default="1,2,4,8")
    ap.add_argument("--sessions", default="1,8,32")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--own-keys", action="store_true", help="each session its own copy of the key set on the device")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    import torch

    from bench.gpu_attention import load_layer
    from fhe.attention import EncryptedAttentionLayer
    from fhe.backends.seal.keys import CKKSClient
    from fhe.params import ckks_params_for
    from fhe.plan import load_default_plan

    cfg, layer, rope, _ = load_layer(args.weights, args.layer)
    lp = load_default_plan().layer(args.layer)
    params = ckks_params_for(lp.approx.kind, lp.approx.squarings)
    levels = EncryptedAttentionLayer(layer, rope, lp, cfg, params, max_tokens=1024).key_levels
    blobs = dict(CKKSClient(params, levels.steps, levels=levels).public_blobs)
    procs_list = [int(p) for p in args.procs.split(",")]
    n = max(procs_list)
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(n), ctx.Queue()
    commands = [ctx.Queue() for _ in range(n)]
    conf = {"weights": str(args.weights), "layer": args.layer, "context": args.context, "own_keys": args.own_keys}
    procs = [ctx.Process(target=worker, args=(r, conf, blobs, barrier, commands[r], results)) for r in range(n)]
    t = time.time()
    for p in procs:
        p.start()
    ready = [results.get() for _ in procs]
    res = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="minutes"),
           "device": torch.cuda.get_device_name(), "context": args.context, "layer": args.layer,
           "worker_setup_s": time.time() - t, "device_bytes_per_worker": max(r[2] for r in ready), "rows": []}
    print(json.dumps(res), flush=True)
    for s in [int(v) for v in args.sessions.split(",")]:
        for p in procs_list:
            if p > s:
                continue
            row = run_config(procs, commands, results, n, s, p, args.rounds)
            free, total = torch.cuda.mem_get_info()
            row["device_bytes_used_all_workers"] = total - free
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
            if args.out:
                args.out.write_text(json.dumps(res, indent=1))
    for q in commands:
        q.put(None)
    for p in procs:
        p.join(timeout=60)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
