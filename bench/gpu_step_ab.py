"""Two variants of the gpu backend's decode step, step by step in turn on one GPU (issue 16, sessions 17-18).

    python3 bench/gpu_step_ab.py --weights .carry/smollm2 --contexts 128,512 --repeat 10 --out ab.json
    python3 bench/gpu_step_ab.py --ab strided --profile ...   # session 18: triton_ops.STRIDED off / on

``--ab`` (:data:`AB`) picks the pair: ``graphs`` (session 17) = whole-step graphs off (main) / on (new);
``strided`` (session 18) = both with whole-step graphs, ``triton_ops.STRIDED`` off (main) / on (new), set before
each of a variant's steps (each variant has its own evaluator and key set object, so its graphs hold its own
kernels); ``batch`` = both strided, ``evaluator.BATCH_SWITCHES`` off / on; ``lazy`` (session 19) = both with
the batched switches, ``triton_ops.LAZY`` off / on; ``lazy+batch`` (session 19) = ``triton_ops.LAZY`` and
``evaluator.BATCH_SWITCHES`` off / on; ``fuse`` (session 20) = ``triton_ops.SKIP_DIAG``, ``triton_ops.FUSED_FINISH``
and ``keyswitch.FUSED_CORRECTION`` off / on (the rest at the defaults); ``s20`` = those three and ``triton_ops.LAZY``
off / on; ``s20x3`` = three variants, main (the four off) / ``fuse`` (the three fusions, LAZY off) / new (all four;
session 20 ran it with ``LOCAL_WARPS`` 4, then the default, in all three);
``warps`` = ``triton_ops.LOCAL_WARPS`` (the local and strided NTT kernels' warps) 4 / 8;
``both`` = main as merged before
session 18 against both switches on. ``--profile``: one step of each at context 128 under
torch's profiler (kernels, their summed device time, the top kernels by time).

``bench/gpu_decode.py`` runs its variants one after the other, so a drift of the card's speed between them
(the same-code rotation differed by 13-21 % between its two phases on 2026-12-06) reads as a difference.
Here both evaluators (``step_graphs=False`` = main, ``True`` = new) are built first, and each repetition
times one decode step of each, alternately, on the same inputs: SmolLM2 layer ``--layer``'s real attention
weights, the shipped plan, on-device encoder, **random keys** of the plan's key shapes (no SEAL key
generation: a step's cost does not depend on values; both variants read the same key tensors) and caches of
random residues. Per context: both medians and every repetition; whether the outputs are equal residue for
residue; S sessions stepped in turn (each with its own key set object on the same tensors, as real sessions
would make the graphs copy keys). A rotation at the highest key level (main's path) is timed first and last as a control
for the card's drift.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from pathlib import Path

import torch

#: --ab choices: name -> {variant: (step_graphs, {(module, attribute): value} set before each of its steps)}
AB = {
    "graphs": {"main": (False, {}), "new": (True, {})},
    "strided": {"main": (True, {("fhe.backends.gpu.triton_ops", "STRIDED"): False}),
                "new": (True, {("fhe.backends.gpu.triton_ops", "STRIDED"): True})},
    "batch": {"main": (True, {("fhe.backends.gpu.triton_ops", "STRIDED"): True,
                              ("fhe.backends.gpu.evaluator", "BATCH_SWITCHES"): False}),
              "new": (True, {("fhe.backends.gpu.triton_ops", "STRIDED"): True,
                             ("fhe.backends.gpu.evaluator", "BATCH_SWITCHES"): True})},
    "lazy": {"main": (True, {("fhe.backends.gpu.triton_ops", "LAZY"): False,
                             ("fhe.backends.gpu.evaluator", "BATCH_SWITCHES"): True}),
             "new": (True, {("fhe.backends.gpu.triton_ops", "LAZY"): True,
                            ("fhe.backends.gpu.evaluator", "BATCH_SWITCHES"): True})},
    "lazy+batch": {"main": (True, {("fhe.backends.gpu.triton_ops", "LAZY"): False,
                                   ("fhe.backends.gpu.evaluator", "BATCH_SWITCHES"): False}),
                   "new": (True, {("fhe.backends.gpu.triton_ops", "LAZY"): True,
                                  ("fhe.backends.gpu.evaluator", "BATCH_SWITCHES"): True})},
    "fuse": {"main": (True, {("fhe.backends.gpu.triton_ops", "SKIP_DIAG"): False,
                             ("fhe.backends.gpu.triton_ops", "FUSED_FINISH"): False,
                             ("fhe.backends.gpu.keyswitch", "FUSED_CORRECTION"): False}),
             "new": (True, {("fhe.backends.gpu.triton_ops", "SKIP_DIAG"): True,
                            ("fhe.backends.gpu.triton_ops", "FUSED_FINISH"): True,
                            ("fhe.backends.gpu.keyswitch", "FUSED_CORRECTION"): True})},
    "s20": {"main": (True, {("fhe.backends.gpu.triton_ops", "LAZY"): False,
                            ("fhe.backends.gpu.triton_ops", "SKIP_DIAG"): False,
                            ("fhe.backends.gpu.triton_ops", "FUSED_FINISH"): False,
                            ("fhe.backends.gpu.keyswitch", "FUSED_CORRECTION"): False}),
            "new": (True, {("fhe.backends.gpu.triton_ops", "LAZY"): True,
                           ("fhe.backends.gpu.triton_ops", "SKIP_DIAG"): True,
                           ("fhe.backends.gpu.triton_ops", "FUSED_FINISH"): True,
                           ("fhe.backends.gpu.keyswitch", "FUSED_CORRECTION"): True})},
    "s20x3": {"main": (True, {("fhe.backends.gpu.triton_ops", "LAZY"): False,
                              ("fhe.backends.gpu.triton_ops", "SKIP_DIAG"): False,
                              ("fhe.backends.gpu.triton_ops", "FUSED_FINISH"): False,
                              ("fhe.backends.gpu.keyswitch", "FUSED_CORRECTION"): False}),
              "fuse": (True, {("fhe.backends.gpu.triton_ops", "LAZY"): False,
                              ("fhe.backends.gpu.triton_ops", "SKIP_DIAG"): True,
                              ("fhe.backends.gpu.triton_ops", "FUSED_FINISH"): True,
                              ("fhe.backends.gpu.keyswitch", "FUSED_CORRECTION"): True}),
              "new": (True, {("fhe.backends.gpu.triton_ops", "LAZY"): True,
                             ("fhe.backends.gpu.triton_ops", "SKIP_DIAG"): True,
                             ("fhe.backends.gpu.triton_ops", "FUSED_FINISH"): True,
                             ("fhe.backends.gpu.keyswitch", "FUSED_CORRECTION"): True})},
    "warps": {"main": (True, {("fhe.backends.gpu.triton_ops", "LOCAL_WARPS"): 4}),
              "new": (True, {("fhe.backends.gpu.triton_ops", "LOCAL_WARPS"): 8})},
    "both": {"main": (True, {("fhe.backends.gpu.triton_ops", "STRIDED"): False,
                             ("fhe.backends.gpu.evaluator", "BATCH_SWITCHES"): False}),
             "new": (True, {("fhe.backends.gpu.triton_ops", "STRIDED"): True,
                            ("fhe.backends.gpu.evaluator", "BATCH_SWITCHES"): True})},
}


def _switch(switches: dict) -> None:
    import importlib

    for (mod, attr), value in switches.items():
        setattr(importlib.import_module(mod), attr, value)


def random_keys(ev, levels):
    """A GpuKeys of random residues with the shapes ``levels`` (KeyLevels) gives: [Lk, 2, Lk+1, N] per key."""
    from fhe.backends.gpu.galois import galois_elt
    from fhe.backends.gpu.keys import GpuKeys

    def key(lk: int) -> torch.Tensor:
        q = torch.cat([ev.ctx.q[:lk], ev.ctx.q[-1:]]).reshape(1, 1, lk + 1, 1)
        return torch.randint(0, 2 ** 62, (lk, 2, lk + 1, ev.params.poly_modulus_degree), device=ev.device) % q

    galois = {galois_elt(s, ev.slots): key(lv) for s, lv in levels.galois}
    return GpuKeys(ev.params, key(levels.relin), galois, tuple(s for s, _ in levels.galois), "random")


def _same_tensors(keys, params):
    from fhe.backends.gpu.keys import GpuKeys

    return GpuKeys(params, keys.relin, dict(keys.galois), keys.rotation_steps, keys.fingerprint)


def _ms(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - t)


def _rotate_ms(ev, keys, step: int, level: int) -> float:
    from bench.gpu_sessions import _random_ct

    ct = _random_ct(ev, level)
    ev.rotate(ct, step, keys)
    return round(statistics.median(_ms(lambda: ev.rotate(ct, step, keys)) for _ in range(20)), 3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", type=Path, default=Path(".carry/smollm2"))
    ap.add_argument("--layer", type=int, default=3)
    ap.add_argument("--contexts", default="128,512")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--ab", default="graphs", choices=sorted(AB))
    ap.add_argument("--profile", action="store_true", help="one step of each at context 128 under the profiler")
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from fhe.backends.gpu import whole_step

    whole_step.CAPTURE_AFTER = 1            # the steady state: a step's graph captured at its first use
    from bench.gpu_attention import load_layer
    from bench.gpu_sessions import _fill, _random_ct
    from fhe.attention import EncryptedAttentionLayer
    from fhe.backends.gpu import GpuEvaluator
    from fhe.params import ckks_params_for
    from fhe.plan import load_default_plan
    from fhe.weight_maps import required_key_levels

    cfg, layer, rope, _ = load_layer(args.weights, args.layer)
    lp = load_default_plan().layer(args.layer)
    params = ckks_params_for(lp.approx.kind, lp.approx.squarings)
    levels = required_key_levels(cfg, params, lp.approx.kind, lp.approx.squarings)
    runs, pair = {}, AB[args.ab]
    for name, (on, switches) in pair.items():
        _switch(switches)
        ev = GpuEvaluator(params, device="cuda", encoder="fft", step_graphs=on)
        block = EncryptedAttentionLayer(layer, rope, lp, cfg, params, max_tokens=1024, evaluator=ev)
        runs[name] = (ev, block)
    ev0 = runs["main"][0]
    _switch(pair["main"][1])
    keys0 = random_keys(ev0, levels)
    var_keys = {n: _same_tensors(keys0, params) for n in runs}     # a key set object per variant (its graphs)
    keys = var_keys["main"]
    ct = _random_ct(ev0, ev0.top)
    top_key = max(lv for _, lv in levels.galois)
    step = min(s for s, lv in levels.galois if lv == top_key)
    res = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
           "device": torch.cuda.get_device_name(), "args": vars(args) | {"weights": str(args.weights)},
           "ab": {n: [on, {f"{m}.{a}": v for (m, a), v in sw.items()}] for n, (on, sw) in pair.items()},
           "rotate_ms_before": _rotate_ms(ev0, keys, step, top_key), "rotate_level": top_key, "contexts": {}}
    for ctx in [int(c) for c in args.contexts.split(",")]:
        torch.manual_seed(ctx)
        base = _fill(runs["main"][1], ctx - 1)
        snap = (list(base.k_blocks), list(base.v_blocks), base.length)
        caches = {n: runs[n][1].new_cache() for n in runs}

        def step_fn(name, ctx=ctx, snap=snap, caches=caches):
            _switch(pair[name][1])
            cache = caches[name]
            cache.k_blocks, cache.v_blocks, cache.length = list(snap[0]), list(snap[1]), snap[2]
            return runs[name][1].forward(cache, ct, ctx - 1, var_keys[name])

        outs = {n: step_fn(n).data.clone() for n in runs}               # warm-up: compiles, captures
        times = {n: [] for n in runs}
        for _ in range(args.repeat):
            for n in runs:
                times[n].append(round(_ms(lambda n=n: step_fn(n)), 2))
        row = {n: {"median_ms": round(statistics.median(t), 2), "all_ms": t} for n, t in times.items()}
        row["same"] = all(bool(torch.equal(outs["main"], o)) for o in outs.values())   # every variant = main's
        res["contexts"][ctx] = row
        print(f"decode @ {ctx}: " + ", ".join(f"{n} {row[n]['median_ms']} ms" for n in runs) + f", same {row['same']}",
              flush=True)
        if args.profile and ctx == 128:
            from bench.gpu_decode import _profile

            res["profile_128"] = {n: _profile(lambda n=n: step_fn(n)) for n in runs}
            print(f"profile @128: {json.dumps(res['profile_128'])}", flush=True)
    s = args.sessions
    if s:
        sess = [_fill(runs["main"][1], 127) for _ in range(s)]
        snaps = [(list(c.k_blocks), list(c.v_blocks), c.length) for c in sess]
        own = {n: [_same_tensors(keys0, params) for _ in range(s)] for n in runs}

        def round_(name):
            _switch(pair[name][1])
            for cache, sn, k in zip(sess, snaps, own[name], strict=True):
                cache.k_blocks, cache.v_blocks, cache.length = list(sn[0]), list(sn[1]), sn[2]
                runs[name][1].forward(cache, ct, 127, k)

        for n in runs:
            round_(n)                                                    # warm-up (own keys: main's graphs)
        times = {n: [] for n in runs}
        for _ in range(3):
            for n in runs:
                times[n].append(_ms(lambda n=n: round_(n)))
        res["sessions"] = {n: {"sessions": s, "tokens_per_s_per_layer": round(s / statistics.median(t) * 1e3, 2)}
                           for n, t in times.items()}
        print(f"{s} sessions at 128: {json.dumps(res['sessions'])}", flush=True)
    _switch(pair["main"][1])
    res["rotate_ms_after"] = _rotate_ms(ev0, keys, step, top_key)
    ws = runs["new"][0].whole_steps
    res["whole_steps"] = {"graphs": len(ws), "captures": ws.captures, "capture_s": round(ws.capture_s, 2),
                          "replays": ws.replays, "key_copies": ws.key_copies}
    print(json.dumps(res), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
