"""Packed prefill (fhe/packed.py) of SmolLM2 layer 3 on the gpu backend (CUDA), at the shipped plan.

    # here (the machine with the cached model): layer 3's attention weights + 32 real block inputs
    python bench/gpu_packed.py --export .carry/gpufhe/packed
    # on the GPU machine (tenseal/zstandard carried as wheels)
    python3 bench/gpu_packed.py --weights .carry/gpufhe/packed --out packed.json --marker /tmp/gpu_done

What it measures, in one run, from the same client ciphertexts and keys (level-aware, the plan's):

* GPU, on-device encoder: one full packed chunk (B = 28 tokens at N = 32768), and a 32-token prompt as the
  SDK sends it (one packed chunk + 4 tokens one by one), the latter again once its single-token steps' whole-step
  graphs are captured (:func:`warm_sdk`: what a worker that has seen this prompt shape before runs); the chunk
  again the way it ran before this bench (``encode_many`` off: diagonals built by numpy on the host and encoded
  one by one); the 32 tokens
  one by one (the token path, for scale); medians of ``--repeat``.
* fidelity: the GPU chunk's decrypted outputs against the plaintext simulator and the GPU token path.
* ``--ab-group G [--ab-rows]``: ``fhe.packed.SHIFT_GROUP`` 0 (one band shift at a time) against G (and
  ``BATCH_ROWS`` off against on), in turn.
* ``--ab-cache GB`` (session 23): main's path (``fhe.packed.PLAIN_CACHE_BYTES`` 0: every chunk encodes its
  projections' diagonals; ``STACK_BABIES`` off) against the babies stacked once per map, and against that with GB
  GiB of kept diagonals (every repeat after the first finds the chunk's), in turn; the cache's hits, misses, bytes.
* ``--ab-main`` (session 20): main's switches as merged before session 20 (:data:`MAIN_SWITCHES`: the NTT's lazy
  butterflies, the key switch's fusions, SHIFT_GROUP, BATCH_ROWS all off) on a second evaluator, block and key set
  object against the defaults, in turn. ``--quick``: stop after the timings and A/Bs.
* ``--profile``: one chunk with its parts timed (:data:`PHASES`) and one under torch's profiler.
* then (``--marker`` is written first, so a caller may start other GPU work: this part is CPU only) the
  same chunk on the SEAL backend (CPU, one thread, as in a worker): the decrypted outputs' largest
  difference over their range (the CPU backend is the reference the issue names).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from pathlib import Path

import torch

from bench.gpu_attention import _median_s, _reference, _to_gpu, _to_seal, export, load_layer
from fhe.attention import BlockClient, EncryptedAttentionLayer
from fhe.params import ckks_params_for
from fhe.plan import load_default_plan


def _finish(bc, ev, kit, outs):
    y, z = bc.decrypt_output([_to_seal(ev, kit, c) for c in outs])
    return BlockClient.finish(y, z)


def setup(folder: Path, index: int, device: str):
    """(cfg, layer, rope, inputs, plan layer, params, SEAL block, client, server keys, GPU block, GPU keys)."""
    from fhe.backends.gpu import GpuEvaluator
    from fhe.backends.seal.keys import CKKSClient

    cfg, layer, rope, x = load_layer(folder, index)
    lp = load_default_plan().layer(index)
    params = ckks_params_for(lp.approx.kind, lp.approx.squarings)
    cpu = EncryptedAttentionLayer(layer, rope, lp, cfg, params, max_tokens=1024)
    client = CKKSClient(params, cpu.key_levels.steps, levels=cpu.key_levels)
    server = client.server_keys()
    ev = GpuEvaluator(params, device=device, encoder="fft")
    gpu = EncryptedAttentionLayer(layer, rope, lp, cfg, params, max_tokens=1024, evaluator=ev)
    return cfg, layer, rope, x, lp, params, cpu, client, server, gpu, ev.keys_from_server(server)


#: --profile: the chunk's parts timed inclusive of what they call (a sync before and after each), by name
PHASES = (("fhe.packed", "PackedPrefill", "_project"), ("fhe.packed", "PackedPrefill", "_attend"),
          ("fhe.packed", "PackedPrefill", "_outputs"), ("fhe.packed", None, "encode_many"),
          ("fhe.packed", "PackedMap", "diagonals"), ("fhe.packed", None, "apply_packed"))


def phases(fn) -> dict:
    """One call of ``fn`` with each of :data:`PHASES` wrapped in synchronized timers: {name: [calls, s]}."""
    import importlib

    got: dict[str, list] = {}
    saved = []

    def timed(name, f):
        def wrapper(*a, **k):
            torch.cuda.synchronize()
            t = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                torch.cuda.synchronize()
                row = got.setdefault(name, [0, 0.0])
                row[0] += 1
                row[1] += time.perf_counter() - t
        return wrapper

    for mod, cls, attr in PHASES:
        owner = getattr(importlib.import_module(mod), cls) if cls else importlib.import_module(mod)
        saved.append((owner, attr, owner.__dict__[attr]))
        setattr(owner, attr, timed(attr, getattr(owner, attr)))
    try:
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        got["total"] = [1, time.perf_counter() - t]
    finally:
        for owner, attr, f in saved:
            setattr(owner, attr, f)
    return {k: [n, round(sec, 4)] for k, (n, sec) in got.items()}


def ab_group(args, packed_chunk, as_the_sdk, res: dict) -> None:
    """``fhe.packed.SHIFT_GROUP`` 0 (one band shift per gather and encode, as before session 19) against
    ``--ab-group`` (with ``--ab-rows``, ``BATCH_ROWS`` off against on), one run of each in turn (``--repeat``
    rounds), the chunk and the 32 tokens as the SDK sends them; whether their outputs are equal residue for residue."""
    from fhe import packed

    before, on, rows = (packed.SHIFT_GROUP, packed.BATCH_ROWS), args.ab_group, {}
    for name, fn in (("chunk", packed_chunk), ("as_sdk", as_the_sdk)):
        times: dict[str, list] = {"main": [], "new": []}
        outs = {}
        for _ in range(args.repeat + 1):                              # the first round: warm-up
            for var, group, batch in (("main", 0, False), ("new", on, args.ab_rows)):
                packed.SHIFT_GROUP, packed.BATCH_ROWS = group, batch
                sec, outs[var] = _median_s(fn, 1)
                times[var].append(round(sec, 4))
        packed.SHIFT_GROUP, packed.BATCH_ROWS = before
        rows[name] = {v: {"median_s": statistics.median(t[1:]), "all_s": t} for v, t in times.items()}
        rows[name]["same"] = all(torch.equal(a.data, b.data) for a, b in zip(outs["main"], outs["new"], strict=True))
    res["ab_shift_group"] = {"group": on, "batch_rows": args.ab_rows} | rows
    print(f"ab shift group: {json.dumps(res['ab_shift_group'])}", flush=True)


def ab_cache(args, gpu, packed_chunk, as_the_sdk, res: dict) -> None:
    """``--ab-cache``: three variants, one run of each in turn (``--repeat`` rounds after a warm-up round, whose
    "new" run fills the layer's cache): "main" (``fhe.packed.PLAIN_CACHE_BYTES`` 0, ``STACK_BABIES`` off: main's
    path), "stack" (the babies stacked once per map) and "new" (that and ``args.ab_cache`` GiB of kept diagonals),
    the chunk and the 32 tokens as the SDK sends them; whether every variant's outputs equal main's residue for
    residue; the cache's counters."""
    from fhe import packed

    before = packed.PLAIN_CACHE_BYTES, packed.STACK_BABIES
    on = int(args.ab_cache * (1 << 30))
    variants = {"main": (0, False), "stack": (0, True), "new": (on, True)}
    rows: dict = {}
    for name, fn in (("chunk", packed_chunk), ("as_sdk", as_the_sdk)):
        times: dict[str, list] = {v: [] for v in variants}
        outs = {}
        for _ in range(args.repeat + 1):                              # the first round: warm-up
            for var, (budget, stack) in variants.items():
                packed.PLAIN_CACHE_BYTES, packed.STACK_BABIES = budget, stack
                try:
                    sec, outs[var] = _median_s(fn, 1)
                finally:
                    packed.PLAIN_CACHE_BYTES, packed.STACK_BABIES = before
                times[var].append(round(sec, 4))
        rows[name] = {v: {"median_s": statistics.median(t[1:]), "all_s": t} for v, t in times.items()}
        rows[name]["same"] = {v: all(torch.equal(a.data, b.data) for a, b in zip(outs["main"], outs[v], strict=True))
                              for v in variants if v != "main"}
        print(f"ab cache {name}: {json.dumps(rows[name])}", flush=True)
    store = gpu.packed_plaintexts                                     # None: no map was ever kept
    rows["cache"] = {"entries": len(store), "bytes": store.nbytes, "hits": store.hits,
                     "misses": store.misses} if store is not None else None
    rows["device_max_allocated"] = torch.cuda.max_memory_allocated() if args.device == "cuda" else None
    res["ab_cache"] = {"budget_bytes": on} | rows
    print(f"ab cache: {json.dumps(res['ab_cache'])}", flush=True)


#: --ab-main: main's switches (as merged before session 20), set before each of main's runs on its own evaluator
MAIN_SWITCHES = {("fhe.backends.gpu.triton_ops", "LAZY"): False, ("fhe.backends.gpu.triton_ops", "SKIP_DIAG"): False,
                 ("fhe.backends.gpu.triton_ops", "FUSED_FINISH"): False,
                 ("fhe.backends.gpu.keyswitch", "FUSED_CORRECTION"): False, ("fhe.packed", "SHIFT_GROUP"): 0,
                 ("fhe.packed", "BATCH_ROWS"): False, ("fhe.backends.gpu.triton_ops", "LOCAL_WARPS"): 4}


def ab_main(args, s: dict, chunk, rest, res: dict) -> None:
    """``--ab-main``: main's switches (:data:`MAIN_SWITCHES`) on a second evaluator, block and key set object (its
    graphs hold main's kernels) against this tree's defaults on the first, one run of each in turn (``--repeat``
    rounds after a warm-up round), the chunk and the 32 tokens as the SDK sends them; outputs equal residue for
    residue?"""
    import importlib

    from fhe.backends.gpu import GpuEvaluator

    ev = GpuEvaluator(s["params"], device=args.device, encoder="fft")
    blocks = {"main": EncryptedAttentionLayer(s["layer"], s["rope"], s["lp"], s["cfg"], s["params"], max_tokens=1024,
                                              evaluator=ev), "new": s["gpu"]}
    keys = {"main": ev.keys_from_server(s["server"]), "new": s["keys"]}
    saved = {k: getattr(importlib.import_module(k[0]), k[1]) for k in MAIN_SWITCHES}
    switches = {"main": MAIN_SWITCHES, "new": saved}
    b = s["gpu"].packed_chunk

    def switch(values):
        for (mod, attr), v in values.items():
            setattr(importlib.import_module(mod), attr, v)

    def run(var, sdk):
        blk, k = blocks[var], keys[var]
        cache = blk.new_cache()
        out = blk.prefill_packed(cache, chunk, 0, b, k)
        return out + blk.prefill(cache, rest, b, k) if sdk else out

    rows = {}
    for name, sdk in (("chunk", False), ("as_sdk", True)):
        times: dict[str, list] = {"main": [], "new": []}
        outs = {}
        for _ in range(args.repeat + 1):                              # the first round: warm-up
            for var in ("main", "new"):
                switch(switches[var])
                sec, outs[var] = _median_s(lambda var=var, sdk=sdk: run(var, sdk), 1)
                times[var].append(round(sec, 4))
        switch(saved)
        rows[name] = {v: {"median_s": statistics.median(t[1:]), "all_s": t} for v, t in times.items()}
        rows[name]["same"] = all(torch.equal(x.data, y.data) for x, y in zip(outs["main"], outs["new"], strict=True))
    res["ab_main"] = {v: {f"{m}.{a}": x for (m, a), x in sw.items()} for v, sw in switches.items()} | rows
    print(f"ab main: {json.dumps(res['ab_main'])}", flush=True)


def warm_sdk(args, ev, as_the_sdk, res: dict) -> None:
    """The 32 tokens as the SDK sends them once every whole-step graph of their single-token steps is captured
    (``packed_32_as_sdk_warm_s``): a worker that has run this prompt shape ``CAPTURE_AFTER`` times before, in any
    sessions (the graphs serve every session), replays them; ``packed_32_as_sdk_s`` above mixes the captures and
    eager first uses into its median. With the whole-step graphs' counters before and after (``step_graphs``)."""
    from fhe.backends.gpu import whole_step

    steps = ev.whole_steps
    if steps is None:
        return

    def counters() -> dict:
        return {k: getattr(steps, k) for k in ("captures", "replays", "eager", "fallbacks", "capture_s")}

    before = counters()
    for _ in range(whole_step.CAPTURE_AFTER):
        as_the_sdk()
    res["packed_32_as_sdk_warm_s"], _ = _median_s(as_the_sdk, args.repeat)
    res["step_graphs"] = {"before_warm": before, "after": counters(), "capture_after": whole_step.CAPTURE_AFTER}
    print(f"{res['tokens']} as the SDK sends them, graphs captured: {res['packed_32_as_sdk_warm_s']:.3f} s; "
          f"whole-step graphs {json.dumps(res['step_graphs'])}", flush=True)


def gpu_part(args, s: dict, res: dict) -> None:
    """The GPU timings and the fidelity checks (see the module docstring)."""
    cfg, layer, rope, x, lp, gpu, client, keys = (s[k] for k in ("cfg", "layer", "rope", "x", "lp", "gpu",
                                                                   "client", "keys"))
    ev, b = gpu.ev, gpu.packed_chunk
    bc = BlockClient.for_model(client, cfg, lp.approx.kind, lp.approx.squarings)
    xs = x[: args.tokens].double()
    chunk = [_to_gpu(ev, c) for c in bc.encrypt_packed(xs[:b])]
    rest = [_to_gpu(ev, c) for c in bc.encrypt_input(xs[b:])]
    singles = [_to_gpu(ev, c) for c in bc.encrypt_input(xs)]
    res |= {"chunk_tokens": b, "tokens": len(xs)}

    def packed_chunk():
        return gpu.prefill_packed(gpu.new_cache(), chunk, 0, b, keys)

    def as_the_sdk():                      # one packed chunk, then the rest one by one (PrivateRuntime._steps)
        cache = gpu.new_cache()
        return gpu.prefill_packed(cache, chunk, 0, b, keys) + gpu.prefill(cache, rest, b, keys)

    packed_chunk()                                                # warm-up: Triton compiles, graphs captured
    res["packed_chunk_s"], out = _median_s(packed_chunk, args.repeat)
    res["packed_32_as_sdk_s"], _ = _median_s(as_the_sdk, args.repeat)
    print(f"packed chunk of {b}: {res['packed_chunk_s']:.3f} s; {len(xs)} as the SDK sends them: "
          f"{res['packed_32_as_sdk_s']:.3f} s", flush=True)
    warm_sdk(args, ev, as_the_sdk, res)
    if args.ab_main:
        ab_main(args, s, chunk, rest, res)
    if args.ab_group:
        ab_group(args, packed_chunk, as_the_sdk, res)
    if args.ab_cache:
        ab_cache(args, gpu, packed_chunk, as_the_sdk, res)
    if args.quick:
        print(json.dumps(res), flush=True)
        return
    if args.profile and args.device == "cuda":
        from bench.gpu_decode import _profile

        res["chunk_phases"] = phases(packed_chunk)
        res["chunk_profile"] = _profile(packed_chunk)
        print(f"chunk phases: {json.dumps(res['chunk_phases'])}\nchunk profile: {json.dumps(res['chunk_profile'])}",
              flush=True)
    token_s, token_out = _median_s(lambda: gpu.prefill(gpu.new_cache(), singles, 0, keys), 1)
    res["token_path_s"] = token_s
    batched = ev.encode_many
    ev.encode_many = None                                         # fhe.evaluator.encode_many: one by one
    res["packed_chunk_one_by_one_encode_s"], _ = _median_s(packed_chunk, 1)
    ev.encode_many = batched
    got = _finish(bc, ev, client.kit, out)
    ref = _reference(layer, rope, lp, xs[:b])
    tok = _finish(bc, ev, client.kit, token_out[:b])
    span = float(ref.max() - ref.min())
    res |= {"output_range": span, "packed_vs_simulator_over_range": float((got - ref).abs().max()) / span,
            "packed_vs_token_path_over_range": float((got - tok).abs().max()) / span,
            "token_path_vs_simulator_over_range": float((tok - ref).abs().max()) / span}
    s["gpu_out"], s["chunk_inputs"] = got, bc.encrypt_packed(xs[:b])
    print(json.dumps(res), flush=True)


def seal_part(s: dict, res: dict) -> None:
    """The same chunk on the SEAL backend (CPU): decrypted difference to the GPU's over the range."""
    cpu, client, server, lp, cfg = s["cpu"], s["client"], s["server"], s["lp"], s["cfg"]
    bc = BlockClient.for_model(client, cfg, lp.approx.kind, lp.approx.squarings)
    b = res["chunk_tokens"]
    t = time.perf_counter()
    want = cpu.prefill_packed(cpu.new_cache(), s["chunk_inputs"], 0, b, server)
    res["seal_packed_chunk_s"] = time.perf_counter() - t
    y, z = bc.decrypt_output(want)
    seal_out = BlockClient.finish(y, z)
    res["gpu_vs_seal_over_range"] = float((s["gpu_out"] - seal_out).abs().max()) / res["output_range"]
    print(json.dumps({k: res[k] for k in ("seal_packed_chunk_s", "gpu_vs_seal_over_range")}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--export", type=Path, help="write layer 3's weights and 32 real inputs here and stop")
    ap.add_argument("--weights", type=Path, default=Path(".carry/gpufhe/packed"))
    ap.add_argument("--layer", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--skip-seal", action="store_true")
    ap.add_argument("--profile", action="store_true", help="the chunk's parts timed, its kernels profiled")
    ap.add_argument("--ab-group", type=int, default=0, help="fhe.packed.SHIFT_GROUP 0 against this, in turn")
    ap.add_argument("--ab-rows", action="store_true", help="with --ab-group: fhe.packed.BATCH_ROWS on in 'new'")
    ap.add_argument("--ab-cache", type=float, default=0.0,
                    help="fhe.packed.PLAIN_CACHE_BYTES 0 against this many GiB, in turn")
    ap.add_argument("--ab-main", action="store_true", help="main's switches, own evaluator, against the defaults")
    ap.add_argument("--quick", action="store_true", help="stop after the timings and A/Bs (no token path, fidelity)")
    ap.add_argument("--marker", type=Path, help="touched when the GPU part is done")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.export:
        export(args.export, [args.layer], args.tokens, 1)
        return
    torch.set_num_threads(1)                                  # SEAL's peer figure is one thread, as in a worker
    res: dict = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="minutes"),
                 "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "layer": args.layer}
    t = time.perf_counter()
    names = ("cfg", "layer", "rope", "x", "lp", "params", "cpu", "client", "server", "gpu", "keys")
    s = dict(zip(names, setup(args.weights, args.layer, args.device), strict=True))
    res["setup_s"] = time.perf_counter() - t
    try:
        gpu_part(args, s, res)
    finally:
        if args.out:
            args.out.write_text(json.dumps(res, indent=1))
        if args.marker:
            args.marker.touch()
    if not args.skip_seal:
        seal_part(s, res)
        if args.out:
            args.out.write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
