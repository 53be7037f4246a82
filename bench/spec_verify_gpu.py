"""GPU: a speculative verify step eager vs replayed from its CUDA graph (random bf16 weights, real shapes).

Acceptance on random weights says nothing about real text, so this script runs no workload: it forces the
verify step's shape directly. Per shape, one runner captures verify graphs for k = 3, 5, 7 (batch
buckets 1, 2, 4, 8) and the decode graphs; batch B sequences of ``--context`` tokens are prefilled once; then,
for B in ``--batches`` and each k, the same verify step (each sequence's last token + k drafts, B * (k + 1)
query rows; and, for B > 1, a mixed step where every other sequence is a plain decode without drafts) runs
through ``ModelRunner.execute`` eagerly and through its graph, alternately, ``--iters`` times each after
``--warmup`` rounds of both (Triton compiled, cuBLAS handles made, graphs replayed once).
Time per step: host clock around ``execute`` + a device sync (what the engine's step waits for), median.
Beside them: the batch's plain decode step (1 row per sequence) through its graph, and the bandwidth floor
of one step, (weight bytes + the batch's K/V bytes) / measured copy bandwidth, as a share of each.

Usage: python bench/spec_verify_gpu.py [--shapes smollm2-135m,qwen2.5-0.5b] [--batches 1,8] [--ks 3,5,7]
                                       [--context 512] [--iters 50] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from bench.engine_gpu import SHAPES, copy_bandwidth, random_model
from engine.config import ModelConfig
from engine.engine_config import EngineConfig
from engine.model_runner import ModelRunner
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledSeq, SchedulerOutput
from engine.sequence import Request, Sequence
from tests.engine.engine_helpers import rows_in_order


def build_runner(cfg: ModelConfig, ks: list[int], max_batch: int, context: int) -> ModelRunner:
    blocks = max_batch * (-(-(context + max(ks) + 1) // 16)) + 1
    ecfg = EngineConfig(device="cuda", num_kv_blocks=blocks, max_model_len=context + 64, max_num_seqs=max_batch,
                        cuda_graph_max_batch=max_batch, cuda_graph_spec_tokens=tuple(ks),
                        speculative_disable_by_batch_size=max_batch)
    runner = ModelRunner(random_model(cfg), ecfg, ecfg.max_model_len)
    runner.init_kv_cache()
    return runner


def prefill(runner: ModelRunner, batch: int, context: int, vocab: int) -> list[Sequence]:
    """``batch`` sequences of ``context`` random tokens, all but the last one's K/V computed (eagerly)."""
    g = torch.Generator().manual_seed(batch)
    per = -(-(context + 8) // 16)
    seqs = []
    for i in range(batch):
        ids = torch.randint(0, vocab, (context,), generator=g).tolist()
        req = Request(f"r{i}", ids, SamplingParams(temperature=0), 0.0)
        seq = Sequence(i, req, 0, ids, None)
        seq.block_table = list(range(1 + i * per, 1 + (i + 1) * per))
        seqs.append(seq)
    runner.execute(SchedulerOutput([ScheduledSeq(s, 0, context - 1) for s in seqs], [], []))
    return seqs


def step_ms(runner: ModelRunner, step: SchedulerOutput, eager: bool) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    runner.execute(step, eager=eager)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def compare(runner: ModelRunner, step: SchedulerOutput, warmup: int, iters: int) -> dict:
    """Eager vs graph on one step: both warmed, then alternated; medians in ms and the graph's max error."""
    for _ in range(warmup):
        step_ms(runner, step, True), step_ms(runner, step, False)
    eager, graph = [], []
    for _ in range(iters):
        eager.append(step_ms(runner, step, True))
        graph.append(step_ms(runner, step, False))
    with torch.inference_mode():  # rows regrouped per sequence: the eager step puts plain decodes first
        seqs = [s.seq for s in step.scheduled]
        want = rows_in_order(*runner.execute(step, eager=True), seqs).clone()
        got = rows_in_order(*runner.execute(step, eager=False), seqs)
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    return {"eager_ms": med(eager), "graph_ms": med(graph), "speedup": med(eager) / med(graph),
            "bit_exact": bool(torch.equal(got, want)),
            "max_rel_err": float(((got - want).norm(dim=-1) / want.norm(dim=-1)).max())}


def bench_shape(name: str, batches: list[int], ks: list[int], context: int, warmup: int, iters: int,
                bw: float) -> dict:
    cfg = ModelConfig(**SHAPES[name])
    runner = build_runner(cfg, ks, max(batches), context)
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.base.parameters())
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2
    res = {"shape": name, "weight_MB": weight_bytes / 1e6, "context": context,
           "graphs": sorted(runner._graphs), "rows": []}
    for b in batches:
        seqs = prefill(runner, b, context, cfg.vocab_size)
        floor_ms = (weight_bytes + b * context * kv_per_token) / bw * 1e3
        decode = SchedulerOutput([ScheduledSeq(s, context - 1, 1) for s in seqs], [], [])
        decode_row = {"batch": b, "k": 0, "floor_ms": floor_ms, **compare(runner, decode, warmup, iters)}
        res["rows"].append(decode_row)
        print_row(name, decode_row)
        for k, mixed in [(k, False) for k in ks] + [(k, True) for k in ks if b > 1]:
            # mixed: every other sequence a plain decode (no drafts) in the same step
            drafts = [[] if mixed and i % 2 else [(7 * i + j) % cfg.vocab_size for j in range(k)] for i in range(b)]
            verify = SchedulerOutput([ScheduledSeq(s, context - 1, 1, d) for s, d in zip(seqs, drafts, strict=True)],
                                     [], [])
            row = {"batch": b, "k": k, "mixed": mixed, "floor_ms": floor_ms, **compare(runner, verify, warmup, iters)}
            row["graph_vs_decode_graph"] = row["graph_ms"] / decode_row["graph_ms"]
            res["rows"].append(row)
            print_row(name, row)
    return res


def print_row(name: str, r: dict) -> None:
    kind = "decode" if r["k"] == 0 else f"{'mixed' if r['mixed'] else 'verify'} k={r['k']}"
    rows = r["batch"] * (r["k"] + 1)
    share = {side: 100 * r["floor_ms"] / r[f"{side}_ms"] for side in ("graph", "eager")}
    extra = f", {r['graph_vs_decode_graph']:.2f}x the decode graph" if "graph_vs_decode_graph" in r else ""
    print(f"{name:>13} B={r['batch']} {kind:>11} ({rows:>3} graph rows): eager {r['eager_ms']:.3f} ms, "
          f"graph {r['graph_ms']:.3f} ms, eager/graph {r['speedup']:.2f}x, floor {r['floor_ms']:.3f} ms "
          f"({share['graph']:.0f} % of graph, {share['eager']:.0f} % of eager){extra}; graph vs eager logits: "
          f"bit-exact {r['bit_exact']}, max rel err {r['max_rel_err']:.1e}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="smollm2-135m,qwen2.5-0.5b")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--ks", default="3,5,7")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--json")
    args = ap.parse_args()
    bw = copy_bandwidth()
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_bandwidth_GBps": bw / 1e9,
           "args": vars(args), "results": []}
    print(json.dumps({k: v for k, v in out.items() if k != "results"}), flush=True)
    batches, ks = [int(x) for x in args.batches.split(",")], [int(x) for x in args.ks.split(",")]
    for name in args.shapes.split(","):
        out["results"].append(bench_shape(name, batches, ks, args.context, args.warmup, args.iters, bw))
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(out, fh, indent=2)


if __name__ == "__main__":
    main()
