"""FP8 (e4m3) weights on the GPU, one run: the layer GEMMs alone, then the engine (issue 19.3).

1. Ceilings: device copy bandwidth, dense bf16 (``torch.mm``) and fp8 (``torch._scaled_mm``, row-wise
   scales) matrix rates at 8192^3 on random data (``bench.engine_gpu.matmul_peaks``).
2. Per layer GEMM of each shape (qkv, o, gate_up, down, head), timed in CUDA graphs over weight copies
   larger than L2 (``bench.gemv_int4_gpu.graph_us``): one row through the bf16 ``kernels.gemv`` and through
   ``kernels.gemv_fp8`` at each of ``TUNINGS`` (each checked against the fp64 reference on a fresh x with a
   poisoned output first; the best is recorded with ``kernels.set_tuning_fp8`` for the engine rows), the
   fp8 GEMV at 2/4/8 rows vs the W8A8 path (row quantizer + ``_scaled_mm``) at 1-16 rows (where
   ``engine.fp8.GEMV_MAX_ROWS`` should sit), and 256 rows through cuBLAS bf16 vs the W8A8 path.
3. The engine: batch-1 decode step per format (``bench.int4_gpu.engine_row``: bf16, fp8, int4; the int4 GEMV
   at its default tuning) and 256 requests x (128 prompt + 256 output) tokens (``bench.engine_gpu.bench_shape``;
   bf16 and fp8), each as a share of its floor.

    python -m bench.gemv_fp8_gpu --shapes llama3.2-1b,qwen2.5-0.5b --json $OUT/fp8.json
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import torch
import torch.nn.functional as F

import kernels
from bench import engine_gpu
from bench.engine_gpu import copy_bandwidth, matmul_peaks
from bench.gemv_int4_gpu import LAUNCHES, gemm_shapes, graph_us
from engine.fp8 import Fp8Linear

TUNINGS = [kernels.GemvFp8Tuning(bn, bk, w, st) for bn, bk, w, st in (
    (4, 1024, 4, 3), (2, 1024, 4, 3), (8, 512, 4, 3), (4, 2048, 8, 2), (8, 1024, 8, 3), (16, 512, 8, 3))]


def check(x: torch.Tensor, lin: Fp8Linear, tune: kernels.GemvFp8Tuning) -> float:
    """Relative error of the GEMV vs the fp64 reference on this x; NaN if an output was left unwritten."""
    out = torch.full((x.shape[0], lin.weight.shape[0]), float("nan"), device="cuda", dtype=x.dtype)
    got = kernels.gemv_fp8(x, lin.weight, lin.scale, out=out, tuning=tune).double()
    ref = x.double() @ lin.dequantize(torch.float32).double().T
    return float(((got - ref).norm() / ref.norm()).item())


def gemm_row(shape: str, part: str, n: int, k: int, peaks: dict[str, float], bw: float) -> dict:
    copies = max(2, min(LAUNCHES, int(160e6 // (n * k)) + 1))  # fp8 copies > 60 MB L2
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    lins = [Fp8Linear.quantize(w) for w in ws]
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    row = {"shape": shape, "gemm": part, "n": n, "k": k, "fp8_bytes": lins[0].nbytes(), "bf16_bytes": n * k * 2}
    row["bf16_us"] = graph_us([lambda w=w: kernels.gemv(x, w) for w in ws])
    times, errs = {}, {}
    for t in TUNINGS:
        errs[str(t)] = check(torch.randn(1, k, device="cuda", dtype=torch.bfloat16), lins[0], t)
        times[str(t)] = graph_us([lambda q=q, t=t: kernels.gemv_fp8(x, q.weight, q.scale, tuning=t) for q in lins])
    best = min(times, key=times.get)
    kernels.set_tuning_fp8(n, k, next(t for t in TUNINGS if str(t) == best))  # the engine rows use it
    row.update(fp8_default_us=times[str(kernels.GemvFp8Tuning())], fp8_best_us=times[best], fp8_best=best,
               fp8_max_rel_err=max(errs.values()), fp8_times=times)
    row["bf16_floor_share"] = row["bf16_bytes"] / bw / (row["bf16_us"] * 1e-6)
    row["fp8_floor_share"] = row["fp8_bytes"] / bw / (row["fp8_best_us"] * 1e-6)
    few = {}
    for m in (1, 2, 4, 8, 16):
        xm = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        if m <= 8:
            few[f"gemv_m{m}_us"] = graph_us([lambda q=q, xm=xm: kernels.gemv_fp8(xm, q.weight, q.scale) for q in lins])
        few[f"w8a8_m{m}_us"] = graph_us([lambda q=q, xm=xm: kernels.scaled_mm_fp8(xm, q.weight, q.scale)
                                         for q in lins])
    row["rows"] = few
    x256 = torch.randn(256, k, device="cuda", dtype=torch.bfloat16)
    row["bf16_m256_us"] = graph_us([lambda w=w: F.linear(x256, w) for w in ws])
    row["w8a8_m256_us"] = graph_us([lambda q=q: kernels.scaled_mm_fp8(x256, q.weight, q.scale) for q in lins])
    flops = 2 * 256 * n * k
    row["bf16_m256_floor_share"] = max(flops / peaks["bf16"], n * k * 2 / bw) / (row["bf16_m256_us"] * 1e-6)
    row["w8a8_m256_floor_share"] = max(flops / peaks["fp8"], n * k / bw) / (row["w8a8_m256_us"] * 1e-6)
    del ws, lins
    torch.cuda.empty_cache()
    return row


def _dump(res: dict, path: str | None) -> None:
    if path:
        with open(path, "w") as fh:
            json.dump(res, fh, indent=2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="llama3.2-1b,qwen2.5-0.5b")
    ap.add_argument("--batch1-formats", default="bf16,fp8,int4")
    ap.add_argument("--c256-formats", default="bf16,fp8")
    ap.add_argument("--no-gemm", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    bw = copy_bandwidth()
    peaks = matmul_peaks()
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_bw": bw, "peaks": peaks,
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "gemm": [], "batch1": [], "c256": []}
    print(f"{res['gpu']}: copy {bw / 1e12:.2f} TB/s, bf16 {peaks['bf16'] / 1e12:.0f} TFLOP/s, "
          f"fp8 {peaks['fp8'] / 1e12:.0f} TFLOP/s", flush=True)
    names = args.shapes.split(",")
    for name in names if not args.no_gemm else []:
        for part, (n, k) in gemm_shapes(name).items():
            row = gemm_row(name, part, n, k, peaks, bw)
            res["gemm"].append(row)
            r = row["rows"]
            print(f"{name} {part:>7} {n}x{k}: 1 row bf16 {row['bf16_us']:.1f} us "
                  f"({100 * row['bf16_floor_share']:.0f} %)"
                  f" fp8 {row['fp8_best_us']:.1f} us ({100 * row['fp8_floor_share']:.0f} %, {row['fp8_best']}, "
                  f"err {row['fp8_max_rel_err']:.1e}); gemv/w8a8 m1 {r['gemv_m1_us']:.1f}/{r['w8a8_m1_us']:.1f} "
                  f"m4 {r['gemv_m4_us']:.1f}/{r['w8a8_m4_us']:.1f} m8 {r['gemv_m8_us']:.1f}/{r['w8a8_m8_us']:.1f}; "
                  f"256 rows bf16 {row['bf16_m256_us']:.1f} us ({100 * row['bf16_m256_floor_share']:.0f} %) "
                  f"w8a8 {row['w8a8_m256_us']:.1f} us ({100 * row['w8a8_m256_floor_share']:.0f} %)", flush=True)
            _dump(res, args.json)
    from bench.int4_gpu import engine_row

    for name in names:
        for fmt in args.batch1_formats.split(","):
            row = engine_row(name, fmt, bw)
            res["batch1"].append(row)
            print(f"{name} batch-1 {fmt}: step {row['step_ms']:.3f} ms ({row['tok_per_s']:.0f} tok/s), replay "
                  f"{row['replay_ms']:.3f} ms, floor {row['floor_ms_measured']:.3f} ms -> "
                  f"{100 * row['share_measured']:.0f} % (replay {100 * row['replay_share_measured']:.0f} %), "
                  f"resident {row['resident_weight_bytes'] / 1e6:.0f} MB", flush=True)
            _dump(res, args.json)
    for name in names:
        for fmt in args.c256_formats.split(","):
            engine_gpu.WEIGHT_FORMAT["fmt"] = fmt
            row = engine_gpu.bench_shape(name, [256], bw, False, [], peaks)
            res["c256"].append(row)
            print(f"{name} 256 req {fmt}: {row['ours_c256_tok_s']:.0f} tok/s, "
                  f"{100 * row['ours_c256_job_floor_share']:.1f} % of the job floor "
                  f"({row['ours_c256_job_floor_s']:.3f} s), batch-1 step {row['decode_step_ms']:.3f} ms, "
                  f"resident {row['resident_weight_bytes'] / 1e6:.0f} MB", flush=True)
            _dump(res, args.json)
            gc.collect()
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
