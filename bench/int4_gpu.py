"""Batch-1 decode with int4 or fp8 weights vs bf16 on the GPU (random weights in real model shapes).

Per shape and weight format (``EngineConfig.cuda_weight_format``): the engine's batch-1 decode step
(host clock, a 128-token prompt then 256 greedy tokens: ``bench/engine_gpu.py``'s ``decode_step_time``),
tokens per second, the replay time of the batch-1 CUDA graph (GPU only), and the step's bytes over
the bandwidth floor (weights read once per step — the layer GEMMs, the head, one embedding row — plus
the K/V at the mean context), at the nominal 4.8 TB/s and at the measured device copy bandwidth.
Each layer GEMM alone, in CUDA graphs: ``bench/gemv_int4_gpu.py`` (which also runs these engine rows).

    python bench/int4_gpu.py --shapes llama3.2-1b --json bench/results/int4_gpu.json
    python bench/int4_gpu.py --shapes llama3.2-1b,qwen2.5-0.5b --profile   # + each row's kernels per step
    python bench/int4_gpu.py --variants off,rope,prologues,all   # without / with the issue-19.2 fusions
    python bench/int4_gpu.py --formats bf16,fp8,int4               # EngineConfig.cuda_weight_format values
    python bench/int4_gpu.py --pdl off,on,on,off   # EngineConfig.cuda_pdl per row, A/B/B/A on one card
    python bench/int4_gpu.py --w32-tunings split.json   # the best int4 launches of bench.gemv_int4_gpu --split-sweep
    python bench/int4_gpu.py --fused-layers off,on,on,off --count-kernels   # cuda_fused_decode_layers A/B/B/A,
        # kernels per batch-1 step from torch.profiler, and a summary of the A/B (share of the floor, int4/bf16)

A row that fails (an exception in the engine or the bench) is recorded with its error and the run goes on.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json

import torch

import kernels
from bench.engine_gpu import (
    SHAPES,
    copy_bandwidth,
    decode_step_time,
    graph_replay_ms,
    kernel_profile,
    kv_bytes,
    random_model,
    step_breakdown,
    step_timeline,
)
from engine.config import ModelConfig
from engine.engine_config import EngineConfig
from engine.fused import weight_nbytes
from engine.llm import LLM

NOMINAL_BW = 4.8e12
TUNINGS = [kernels.GemvInt4Tuning(bn, bk, 4) for bn in (2, 4, 8) for bk in (512, 1024)] + [
    kernels.GemvInt4Tuning(4, 1024, 8), kernels.GemvInt4Tuning(8, 2048, 8)]


def step_bytes(llm: LLM, cfg: ModelConfig) -> int:
    """Bytes one batch-1 decode step must read: GEMM weights (as stored), one embedding row, the K/V."""
    fused = llm.engine.runner.model
    total = 0
    for w in fused.fused:
        for t in (w.qkv, w.gate_up, w.o, w.down):
            total += weight_nbytes(t)
    head = fused.quant_head
    total += weight_nbytes(head) if head is not None else fused.base.lm_head.weight.numel() * 2
    return total + cfg.hidden_size * 2 + kv_bytes(cfg)


# --variants: the issue-19.2 switches of each row (EngineConfig.cuda_fused_rope_store, cuda_gemv_prologues,
# cuda_one_pass_decode_tokens); "default": the engine's defaults
VARIANTS = {"off": (False, False, 0), "rope": (True, False, 0), "prologues": (True, True, 0),
            "all": (True, True, 512)}


def engine_row(name: str, fmt: str, bw: float, profile: bool = False, variant: str = "default",
               pdl: bool | None = None, fused: bool | None = None, count_kernels: bool = False) -> dict:
    cfg = ModelConfig(**SHAPES[name])
    switches = {} if variant == "default" else dict(zip(
        ("cuda_fused_rope_store", "cuda_gemv_prologues", "cuda_one_pass_decode_tokens"), VARIANTS[variant],
        strict=True))
    if pdl is not None:
        switches["cuda_pdl"] = pdl
    if fused is not None:
        switches["cuda_fused_decode_layers"] = fused
    llm = LLM(random_model(cfg), engine_config=EngineConfig(
        device="cuda", max_num_seqs=8, gpu_memory_utilization=0.3, max_model_len=4096, cuda_weight_format=fmt,
        **switches))
    if not llm.engine.runner._graphs:  # a failed capture decodes eagerly: not the step this bench measures
        raise RuntimeError("no CUDA graphs were captured")
    step = decode_step_time(llm, cfg.vocab_size)
    with torch.inference_mode():  # the runner's buffers are inference tensors
        replay = graph_replay_ms(llm, 1)
    nbytes = step_bytes(llm, cfg)
    row = {"shape": name, "format": fmt, "variant": variant, "pdl": kernels.pdl_enabled(),
           "fused_layers": llm.engine.runner.model.fused_layers,
           "step_ms": step * 1e3, "tok_per_s": 1 / step,
           "replay_ms": replay, "step_bytes": nbytes,
           "resident_weight_bytes": llm.engine.runner.model.resident_weight_bytes(),
           "floor_ms_nominal": nbytes / NOMINAL_BW * 1e3,
           "floor_ms_measured": nbytes / bw * 1e3}
    row["share_nominal"] = row["floor_ms_nominal"] / row["step_ms"]
    row["replay_share_nominal"] = row["floor_ms_nominal"] / replay
    row["share_measured"] = row["floor_ms_measured"] / row["step_ms"]
    row["replay_share_measured"] = row["floor_ms_measured"] / replay
    if profile:  # where the batch-1 graph's time goes, kernel by kernel (torch.profiler over 20 replays)
        with torch.inference_mode():
            row["kernels"] = kernel_profile(llm, 1)
        row["timeline"] = step_timeline(llm, cfg.vocab_size)  # the graph's replays inside the engine's loop
        row["host"] = step_breakdown(llm, cfg.vocab_size)  # the host clock per step: schedule / launch / wait
        row["kernels_per_step"] = row["kernels"]["kernels_per_replay"]
    elif count_kernels:  # the kernel count only: 5 profiled replays
        with torch.inference_mode():
            prof = kernel_profile(llm, 1, replays=5, top=0)
        row["kernels_per_step"] = prof["kernels_per_replay"]
        row["kernel_us_per_step"] = prof["kernel_us_per_replay"]
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="llama3.2-1b")
    ap.add_argument("--json")
    ap.add_argument("--profile", action="store_true", help="also the batch-1 graph's kernels, per row")
    ap.add_argument("--formats", default="bf16,int4", help="cuda_weight_format values, comma-separated")
    ap.add_argument("--variants", default="default",
                    help=f"issue-19.2 switches per row, comma-separated: default or of {sorted(VARIANTS)}")
    ap.add_argument("--pdl", default="default",
                    help="EngineConfig.cuda_pdl per row, comma-separated: default, off or on (repeats allowed)")
    ap.add_argument("--fused-layers", default="default",
                    help="EngineConfig.cuda_fused_decode_layers per row, comma-separated: default, off or on")
    ap.add_argument("--count-kernels", action="store_true", help="kernels per batch-1 step (5 profiled replays)")
    ap.add_argument("--w32-tunings", help="a bench.gemv_int4_gpu --split-sweep JSON: its best launch per GEMM is "
                                          "recorded (kernels.set_tuning_int4_w32) for every row of this run")
    args = ap.parse_args()
    if args.w32_tunings:
        apply_w32_tunings(args.w32_tunings)
    switch = {"default": None, "off": False, "on": True}
    pdls = [switch[p] for p in args.pdl.split(",")]
    fuseds = [switch[f] for f in args.fused_layers.split(",")]
    bw = copy_bandwidth()
    print(f"device copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    res = {"gpu": torch.cuda.get_device_name(), "copy_bw": bw, "engine": []}
    for name in args.shapes.split(","):
        for fmt in args.formats.split(","):
            for variant in args.variants.split(","):
                for pdl, fused in itertools.product(pdls, fuseds):
                    try:
                        row = engine_row(name, fmt, bw, args.profile, variant, pdl, fused, args.count_kernels)
                    except Exception as exc:  # noqa: BLE001 - recorded; the other rows still run
                        row = {"shape": name, "format": fmt, "variant": variant, "pdl": pdl, "fused_layers": fused,
                               "error": repr(exc)}
                        gc.collect()
                        torch.cuda.empty_cache()
                    print(json.dumps({k: v for k, v in row.items() if k != "kernels"}), flush=True)
                    res["engine"].append(row)
                    if args.json:  # after every row: a run cut short keeps what it measured
                        with open(args.json, "w") as f:
                            json.dump(res, f, indent=2)
    print(summary(res["engine"]), flush=True)


def apply_w32_tunings(path: str) -> None:
    """Record the best launch of each GEMM of a ``--split-sweep`` JSON (the default where none beat it)."""
    with open(path) as fh:
        rows = json.load(fh)["gemm"]
    for r in rows:
        t = r.get("best_tuning")
        kernels.set_tuning_int4_w32(r["n"], r["k"], 32, None if t is None else kernels.GemvInt4W32Tuning(**t))
        print(f"w32 {r['n']}x{r['k']}: {r.get('best', 'default')}", flush=True)


def summary(rows: list[dict]) -> str:
    """A markdown table of the rows averaged per (shape, format, PDL, fused layers): step, replay, tokens/s,
    share of the floor at the measured copy bandwidth, kernels per step; then int4 / bf16 tokens/s per setting."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if "error" not in r:
            groups.setdefault((r["shape"], r["format"], r["pdl"], r.get("fused_layers")), []).append(r)
    out = ["| shape | format | PDL | fused layers | step runs, ms | mean step | replay "
           "| tokens/s | floor (measured bw) | step share | replay share | kernels/step |",
           "|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    mean = {}
    for (shape, fmt, pdl, fused), rs in groups.items():
        step = sum(r["step_ms"] for r in rs) / len(rs)
        replay = sum(r["replay_ms"] for r in rs) / len(rs)
        floor = rs[0]["floor_ms_measured"]
        kps = rs[0].get("kernels_per_step")
        kps_text = "" if kps is None else f"{kps:.0f}"
        runs = " / ".join(f"{r['step_ms']:.3f}" for r in rs)
        mean[(shape, fmt, pdl, fused)] = step
        out.append(f"| {shape} | {fmt} | {pdl} | {fused} | {runs} | "
                   f"{step:.3f} | {replay:.3f} | {1e3 / step:,.0f} | {floor:.3f} | {100 * floor / step:.1f} % | "
                   f"{100 * floor / replay:.1f} % | {kps_text} |")
    for (shape, fmt, pdl, fused), step in mean.items():
        if fmt == "int4" and (shape, "bf16", pdl, fused) in mean:
            out.append(f"int4 / bf16 tokens/s, {shape}, PDL {pdl}, fused layers {fused}: "
                       f"{mean[(shape, 'bf16', pdl, fused)] / step:.2f}x")
        if fmt == "int4" and (shape, "bf16", pdl, False) in mean and fused:
            out.append(f"int4 fused / bf16 unfused tokens/s, {shape}: "
                       f"{mean[(shape, 'bf16', pdl, False)] / step:.2f}x")
    return "\n".join(out)


if __name__ == "__main__":
    main()
