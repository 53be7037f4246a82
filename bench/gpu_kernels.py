"""GPU micro-benchmarks of ``kernels/``: achieved bandwidth against a measured device copy, same run.

For every case the inputs are fresh random bf16 data; block tables hand out blocks in random order. Times
are medians of ``triton.testing.do_bench`` (eager launches) and ``do_bench_cudagraph`` (the launches replayed
from a CUDA graph, as the engine's decode does). Small cases rotate through several copies of their
inputs (>= 256 MiB in all, 4x the H200's L2) and report time per copy, so they are not timed out of L2.
Bytes counted: what a kernel must move at least (each input read once, each output written once).

    python bench/gpu_kernels.py [--quick] [--out results.json]
    python bench/gpu_kernels.py --sweep     # time launch-parameter variants (how the defaults were picked)

Peers in the same run: the torch reference (what the CPU engine runs: gather + fp32 masked softmax) for
decode, ``F.scaled_dot_product_attention`` (causal, contiguous K/V; FlashAttention backend) for prefill,
the unfused torch ops for RMSNorm and RoPE.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench, do_bench_cudagraph

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kernels  # noqa: E402
from kernels.paged_decode import DecodeTuning, _paged_decode_triton  # noqa: E402
from kernels.paged_prefill import PrefillTuning, _paged_prefill_triton  # noqa: E402

MODELS = {"qwen2.5-0.5b": (14, 2, 64), "llama-3.2-1b": (32, 8, 64), "smollm2-135m": (9, 3, 64)}
HIDDEN = {"qwen2.5-0.5b": 896, "llama-3.2-1b": 2048, "smollm2-135m": 576}
ROTATE_BYTES = 256 << 20
BS = 16


def copy_bandwidth() -> float:
    """Device-to-device copy of 2 GiB, bytes read + written per second (median)."""
    x = torch.randn(1 << 30, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    ms = do_bench(lambda: y.copy_(x), return_mode="median")
    return 2 * x.numel() * 2 / (ms * 1e-3)


def rotations(nbytes: int) -> int:
    """Copies of a case's inputs needed to stream >= ROTATE_BYTES per timed call."""
    return max(1, min(256, math.ceil(ROTATE_BYTES / max(1, nbytes))))


def timed(fns: list) -> tuple[float, float]:
    """(eager ms, graph ms) per call, running every fn in `fns` once per timed call."""
    def run():
        for f in fns:
            f()
    eager = do_bench(run, return_mode="median") / len(fns)
    graph = do_bench_cudagraph(run, return_mode="median") / len(fns)
    return eager, graph


def decode_inputs(model: str, batch: int, ctx: int, gen: torch.Generator, width: int = 0) -> dict:
    """One decode batch: random bf16 caches, shuffled block tables (`width` columns, padded with 0 as
    the engine's CUDA graphs pad them), all contexts `ctx` long."""
    hq, hkv, d = MODELS[model]
    nblk = math.ceil(ctx / BS)
    nb = batch * nblk + 1
    kc = torch.randn(nb, BS, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    vc = torch.randn(nb, BS, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    perm = torch.randperm(nb, device="cuda", generator=gen)[: batch * nblk]
    tables = torch.zeros(batch, max(width, nblk), device="cuda", dtype=torch.int32)
    tables[:, :nblk] = perm.view(batch, nblk)
    return dict(q=torch.randn(batch, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen),
                k_cache=kc, v_cache=vc, block_tables=tables,
                context_lens=torch.full((batch,), ctx, device="cuda", dtype=torch.int32), scale=d**-0.5)


def bench_decode(model: str, batch: int, ctx: int, bw: float, with_ref: bool, gen) -> dict:
    hq, hkv, d = MODELS[model]
    nbytes = 2 * batch * ctx * hkv * d * 2 + 2 * batch * hq * d * 2 + batch * math.ceil(ctx / BS) * 4
    sets = [decode_inputs(model, batch, ctx, gen) for _ in range(rotations(nbytes))]
    outs = [torch.empty_like(s["q"]) for s in sets]
    fns = [lambda s=s, o=o: kernels.paged_decode_attention(**s, out=o)
           for s, o in zip(sets, outs, strict=True)]
    eager, graph = timed(fns)
    row = dict(kernel="decode", model=model, batch=batch, ctx=ctx, bytes=nbytes, eager_ms=eager,
               graph_ms=graph, bw_frac=nbytes / (graph * 1e-3) / bw)
    if with_ref:
        s = sets[0]
        row["ref_ms"] = do_bench(lambda: kernels.paged_decode_attention(**s, backend="torch"),
                                 return_mode="median")
    return row


def bench_prefill(model: str, q_lens: list[int], ctx_lens: list[int], gen) -> dict:
    """Varlen prefill over the paged cache vs SDPA (causal, contiguous) on the same chunks."""
    hq, hkv, d = MODELS[model]
    b = len(q_lens)
    nblk = max(math.ceil(c / BS) for c in ctx_lens)
    nb = b * nblk + 1
    kc = torch.randn(nb, BS, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    vc = torch.randn_like(kc)
    tables = torch.randperm(nb, device="cuda", generator=gen)[: b * nblk].view(b, nblk).int()
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    ctx = torch.tensor(ctx_lens, dtype=torch.int32, device="cuda")
    q = torch.randn(sum(q_lens), hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    out = torch.empty_like(q)
    ms = do_bench(lambda: kernels.paged_prefill_attention(q, kc, vc, tables, cu, ctx, d**-0.5, out=out,
                                                          max_seqlen_q=max(q_lens)), return_mode="median")
    pairs = list(zip(q_lens, ctx_lens, strict=True))
    flops = sum(4 * hq * d * sum(c - ql + i + 1 for i in range(ql)) for ql, c in pairs)  # causal QK and PV
    row = dict(kernel="prefill", model=model, q_lens=q_lens, ctx_lens=ctx_lens, ms=ms,
               tflops=flops / (ms * 1e-3) / 1e12)
    if all(ql == c for ql, c in pairs):  # SDPA has no paged/prefix form: full prompts only
        qs = [torch.randn(1, hq, ql, d, device="cuda", dtype=torch.bfloat16) for ql in q_lens]
        ks = [torch.randn(1, hkv, ql, d, device="cuda", dtype=torch.bfloat16) for ql in q_lens]

        def sdpa():
            for qq, kk in zip(qs, ks, strict=True):
                F.scaled_dot_product_attention(qq, kk, kk, is_causal=True, enable_gqa=True)
        row["sdpa_ms"] = do_bench(sdpa, return_mode="median")
    return row


def bench_store_kv(model: str, tokens: int, bw: float, gen) -> dict:
    _, hkv, d = MODELS[model]
    nb = math.ceil(tokens / BS) * 4
    kc = torch.randn(nb, BS, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    vc = torch.randn_like(kc)
    k = torch.randn(tokens, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn_like(k)
    slots = torch.randperm(nb * BS, device="cuda", generator=gen)[:tokens]
    nbytes = 2 * 2 * tokens * hkv * d * 2 + tokens * 8
    eager, graph = timed([lambda: kernels.store_kv(k, v, kc, vc, slots)])
    return dict(kernel="store_kv", model=model, tokens=tokens, bytes=nbytes, eager_ms=eager, graph_ms=graph,
                bw_frac=nbytes / (graph * 1e-3) / bw)


def bench_norm_rope(model: str, tokens: int, bw: float, gen) -> list[dict]:
    hq, hkv, d = MODELS[model]
    h = HIDDEN[model]
    x = torch.randn(tokens, h, device="cuda", dtype=torch.bfloat16, generator=gen)
    r, w = torch.randn_like(x), torch.randn(h, device="cuda", dtype=torch.bfloat16, generator=gen)
    rows = []
    fused = do_bench(lambda: kernels.add_rms_norm(x, r, w, 1e-5), return_mode="median")
    unfused = do_bench(lambda: kernels.add_rms_norm(x, r, w, 1e-5, backend="torch"), return_mode="median")
    nbytes = 4 * tokens * h * 2
    rows.append(dict(kernel="add_rms_norm", model=model, tokens=tokens, ms=fused, torch_ms=unfused,
                     bw_frac=nbytes / (fused * 1e-3) / bw))
    qkv = torch.randn(tokens, hq + 2 * hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    q, k = qkv[:, :hq], qkv[:, hq : hq + hkv]
    ang = torch.rand(tokens, d // 2, device="cuda", generator=gen) * 1000
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    fused = do_bench(lambda: kernels.rope(q, k, cos, sin), return_mode="median")
    unfused = do_bench(lambda: kernels.rope(q, k, cos, sin, backend="torch"), return_mode="median")
    nbytes = 2 * tokens * (hq + hkv) * d * 2 + 2 * tokens * d * 4
    rows.append(dict(kernel="rope", model=model, tokens=tokens, ms=fused, torch_ms=unfused,
                     bw_frac=nbytes / (fused * 1e-3) / bw))
    return rows


def print_tables(res: dict) -> None:
    bw = res["copy_bw"]
    print(f"\ncopy bandwidth (read + write, 2 GiB bf16): {bw / 1e12:.2f} TB/s  device: {res['device']}")
    print("\n| model | batch | ctx | KV+q+out MB | eager µs | graph µs | GB/s (graph) | % of copy bw "
          "| torch ref µs |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in res["rows"]:
        if r["kernel"] == "decode":
            ref = f"{r['ref_ms'] * 1e3:.0f}" if "ref_ms" in r else ""
            print(f"| {r['model']} | {r['batch']} | {r['ctx']} | {r['bytes'] / 1e6:.1f} "
                  f"| {r['eager_ms'] * 1e3:.1f} | {r['graph_ms'] * 1e3:.1f} "
                  f"| {r['bytes'] / r['graph_ms'] / 1e6:.0f} "
                  f"| {100 * r['bw_frac']:.0f}% | {ref} |")
    print("\n| prefill model | q lens | ctx lens | µs | TFLOP/s | SDPA µs |")
    print("|---|---|---|---|---|---|")
    for r in res["rows"]:
        if r["kernel"] == "prefill":
            sd = f"{r['sdpa_ms'] * 1e3:.0f}" if "sdpa_ms" in r else "n/a"
            print(f"| {r['model']} | {r['q_lens']} | {r['ctx_lens']} | {r['ms'] * 1e3:.0f} "
                  f"| {r['tflops']:.1f} "
                  f"| {sd} |")
    print("\n| kernel | model | tokens | µs | % of copy bw | unfused torch µs |")
    print("|---|---|---|---|---|---|")
    for r in res["rows"]:
        if r["kernel"] in ("store_kv", "add_rms_norm", "rope"):
            ms = r.get("graph_ms", r.get("ms"))
            other = f"{r['torch_ms'] * 1e3:.1f}" if "torch_ms" in r else ""
            print(f"| {r['kernel']} | {r['model']} | {r['tokens']} | {ms * 1e3:.1f} "
                  f"| {100 * r['bw_frac']:.0f}% | {other} |")


DECODE_VARIANTS = [DecodeTuning(), DecodeTuning(block_n=32), DecodeTuning(block_n=128),
                   DecodeTuning(num_warps=2), DecodeTuning(num_warps=8), DecodeTuning(programs_per_sm=2),
                   DecodeTuning(programs_per_sm=8), DecodeTuning(programs_per_sm=16),
                   DecodeTuning(min_partition=64), DecodeTuning(min_partition=256),
                   DecodeTuning(block_n=128, num_warps=8), DecodeTuning(block_n=128, programs_per_sm=8)]
# (model, batch, ctx, table width): the engine's graph buckets pad tables to max_model_len / BS
DECODE_SWEEP = [("qwen2.5-0.5b", 1, 384, 128), ("smollm2-135m", 1, 128, 8), ("smollm2-135m", 1, 384, 128),
                ("qwen2.5-0.5b", 64, 512, 0), ("qwen2.5-0.5b", 256, 384, 128), ("qwen2.5-0.5b", 64, 4096, 0),
                ("llama-3.2-1b", 256, 4096, 0)]
PREFILL_VARIANTS = [PrefillTuning(), PrefillTuning(128, 64, 8), PrefillTuning(128, 64, 4),
                    PrefillTuning(64, 32, 4), PrefillTuning(128, 128, 8), PrefillTuning(128, 64, 8, 2),
                    PrefillTuning(64, 64, 4, 2), PrefillTuning(128, 32, 4)]
PREFILL_SWEEP = [("qwen2.5-0.5b", [2048], [2048]), ("llama-3.2-1b", [2048], [2048]),
                 ("qwen2.5-0.5b", [128] * 16, [128] * 16), ("llama-3.2-1b", [512], [4096]),
                 ("smollm2-135m", [2048], [2048])]


def _decode_call(s: dict, tune: DecodeTuning):
    out = torch.empty_like(s["q"])
    return lambda: _paged_decode_triton(s["q"], s["k_cache"], s["v_cache"], s["block_tables"],
                                        s["context_lens"], s["scale"], None, out, tune)


def _sweep_decode_case(model: str, batch: int, ctx: int, width: int, gen) -> list[str]:
    """Graph-replay µs per call of every decode variant on one case."""
    _, hkv, d = MODELS[model]
    sets = [decode_inputs(model, batch, ctx, gen, width)
            for _ in range(rotations(2 * batch * ctx * hkv * d * 2))]
    return [f"{timed([_decode_call(s, t) for s in sets])[1] * 1e3:.1f}" for t in DECODE_VARIANTS]


def _sweep_prefill_case(model: str, q_lens: list[int], ctx_lens: list[int], gen) -> list[str]:
    """Eager µs of every prefill variant on one case."""
    hq, _, d = MODELS[model]
    s = decode_inputs(model, len(q_lens), max(ctx_lens), gen)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    ctx = torch.tensor(ctx_lens, dtype=torch.int32, device="cuda")
    q = torch.randn(sum(q_lens), hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    args = (q, s["k_cache"], s["v_cache"], s["block_tables"], cu, ctx, s["scale"], max(q_lens),
            torch.empty_like(q))
    return [f"{do_bench(lambda t=t: _paged_prefill_triton(*args, t), return_mode='median') * 1e3:.0f}"
            for t in PREFILL_VARIANTS]


def sweep(gen) -> None:
    """Graph-replay µs of each decode variant and eager µs of each prefill variant, one table each."""
    print("| decode case | " + " | ".join(str(i) for i in range(len(DECODE_VARIANTS))) + " |")
    for model, batch, ctx, width in DECODE_SWEEP:
        cells = _sweep_decode_case(model, batch, ctx, width, gen)
        print(f"| {model} B={batch} ctx={ctx} w={width} | " + " | ".join(cells) + " |", flush=True)
    for i, t in enumerate(DECODE_VARIANTS):
        print(f"decode variant {i}: {t}")
    print("\n| prefill case | " + " | ".join(str(i) for i in range(len(PREFILL_VARIANTS))) + " |")
    for model, q_lens, ctx_lens in PREFILL_SWEEP:
        cells = _sweep_prefill_case(model, q_lens, ctx_lens, gen)
        print(f"| {model} q={q_lens[0]}x{len(q_lens)} ctx={max(ctx_lens)} | " + " | ".join(cells) + " |",
              flush=True)
    for i, t in enumerate(PREFILL_VARIANTS):
        print(f"prefill variant {i}: {t}")


# (name, N, K, bias) of the batch-1 decode GEMMs, fused QKV / gate-up as engine.fused runs them
GEMV_SHAPES = [
    ("qwen qkv", 1152, 896, True), ("qwen o", 896, 896, False), ("qwen gate_up", 9728, 896, False),
    ("qwen down", 896, 4864, False), ("qwen lm_head", 151936, 896, False),
    ("llama qkv", 3072, 2048, False), ("llama o", 2048, 2048, False), ("llama gate_up", 16384, 2048, False),
    ("llama down", 2048, 8192, False), ("llama lm_head", 128256, 2048, False),
]
GEMV_VARIANTS = [kernels.GemvTuning(bn, bk, w, st) for bn in (1, 2, 4, 8, 16) for bk in (256, 512, 1024, 2048)
                 for w in (4, 8) for st in (1, 3) if bn * bk <= 8192]


def _graph_us(fn, calls: int) -> float:
    """µs per call of `fn(i)` for i in range(calls), captured in one CUDA graph (median of 7 replays)."""
    fn(0)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fn(i)
    g.replay()
    ts = []
    for _ in range(7):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / calls)
    return sorted(ts)[3]


def _gemv_case(name: str, n: int, k: int, has_bias: bool) -> dict:
    copies = rotations(n * k * 2)
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16) if has_bias else None
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
    ref = F.linear(x.double(), ws[0].double(), None if bias is None else bias.double())
    err = float((kernels.gemv(x, ws[0], bias).double() - ref).norm() / ref.norm())
    calls = max(copies, 8)
    cublas = _graph_us(lambda i: F.linear(x, ws[i % copies], bias), calls)
    default = _graph_us(lambda i: kernels.gemv(x, ws[i % copies], bias, out=out), calls)
    timed = [(_graph_us(lambda i, t=t: kernels.gemv(x, ws[i % copies], bias, out=out, tuning=t), calls), t)
             for t in GEMV_VARIANTS]
    best = min(timed, key=lambda r: r[0])
    gbps = {key: n * k * 2 / (us * 1e-6) / 1e9 for key, us in (("cublas", cublas), ("gemv", default),
                                                                ("best", best[0]))}
    print(f"| {name} {n}x{k} | {cublas:.1f} ({gbps['cublas']:.0f}) | {default:.1f} ({gbps['gemv']:.0f}) | "
          f"{best[0]:.1f} ({gbps['best']:.0f}) {best[1]} | {err:.1e} |", flush=True)
    return dict(case=name, n=n, k=k, cublas_us=cublas, gemv_us=default, best_us=best[0],
                best=dataclasses.asdict(best[1]), rel_err=err, GBps=gbps,
                all_us={str(dataclasses.astuple(t)): us for us, t in timed})


def gemv_sweep(bw: float) -> list[dict]:
    """Batch-1 GEMMs: cuBLAS (F.linear) vs kernels.gemv (default tuning, best variant), weights rotated."""
    return [_gemv_case(*shape) for shape in GEMV_SHAPES]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer cases")
    ap.add_argument("--out", default=None, help="write all numbers as JSON here")
    ap.add_argument("--sweep", action="store_true", help="time launch-parameter variants instead")
    ap.add_argument("--gemv", action="store_true", help="only the batch-1 GEMM table (cuBLAS vs kernels.gemv)")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    if args.gemv:
        bw = copy_bandwidth()
        print(f"copy bandwidth {bw / 1e9:.0f} GB/s\n| GEMM N x K | cuBLAS µs (GB/s) | gemv µs (GB/s) | best µs | err |")
        rows = gemv_sweep(bw)
        if args.out:
            Path(args.out).write_text(json.dumps(dict(device=torch.cuda.get_device_name(), copy_bw=bw, rows=rows),
                                                 indent=1))
        return
    if args.sweep:
        sweep(gen)
        return
    t0 = time.time()
    bw = copy_bandwidth()
    rows = []
    models = ["qwen2.5-0.5b", "llama-3.2-1b"] if args.quick else list(MODELS)
    ctxs = [128, 1024, 4096] if args.quick else [128, 512, 1024, 2048, 4096]
    for model in models:
        for batch in (1, 64, 256):
            for ctx in ctxs:
                rows.append(bench_decode(model, batch, ctx, bw, with_ref=ctx in (128, 4096), gen=gen))
                print(json.dumps(rows[-1]), flush=True)
        for q_lens, ctx_lens in (([512], [512]), ([2048], [2048]), ([128] * 16, [128] * 16),
                                 ([512], [4096]), ([256] * 4, [1024, 2048, 3072, 4096])):
            rows.append(bench_prefill(model, q_lens, ctx_lens, gen))
            print(json.dumps(rows[-1]), flush=True)
        for tokens in (256, 4096):
            rows.append(bench_store_kv(model, tokens, bw, gen))
            rows.extend(bench_norm_rope(model, tokens, bw, gen))
            print(json.dumps(rows[-3:]), flush=True)
    res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, copy_bw=bw, rows=rows,
               seconds=time.time() - t0)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    print_tables(res)


if __name__ == "__main__":
    main()
