"""The GEMV prologues of issue 19.2 alone, in CUDA graphs: (add+)RMSNorm + GEMV and SiLU·mul + GEMV as two
launches vs one, bf16 ``gemv`` and int4 ``gemv_int4_w32``, over a sweep of launch tunings.

Per layer GEMM that takes a prologue (qkv and gate_up: add+RMSNorm; down: SiLU·mul) of each shape: µs of
the unfused pair and of the fused launch per tuning, each checked against the torch reference first
(``bench/gemv_int4_gpu.py``'s graphs: 64 launches cycling through weight copies larger than L2). The best
fused tuning per GEMM is recorded (``kernels._prologue.set_tuning``); then, in the same process, the
batch-1 engine rows of ``bench/int4_gpu.py`` with the prologues off and on.

    python -m bench.gemv_prologue_gpu --shapes llama3.2-1b,qwen2.5-0.5b --json $OUT/prologue.json
"""

from __future__ import annotations

import argparse
import json

import torch

import kernels
from bench.engine_gpu import copy_bandwidth
from bench.gemv_int4_gpu import gemm_shapes, graph_us
from bench.int4_gpu import engine_row
from engine.fused import quantize_int4_rtn
from kernels import _prologue

# session 16's first run (H100): the prologue GEMVs at the plain GEMV's tunings cost more than the launches they
# saved; more rows a program spread the prologue's extra loads (x, residual, gain) over more weight bytes
BF16_TUNINGS = [kernels.GemvTuning(bn, bk, w, st) for bn, bk, w, st in (
    (2, 1024, 4, 3), (4, 1024, 4, 3), (8, 1024, 4, 3), (16, 512, 4, 3), (8, 512, 8, 3))]
W32_TUNINGS = [None] + [kernels.GemvInt4W32Tuning(bn, g, w, st, x_per_row=xr) for bn, g, w, st, xr in (
    (16, 32, 4, 2, False), (16, 16, 4, 3, True))]
PARTS = {"qkv": _prologue.ADD_NORM, "gate_up": _prologue.ADD_NORM, "down": _prologue.SILU}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def part_row(part: str, n: int, k: int) -> dict:
    """One GEMM: unfused pair vs fused launch per tuning, bf16 and int4."""
    kind = PARTS[part]
    copies = max(2, int(160e6 // (n * k * 2)) + 1)
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5 for _ in range(copies)]
    q4 = [quantize_int4_rtn(w, 32) for w in ws]
    width = 2 * k if kind == _prologue.SILU else k
    x, res = (torch.randn(1, width, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    g = torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5
    row: dict = {"part": part, "n": n, "k": k}
    if kind == _prologue.SILU:
        row["bf16_unfused_us"] = graph_us([lambda w=w: kernels.gemv(kernels.silu_mul(x), w) for w in ws])
        row["w32_unfused_us"] = graph_us([lambda q=q: kernels.gemv_int4_w32(kernels.silu_mul(x), q.qweight,
                                                                           q.scale_offset) for q in q4])
        ref = kernels.gemv_silu_mul_reference(x, ws[0])
        fused_bf16 = lambda w, t: kernels.gemv_silu_mul(x, w, tuning=t)  # noqa: E731
        fused_w32 = lambda q, t: kernels.gemv_int4_w32_silu_mul(x, q.qweight, q.scale_offset, tuning=t)  # noqa: E731
        ref4 = kernels.gemv_int4_w32_reference(kernels.silu_mul_reference(x), q4[0].qweight, q4[0].scale_offset)
    else:
        row["bf16_unfused_us"] = graph_us([lambda w=w: kernels.gemv(kernels.add_rms_norm(x, res, g, 1e-5)[0], w)
                                           for w in ws])
        row["w32_unfused_us"] = graph_us([lambda q=q: kernels.gemv_int4_w32(
            kernels.add_rms_norm(x, res, g, 1e-5)[0], q.qweight, q.scale_offset) for q in q4])
        ref = kernels.gemv_rms_norm_reference(x, g, 1e-5, ws[0], residual=res)[0]
        fused_bf16 = lambda w, t: kernels.gemv_rms_norm(x, g, 1e-5, w, residual=res, tuning=t)[0]  # noqa: E731
        fused_w32 = lambda q, t: kernels.gemv_int4_w32_rms_norm(  # noqa: E731
            x, g, 1e-5, q.qweight, q.scale_offset, residual=res, tuning=t)[0]
        ref4 = kernels.gemv_int4_w32_reference(kernels.rms_norm_reference(x + res, g, 1e-5), q4[0].qweight,
                                               q4[0].scale_offset)
    row["bf16_plain_gemv_us"] = graph_us([lambda w=w: kernels.gemv(x[:, :k], w) for w in ws])
    row["bf16_fused"], row["w32_fused"] = [], []
    for t in BF16_TUNINGS:
        err = _rel(fused_bf16(ws[0], t), ref)
        us = graph_us([lambda w=w, t=t: fused_bf16(w, t) for w in ws]) if err < 1e-2 else None
        row["bf16_fused"].append({"tuning": str(t), "us": us, "rel_err": err})
    for t in W32_TUNINGS:
        err = _rel(fused_w32(q4[0], t), ref4)
        us = graph_us([lambda q=q, t=t: fused_w32(q, t) for q in q4]) if err < 1e-2 else None
        row["w32_fused"].append({"tuning": str(t), "us": us, "rel_err": err})
    best = min((r for r in row["bf16_fused"] if r["us"]), key=lambda r: r["us"])
    best4 = min((r for r in row["w32_fused"] if r["us"]), key=lambda r: r["us"])
    row["bf16_best"], row["w32_best"] = best, best4
    _prologue.set_tuning("gemv", kind, n, k, BF16_TUNINGS[row["bf16_fused"].index(best)])
    _prologue.set_tuning("w32", kind, n, k, W32_TUNINGS[row["w32_fused"].index(best4)])
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="llama3.2-1b,qwen2.5-0.5b")
    ap.add_argument("--engine-variants", default="rope,prologues", help="bench/int4_gpu.py variants after")
    ap.add_argument("--json")
    args = ap.parse_args()
    bw = copy_bandwidth()
    res: dict = {"gpu": torch.cuda.get_device_name(), "copy_bw": bw, "gemms": [], "engine": []}
    print(json.dumps({k: res[k] for k in ("gpu", "copy_bw")}), flush=True)
    for name in args.shapes.split(","):
        shapes = gemm_shapes(name)
        for part in PARTS:
            row = {"shape": name, **part_row(part, *shapes[part])}
            res["gemms"].append(row)
            print(json.dumps({k: v for k, v in row.items() if k not in ("bf16_fused", "w32_fused")}), flush=True)
            _dump(res, args.json)
    for name in args.shapes.split(","):
        for fmt in ("bf16", "int4"):
            for variant in args.engine_variants.split(","):
                row = engine_row(name, fmt, bw, False, variant)
                print(json.dumps(row), flush=True)
                res["engine"].append(row)
                _dump(res, args.json)


def _dump(res: dict, path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
