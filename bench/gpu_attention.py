"""The encrypted attention block of SmolLM2-135M on our gpu backend (CUDA) against the SEAL backend,
plus the 576x576 encrypted matmul against TenSEAL's ``mm`` and multi-session decode: one run.

    # here (the machine with the cached model): real layer weights + real block inputs, ~8 MB
    python bench/gpu_attention.py --export .carry/smollm2
    # on the GPU machine (tenseal/zstandard carried as wheels)
    python3 bench/gpu_attention.py --weights .carry/smollm2 --out result.json

What it measures, at the shipped plan's parameters (N = 32768, level-aware keys):

* ``block``: layer ``--layer``'s block on its real weights, fed the real normalized hidden states of the
  first ``--tokens`` tokens of a chat prompt (computed here by the plaintext model, layers before it):
  prefill on SEAL (CPU) and on the GPU from the same client ciphertexts and keys; every output
  ciphertext compared residue by residue, and the decrypted outputs' largest difference over their range.
* ``decode``: one token through the block on the GPU at each of ``--contexts`` (cache filled with
  encrypted random blocks: a step's cost does not depend on values), median of ``--repeat``; a 32-token
  prefill.
* ``sessions``: S sessions at context 128 each stepping one token, one after another on one GPU
  (aggregate tokens/s per layer), and the device bytes each session's cache takes.
* ``matmul``: x @ W for W 576x576 at N = 8192 (TenSEAL's tutorial parameters): ours on the GPU in each of
  ``--matmul-variants`` (:data:`MATMUL_VARIANTS`: hoisted babies or not, the whole product as one CUDA graph or
  op by op, the one-launch staged NTT stages or not, batched key switches or not; each its own evaluator and
  key copy, median of
  ``--matmul-repeat``, its kernels under torch's profiler), ours on SEAL (CPU, the same two structures),
  TenSEAL ``CKKSVector.mm`` (median of ``--tenseal-repeat``); max error vs numpy; each GPU variant = the SEAL
  backend's product of the same structure, bit for bit.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from engine.config import ModelConfig
from engine.model import DecoderLayer, RotaryEmbedding
from fhe.attention import BlockClient, EncryptedAttentionLayer
from fhe.params import CKKSParams, ckks_params_for
from fhe.plan import load_default_plan

MATMUL_PARAMS = CKKSParams(8192, (60, 40, 40, 60), 40)


# --- export (runs where the default model is cached) ---------------------------------------------------
def export(folder: Path, layers: list[int], tokens: int, prompt: int) -> None:
    """Write the layers' attention weights, the config and their real block inputs to ``folder``."""
    from safetensors.torch import save_file

    from engine.default_model import default_model_dir
    from engine.loader import load_model
    from engine.model import DenseKVCache
    from engine.tokenizer import Tokenizer
    from fhe.calibrate import load_prompts

    model = load_model(default_model_dir())
    tok = Tokenizer.from_folder(default_model_dir())
    chat = [{"role": "user", "content": load_prompts("evaluation")[prompt]}]
    ids = torch.tensor(tok.apply_chat_template(chat)[:tokens])
    folder.mkdir(parents=True, exist_ok=True)
    state = {}
    with torch.inference_mode():
        for i in layers:
            h = model.run_layers(model.embed(ids), torch.arange(len(ids)), DenseKVCache(model.config, len(ids)), 0, i)
            state[f"input.{i}"] = model.layers[i].input_layernorm.normalize(h).contiguous()
            state |= {f"layers.{i}.{k}": v.contiguous() for k, v in model.layers[i].state_dict().items()
                      if k.startswith(("self_attn.", "input_layernorm."))}
    save_file(state, str(folder / "layers.safetensors"))
    (folder / "config.json").write_text((default_model_dir() / "config.json").read_text())
    print(f"wrote {folder}: layers {layers}, {tokens} tokens")


def load_layer(folder: Path, index: int) -> tuple[ModelConfig, DecoderLayer, RotaryEmbedding, torch.Tensor]:
    """(config, decoder layer with its real attention weights, rotary, real block input [T, hidden])."""
    from safetensors.torch import load_file

    cfg = ModelConfig.from_file(folder / "config.json")
    state = load_file(str(folder / "layers.safetensors"))
    layer = DecoderLayer(cfg, index)
    prefix = f"layers.{index}."
    missing = layer.load_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)},
                                    strict=False).missing_keys
    assert all(k.startswith(("mlp.", "post_attention")) for k in missing), missing   # attention is all there
    return cfg, layer, RotaryEmbedding(cfg), state[f"input.{index}"]


# --- helpers ---------------------------------------------------------------------------------------------
def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _median_s(fn, repeat: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeat):
        _sync()
        t = time.perf_counter()
        out = fn()
        _sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def _to_gpu(ev, ct):
    from fhe.backends.seal import hazmat as seal

    return ev.deserialize(seal.to_bytes(ct))


def _to_seal(ev, kit, ct):
    from fhe.backends.seal import hazmat as seal

    return seal.from_bytes("ciphertext", kit, ev.serialize(ct))


def fill_cache(block, client, cache, tokens: int, rng) -> None:
    """``tokens`` tokens' worth of encrypted random K/V blocks in a GPU session cache."""
    geo, lay, ev = block.geo, block.geo.layout, block.ev
    full, rest = divmod(tokens, lay.block_tokens)
    for rows in [lay.block_tokens] * full + ([rest] if rest else []):
        k = ev.mod_switch(_to_gpu(ev, client.encrypt(lay.valid(rows) * rng.standard_normal(lay.slots) * 0.1)),
                          geo.level_qk)
        v = ev.mod_switch(_to_gpu(ev, client.encrypt(lay.valid(rows) * rng.standard_normal(lay.slots))), geo.level_p)
        ev.set_scale(k, ev.scale)
        ev.set_scale(v, ev.scale)
        cache.k_blocks.append(k)
        cache.v_blocks.append(v)
    cache.length = tokens


# --- the block: SEAL vs GPU on real weights ---------------------------------------------------------------
def bench_block(args, folder: Path) -> dict:
    from fhe.backends.gpu import GpuEvaluator
    from fhe.backends.seal.keys import CKKSClient

    cfg, layer, rope, x = load_layer(folder, args.layer)
    plan = load_default_plan()
    lp = plan.layer(args.layer)
    params = ckks_params_for(lp.approx.kind, lp.approx.squarings)
    res: dict = {"layer": args.layer, "params": params.to_dict(), "plan": plan.content_hash}
    t = time.perf_counter()
    cpu = EncryptedAttentionLayer(layer, rope, lp, cfg, params, max_tokens=1024)
    res["seal_setup_s"] = time.perf_counter() - t
    t = time.perf_counter()
    client = CKKSClient(params, cpu.key_levels.steps, levels=cpu.key_levels)
    server = client.server_keys()
    res["keygen_s"] = time.perf_counter() - t
    ev = GpuEvaluator(params, device=args.device)
    t = time.perf_counter()
    gpu = EncryptedAttentionLayer(layer, rope, lp, cfg, params, max_tokens=1024, evaluator=ev)
    res["gpu_setup_s"] = time.perf_counter() - t
    t = time.perf_counter()
    keys = ev.keys_from_server(server)
    _sync()
    res |= {"key_load_s": time.perf_counter() - t, "key_device_bytes": keys.nbytes()}
    bc = BlockClient.for_model(client, cfg, lp.approx.kind, lp.approx.squarings)
    xs = x[: args.tokens].double()
    inputs = bc.encrypt_input(xs)
    t = time.perf_counter()
    want = cpu.prefill(cpu.new_cache(), inputs, 0, server)
    res["seal_prefill_s"] = time.perf_counter() - t
    gin = [_to_gpu(ev, c) for c in inputs]
    gpu.prefill(gpu.new_cache(), gin, 0, keys)                        # warm-up: Triton compiles, graphs captured
    res["gpu_prefill_s"], got = _median_s(lambda: gpu.prefill(gpu.new_cache(), gin, 0, keys), 1)
    res["bit_identical"] = all(ev.serialize(o) == ev.serialize(_to_gpu(ev, w)) for o, w in zip(got, want, strict=True))
    y, z = bc.decrypt_output([_to_seal(ev, client.kit, c) for c in got])
    y0, z0 = bc.decrypt_output(want)
    out, out0 = BlockClient.finish(y, z), BlockClient.finish(y0, z0)
    ref = _reference(layer, rope, lp, xs)
    res |= {"tokens": len(xs), "max_abs_diff_gpu_vs_seal": float((out - out0).abs().max()),
            "output_range": float(out0.max() - out0.min()),
            "max_abs_err_vs_simulator": float((out0 - ref).abs().max())}
    res["max_diff_over_range"] = res["max_abs_diff_gpu_vs_seal"] / res["output_range"]
    print(json.dumps(res), flush=True)
    # the same block with the on-device encoder (GpuEvaluator(encoder="fft")): same keys, same inputs
    fast_ev = GpuEvaluator(params, device=args.device, encoder="fft")
    fast = EncryptedAttentionLayer(layer, rope, lp, cfg, params, max_tokens=1024, evaluator=fast_ev)
    fin = [_to_gpu(fast_ev, c) for c in inputs]
    fast.prefill(fast.new_cache(), fin, 0, keys)
    res["fft_encoder_prefill_s"], got = _median_s(lambda: fast.prefill(fast.new_cache(), fin, 0, keys), 1)
    y, z = bc.decrypt_output([_to_seal(fast_ev, client.kit, c) for c in got])
    res["fft_encoder_bit_identical"] = all(fast_ev.serialize(o) == fast_ev.serialize(_to_gpu(fast_ev, w))
                                           for o, w in zip(got, want, strict=True))
    res["fft_encoder_max_diff_over_range"] = float((BlockClient.finish(y, z) - out0).abs().max()) / res["output_range"]
    print(json.dumps({k: v for k, v in res.items() if k.startswith("fft")}), flush=True)
    res["seal_encoder"] = bench_decode(args, gpu, client, bc, keys, cfg, full=False)
    res |= bench_decode(args, fast, client, bc, keys, cfg)
    return res


def _reference(layer, rope, lp, xs):
    from fhe.simulator import finish, simulate_block

    ys, zs, _ = simulate_block(layer, rope, xs.float(), torch.arange(len(xs)), None, lp)
    return finish(ys, zs).double()


def bench_decode(args, block, client, bc, keys, cfg, full: bool = True) -> dict:
    """Decode per token at each context; ``full``: also a time profile by operation, a 32-token prefill,
    then S sessions at context 128."""
    rng = np.random.default_rng(0)
    ev = block.ev
    x = torch.randn(1, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    x = x / x.pow(2).mean().sqrt()
    res: dict = {"decode_ms": {}}
    for ctx in [int(c) for c in args.contexts.split(",")]:
        cache = block.new_cache()
        fill_cache(block, client, cache, ctx - 1, rng)
        ct = _to_gpu(ev, bc.encrypt_input(x)[0])
        snap = (list(cache.k_blocks), list(cache.v_blocks), cache.length)

        def step(cache=cache, snap=snap, ct=ct, ctx=ctx):
            cache.k_blocks, cache.v_blocks, cache.length = list(snap[0]), list(snap[1]), snap[2]
            return block.forward(cache, ct, ctx - 1, keys)

        step()
        res["decode_ms"][ctx] = 1e3 * _median_s(step, args.repeat)[0]
        print(f"decode @ context {ctx}: {res['decode_ms'][ctx]:.1f} ms", flush=True)
        if full and ctx == 128:
            res["profile_ms_at_128"] = profile(ev, step)
    if not full:
        return res
    if args.prefill:
        xs = torch.randn(args.prefill, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
        cts = [_to_gpu(ev, c) for c in bc.encrypt_input(xs / xs.pow(2).mean(-1, keepdim=True).sqrt())]
        sec, _ = _median_s(lambda: block.prefill(block.new_cache(), cts, 0, keys), 1)
        res["prefill"] = {"tokens": args.prefill, "s": sec, "ms_per_token": 1e3 * sec / args.prefill}
        print(f"prefill {args.prefill}: {sec:.2f} s", flush=True)
    res["sessions"] = bench_sessions(args, block, client, bc, keys, x, rng)
    return res


_OPS = ("encode", "add", "add_inplace", "add_many", "add_plain", "add_plain_inplace", "mul_plain", "dot_plain",
        "mul", "square", "relinearize", "rescale", "rescale_inplace", "mod_switch", "rotate", "rotate_many")


def profile(ev, step) -> dict:
    """Synchronized wall ms and calls per evaluator operation over one call of ``step`` (outermost calls
    only: dot_plain's own mul_plains count in dot_plain)."""
    totals: dict[str, list] = {}
    depth = [0]
    originals = {name: getattr(ev, name) for name in _OPS}

    def wrap(name, fn):
        def timed(*a, **k):
            if depth[0]:
                return fn(*a, **k)
            depth[0] += 1
            _sync()
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                _sync()
                depth[0] -= 1
                row = totals.setdefault(name, [0, 0.0])
                row[0] += 1
                row[1] += 1e3 * (time.perf_counter() - t)
        return timed

    for name, fn in originals.items():
        setattr(ev, name, wrap(name, fn))
    try:
        _sync()
        t = time.perf_counter()
        step()
        _sync()
        wall = 1e3 * (time.perf_counter() - t)
    finally:
        for name in originals:
            delattr(ev, name)
    out = {name: {"calls": c, "ms": round(ms, 2)} for name, (c, ms) in sorted(totals.items(), key=lambda kv: -kv[1][1])}
    out["wall_ms"] = round(wall, 2)
    print("profile @128:", json.dumps(out), flush=True)
    return out


def bench_sessions(args, block, client, bc, keys, x, rng) -> list[dict]:
    """S independent sessions at context 128, each one decode step, back to back on one GPU."""
    ev, rows = block.ev, []
    ctx = 128
    for s in [int(v) for v in args.sessions.split(",")]:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        caches = []
        for _ in range(s):
            cache = block.new_cache()
            fill_cache(block, client, cache, ctx - 1, rng)
            caches.append(cache)
        torch.cuda.synchronize()
        per_session = (torch.cuda.memory_allocated() - before) / s
        cts = [_to_gpu(ev, bc.encrypt_input(x)[0]) for _ in range(s)]
        torch.cuda.synchronize()
        t = time.perf_counter()
        for cache, ct in zip(caches, cts, strict=True):
            block.forward(cache, ct, ctx - 1, keys)
        torch.cuda.synchronize()
        sec = time.perf_counter() - t
        rows.append({"sessions": s, "context": ctx, "seconds": sec, "tokens_per_s_per_layer": s / sec,
                     "device_bytes_per_session_cache": per_session,
                     "peak_device_bytes": torch.cuda.max_memory_allocated()})
        print(f"{s} sessions: {s / sec:.1f} tokens/s per layer, {per_session / 1e6:.0f} MB per session", flush=True)
        del caches, cts
    return rows


# --- the 576x576 matmul -----------------------------------------------------------------------------------
#: matmul variants: name -> (hoisted babies (with batch: and giants each its own key, ``giants_each``), the whole
#: product as one graph replay, triton_ops.STRIDED, evaluator.BATCH_SWITCHES). Session 18's run (commit 34bbe57)
#: had "hoist", "hoist+graph" (hoisted, not strided) and no batch variant; session 19's (commit 1947ce4) also
#: "+reg" (the NTT's stages on register-held blocks: 1.27 vs 1.24 ms, removed since).
MATMUL_VARIANTS = {
    "plain": (False, False, False, False),      # main before session 18: ops one by one (each its own graph)
    "graph": (False, True, False, False),       # the same ops, the whole product one graph (run_step)
    "graph+strided": (False, True, True, False),  # + the NTT's staged stages in one launch
    "hoist+graph+strided": (True, True, True, False),  # babies by rotate_many, giants one key each
    "hoist+graph+strided+batch": (True, True, True, True),  # + their key switches finished as batches
}


def _kernels(fn) -> dict:
    """Kernels launched by one call of ``fn`` and their summed device time (torch's profiler)."""
    from torch.profiler import ProfilerActivity, profile

    _sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        _sync()
    ks = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return {"kernels": len(ks), "kernel_ms": round(sum(e.device_time for e in ks) / 1e3, 3)}


def bench_matmul(args) -> dict:
    import tenseal as ts

    from fhe.backends import evaluator_for
    from fhe.backends.gpu import GpuEvaluator, evaluator, triton_ops, whole_step
    from fhe.backends.seal.keys import CKKSClient
    from fhe.linalg import PlainMatrix

    rng = np.random.default_rng(0)
    w = rng.standard_normal((576, 576)) / np.sqrt(576)
    x = rng.standard_normal(576)
    seal_ev = evaluator_for(MATMUL_PARAMS, "seal")
    shapes = {(False, False), (True, False), (True, True)}                 # (hoist, giants_each)
    seal_pm = {h: PlainMatrix(seal_ev, w, hoist=h[0], giants_each=h[1]) for h in shapes}
    steps = tuple(sorted(set().union(*(pm.rotation_steps for pm in seal_pm.values()))))
    client = CKKSClient(MATMUL_PARAMS, steps)
    server = client.server_keys()
    ct = client.encrypt(seal_pm[False, False].layout(x))
    ref = x @ w
    out: dict = {"params": MATMUL_PARAMS.to_dict(), "rotation_keys": len(steps), "variants": {}}
    seal_out = {}
    for h, pm in seal_pm.items():
        t = time.perf_counter()
        seal_out[h] = pm(ct, server)
        out[f"seal_ms{'_hoist' if h[0] else ''}{'_giants_each' if h[1] else ''}"] = 1e3 * (time.perf_counter() - t)
    whole_step.CAPTURE_AFTER = 1
    saved = triton_ops.STRIDED, evaluator.BATCH_SWITCHES
    for name in args.matmul_variants.split(","):
        hoist, graph, strided, batch = MATMUL_VARIANTS[name]
        triton_ops.STRIDED, evaluator.BATCH_SWITCHES = strided, batch
        ev = GpuEvaluator(MATMUL_PARAMS, device=args.device)           # its own graphs and keys per variant
        pm = PlainMatrix(ev, w, hoist=hoist, giants_each=batch)
        keys = ev.load_keys(dict(client.public_blobs), steps)
        gct = _to_gpu(ev, ct)
        if graph:
            def fn(pm=pm, ev=ev, gct=gct, keys=keys):
                return ev.run_step(lambda e, ins, k: [pm.encoded(e, ins[0], k)], [gct], keys)[0]
        else:
            def fn(pm=pm, gct=gct, keys=keys):
                return pm(gct, keys)
        for _ in range(3):
            fn()                                                       # warm-up: compiles, captures
        sec, gout = _median_s(fn, args.matmul_repeat)
        dec = client.decrypt(_to_seal(ev, client.kit, gout))
        row = {"gpu_ms": round(1e3 * sec, 3),
               "bit_identical": ev.serialize(gout) == ev.serialize(_to_gpu(ev, seal_out[hoist, hoist and batch])),
               "gpu_max_err": float(np.abs(pm.extract(dec) - ref).max()),
               "key_switches": _count_switches(pm)}
        if args.device == "cuda":
            row |= _kernels(fn)
        out["variants"][name] = row
        print(f"matmul {name}: {json.dumps(row)}", flush=True)
    triton_ops.STRIDED, evaluator.BATCH_SWITCHES = saved
    ctx = ts.context(ts.SCHEME_TYPE.CKKS, MATMUL_PARAMS.poly_modulus_degree,
                     coeff_mod_bit_sizes=list(MATMUL_PARAMS.coeff_mod_bit_sizes))
    ctx.global_scale = 2.0 ** MATMUL_PARAMS.scale_bits
    ctx.generate_galois_keys()
    v, wl = ts.ckks_vector(ctx, x.tolist()), w.tolist()
    ts_s, tout = _median_s(lambda: v.mm(wl), args.tenseal_repeat)
    out |= {"tenseal_mm_ms": 1e3 * ts_s, "tenseal_repeat": args.tenseal_repeat,
            "tenseal_max_err": float(np.abs(np.asarray(tout.decrypt()) - ref).max())}
    for row in out["variants"].values():
        row["tenseal_over_gpu"] = round(ts_s * 1e3 / row["gpu_ms"], 1)
    return out


def _count_switches(pm) -> int:
    """Key switches of one product: babies + giants - 1 (+ pre) + the fold's rotate-and-adds (hoisted babies share
    one decomposition, batched ones one finish: still one switch each here)."""
    st = pm.mv.map.steps
    babies = st.n_baby * st.n_mid - 1
    return babies + (st.n_giant - 1) + (1 if st.pre and not st.hoist else 0) + pm.mv.fold.bit_length() - 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--export", type=Path, help="write real weights and inputs here and stop")
    ap.add_argument("--weights", type=Path, default=Path(".carry/smollm2"))
    ap.add_argument("--layer", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=2, help="real tokens through SEAL and the GPU")
    ap.add_argument("--contexts", default="16,128,512")
    ap.add_argument("--prefill", type=int, default=32)
    ap.add_argument("--sessions", default="1,8,32")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--skip", default="", help="comma list of parts to skip: matmul,block")
    ap.add_argument("--device", default="cuda", help="cpu: the torch reference (a dry run, slow)")
    ap.add_argument("--matmul-variants", default=",".join(MATMUL_VARIANTS))
    ap.add_argument("--matmul-repeat", type=int, default=20)
    ap.add_argument("--tenseal-repeat", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.export:
        export(args.export, [2, 3], 8, 1)
        return
    torch.set_num_threads(1)                           # SEAL's peer figures are one thread, as in production
    res = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="minutes"),
           "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu"}
    skip = set(args.skip.split(","))

    def save() -> None:
        if args.out:
            Path(args.out).write_text(json.dumps(res, indent=1))

    for name, fn in (("matmul", lambda: bench_matmul(args)), ("block", lambda: bench_block(args, args.weights))):
        if name in skip:
            continue
        try:
            res[name] = fn()
        except Exception as exc:  # report and go on: one run holds every part
            import traceback

            traceback.print_exc()
            res[name] = {"error": repr(exc)}
        print(json.dumps(res[name]), flush=True)
        save()
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
