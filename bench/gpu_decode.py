"""One layer's encrypted decode step on our gpu backend, before and after a change, in one process (issue 16).

    python3 bench/gpu_decode.py --weights .carry/smollm2 --variants main,new --out decode.json

Each variant is a set of the backend's switches (``VARIANTS``: ``s15`` = the code path as merged before
session 16, ``main`` = session 16's (Shoup's products, fewer passes, the sync-free encode), ``new`` = with
session 17's whole-step graphs too: a decode step is one CUDA graph replay, fhe/backends/gpu/whole_step.py);
each gets a fresh evaluator, a fresh device copy of the same
keys (graphs are captured per key set, so a switch never replays another variant's kernels) and the same
inputs, at the shipped plan's parameters (N = 32768) on SmolLM2 layer ``--layer``'s real attention weights
(exported by ``bench/gpu_attention.py --export``), on-device encoder. Per variant:

* ``decode_ms``: one token at each of ``--contexts`` (cache of random residues: a step's cost does not depend
  on values), median of ``--repeat``, synchronized;
* ``profile_128``: one step at context 128 under torch's profiler (kernels, their summed device time) and
  the host syncs it makes (``torch.cuda.set_sync_debug_mode``);
* ``prefill_s``: ``--prefill`` tokens one after another (``block.prefill``), as gpu_attention.py times it, the
  second time (``prefill_s_first``: the first, with its graph captures);
* ``sessions``: S sessions at context 128 stepped one after another (tokens/s per layer), each with its own
  key set object (the same tensors: a whole-step graph copies the keys into its static ones at every switch,
  as it would for real sessions); one round to warm up, then the median of 3;
* ``whole_steps``: the graph counters (captures and their seconds, replays, key copies);
* ``keyswitch_ms``: rotate and relinearize at the top level and at level 5 (median of 20).

``same_as_main``: every variant's outputs (the decode step at each context, the prefill's) equal the
``main`` variant's residue for residue (main's path is the one checked against SEAL; the CUDA tests check
each variant's kernels against SEAL too).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
import warnings
from pathlib import Path

import torch

#: backend switches per variant: (module, attribute) -> value
_SWITCHES = (("fhe.backends.gpu.triton_ops", "SHOUP"), ("fhe.backends.gpu.triton_ops", "FEWER"),
             ("fhe.backends.gpu.evaluator", "ASYNC_ENCODE"), ("fhe.backends.gpu.whole_step", "STEP_GRAPHS"),
             ("fhe.backends.gpu.triton_ops", "STRIDED"))
VARIANTS = {
    "s15": dict.fromkeys(_SWITCHES, False),
    "main": dict(zip(_SWITCHES, (True, True, True, False, False), strict=True)),
    "s17": dict(zip(_SWITCHES, (True, True, True, True, False), strict=True)),
    "new": dict.fromkeys(_SWITCHES, True),
}


def _set(variant: str) -> None:
    import importlib

    for (mod, attr), value in VARIANTS[variant].items():
        setattr(importlib.import_module(mod), attr, value)


def _median_ms(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - t))
    return statistics.median(times)


def _profile(step) -> dict:
    """Kernels and their summed device time over one call of ``step``, and its host syncs."""
    from torch.profiler import ProfilerActivity, profile

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        step()
        torch.cuda.synchronize()
        wall = 1e3 * (time.perf_counter() - t)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name: dict[str, list] = {}
    for e in kernels:
        row = by_name.setdefault(e.name[:60], [0, 0.0])
        row[0] += 1
        row[1] += e.device_time / 1e3
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:12]
    return {"wall_ms_profiled": round(wall, 2), "kernels": len(kernels),
            "kernel_ms": round(sum(e.device_time for e in kernels) / 1e3, 2),
            "host_syncs": sum("synchroniz" in str(w.message) for w in caught),
            "top": {k: {"n": n, "ms": round(ms, 2)} for k, (n, ms) in top}}


def run_variant(variant: str, setup: dict, args) -> dict:
    from bench.gpu_sessions import _fill
    from fhe.attention import EncryptedAttentionLayer
    from fhe.backends.gpu import GpuEvaluator

    _set(variant)
    cfg, layer, rope, lp, params = setup["model"]
    ev = GpuEvaluator(params, device="cuda", encoder="fft")
    block = EncryptedAttentionLayer(layer, rope, lp, cfg, params, max_tokens=1024, evaluator=ev)
    keys = ev.keys_from_server(setup["server"])
    ct = ev.deserialize(setup["x_bytes"])
    res: dict = {"variant": variant, "switches": {f"{m}.{a}": v for (m, a), v in VARIANTS[variant].items()},
                 "decode_ms": {}}
    outs: dict = {}
    for ctx in [int(c) for c in args.contexts.split(",")]:
        torch.manual_seed(ctx)
        base = _fill(block, ctx - 1)
        snap = (list(base.k_blocks), list(base.v_blocks), base.length)

        def step(cache=base, snap=snap, ctx=ctx):
            cache.k_blocks, cache.v_blocks, cache.length = list(snap[0]), list(snap[1]), snap[2]
            return block.forward(cache, ct, ctx - 1, keys)

        outs[f"decode{ctx}"] = step().data.clone()                    # warm-up: Triton compiles, graphs captured
        res["decode_ms"][ctx] = round(_median_ms(step, args.repeat), 2)
        print(f"[{variant}] decode @ {ctx}: {res['decode_ms'][ctx]:.1f} ms", flush=True)
        if ctx == 128:
            res["profile_128"] = _profile(step)
            print(f"[{variant}] profile @128: {json.dumps(res['profile_128'])}", flush=True)
    if args.prefill:
        cts = [ev.deserialize(b) for b in setup["prefill_bytes"]]
        res["prefill_s_first"] = round(_median_ms(lambda: block.prefill(block.new_cache(), cts, 0, keys), 1) / 1e3, 3)
        outs["prefill"] = torch.stack([o.data for o in block.prefill(block.new_cache(), cts, 0, keys)])
        res["prefill_s"] = round(_median_ms(lambda: block.prefill(block.new_cache(), cts, 0, keys), 1) / 1e3, 3)
        print(f"[{variant}] prefill {args.prefill}: {res['prefill_s']:.2f} s (first {res['prefill_s_first']:.2f} s)",
              flush=True)
    res["sessions"] = []
    for s in [int(v) for v in args.sessions.split(",") if v]:
        caches = [_fill(block, 127) for _ in range(s)]
        snaps = [(list(c.k_blocks), list(c.v_blocks), c.length) for c in caches]
        own = [_own_keys(keys) for _ in range(s)]

        def round_(caches=caches, snaps=snaps, own=own):
            for cache, snap, k in zip(caches, snaps, own, strict=True):
                cache.k_blocks, cache.v_blocks, cache.length = list(snap[0]), list(snap[1]), snap[2]
                block.forward(cache, ct, 127, k)

        round_()
        sec = _median_ms(round_, 3) / 1e3
        res["sessions"].append({"sessions": s, "tokens_per_s_per_layer": round(s / sec, 2)})
        print(f"[{variant}] {s} sessions: {s / sec:.1f} tokens/s per layer", flush=True)
        del caches, snaps, own
    ws = ev.whole_steps
    if ws is not None:
        res["whole_steps"] = {"graphs": len(ws), "captures": ws.captures, "capture_s": round(ws.capture_s, 2),
                              "replays": ws.replays, "fallbacks": ws.fallbacks, "key_copies": ws.key_copies}
        print(f"[{variant}] whole steps: {json.dumps(res['whole_steps'])}", flush=True)
    res["keyswitch_ms"] = keyswitch(ev, keys, block)
    print(f"[{variant}] key switching: {json.dumps(res['keyswitch_ms'])}", flush=True)
    res["_outs"] = outs
    return res


def keyswitch(ev, keys, block) -> dict:
    """rotate (the step of the first Galois key there) and relinearize at the top level and level 5."""
    from fhe.backends.gpu.evaluator import GpuCiphertext

    out = {}
    for lev in (ev.top, 5):
        q = ev.ctx.q[:lev].reshape(1, lev, 1)
        data = torch.randint(0, 2 ** 62, (3, lev, ev.params.poly_modulus_degree), device="cuda") % q
        ct3, ct2 = GpuCiphertext(data, ev.scale), GpuCiphertext(data[:2].contiguous(), ev.scale)
        step = next((s for s in sorted(block.rotation_steps, key=abs) if _has(keys, s, lev)), None)
        try:
            ev.relinearize(ct3, keys)
            out[f"relin_L{lev}"] = round(_median_ms(lambda ct3=ct3: ev.relinearize(ct3, keys), 20), 3)
        except Exception as exc:  # no relin key at this level
            out[f"relin_L{lev}"] = repr(exc)[:80]
        if step is not None:
            ev.rotate(ct2, step, keys)
            out[f"rotate_L{lev}"] = round(_median_ms(lambda ct2=ct2, step=step: ev.rotate(ct2, step, keys), 20), 3)
    return out


def _own_keys(keys):
    """Another key set object on the same device tensors (a session's own keys, without their memory)."""
    from fhe.backends.gpu.keys import GpuKeys

    return GpuKeys(keys.params, keys.relin, dict(keys.galois), keys.rotation_steps, keys.fingerprint)


def _has(keys, step: int, lev: int) -> bool:
    try:
        keys.galois_key(step, lev)
        return True
    except Exception:
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", type=Path, default=Path(".carry/smollm2"))
    ap.add_argument("--layer", type=int, default=3)
    ap.add_argument("--contexts", default="16,128,512")
    ap.add_argument("--prefill", type=int, default=32)
    ap.add_argument("--sessions", default="1,8,32")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--variants", default="main,new")
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from fhe.backends.gpu import whole_step

    whole_step.CAPTURE_AFTER = 1            # the steady state: a step's graph captured at its first use
    from bench.gpu_attention import load_layer
    from fhe.attention import BlockClient
    from fhe.backends.seal import hazmat as seal
    from fhe.backends.seal.keys import CKKSClient
    from fhe.params import ckks_params_for
    from fhe.plan import load_default_plan
    from fhe.weight_maps import required_key_levels

    cfg, layer, rope, _ = load_layer(args.weights, args.layer)
    lp = load_default_plan().layer(args.layer)
    params = ckks_params_for(lp.approx.kind, lp.approx.squarings)
    levels = required_key_levels(cfg, params, lp.approx.kind, lp.approx.squarings)
    t = time.perf_counter()
    client = CKKSClient(params, levels.steps, levels=levels)
    server = client.server_keys()
    bc = BlockClient.for_model(client, cfg, lp.approx.kind, lp.approx.squarings)
    x = torch.randn(1 + args.prefill, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    x = (x / x.pow(2).mean(-1, keepdim=True).sqrt()).double()
    enc = bc.encrypt_input(x)
    setup = {"model": (cfg, layer, rope, lp, params), "server": server, "x_bytes": seal.to_bytes(enc[0]),
             "prefill_bytes": [seal.to_bytes(c) for c in enc[1:]]}
    res = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="minutes"),
           "device": torch.cuda.get_device_name(), "setup_s": round(time.perf_counter() - t, 1),
           "args": vars(args) | {"weights": str(args.weights)}, "variants": {}}
    print(f"setup (SEAL keys, inputs): {res['setup_s']} s on {res['device']}", flush=True)
    for v in args.variants.split(","):
        r = run_variant(v, setup, args)
        outs = r.pop("_outs")
        if v == "main":
            ref = outs
        if "main" in res["variants"] or v == "main":  # (run main first: its outputs are the reference)
            r["same_as_main"] = {k: bool(torch.equal(o, ref[k])) for k, o in outs.items()}
            print(f"[{v}] same as main: {r['same_as_main']}", flush=True)
        res["variants"][v] = r
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        if args.out:
            Path(args.out).write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
