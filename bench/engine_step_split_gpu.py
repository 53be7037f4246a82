"""Where a 256-request job's wall goes on the GPU: per engine step, host parts vs the graph's GPU time.

For each shape (random bf16 weights, ``bench/engine_gpu.py``'s engine settings), after a full warm-up
(the same 256 x (128 + 256) job once, untimed), runs the job ``--repeats`` times and, in one extra instrumented
run, times every step on the host clock split into: ``schedule`` (the scheduler), ``execute`` (block copies,
input staging, graph launch or the eager forward's launches), ``commit`` and ``process`` (sampling with its
device->host read-back, which waits for the GPU, then appending tokens, stop checks, outputs). Steps are
grouped as prefill/mixed (any multi-token query) or decode-only. Also the GPU time of one replay of the
256-row decode graph (events, median of 50) and of ``argmax`` over its logits, and the SM clock before and
after (nvidia-smi). ``--loops sync,overlap`` (after the overlap loop exists) times each loop in turn.

Usage: python bench/engine_step_split_gpu.py [--shapes llama3.2-1b,qwen2.5-0.5b] [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import time

import torch

from bench.engine_gpu import OUTPUT_LEN, SHAPES, build_llm, prompts, random_model, timed
from engine.config import ModelConfig
from engine.sampling_params import SamplingParams

C = 256


def sm_clock() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw",
                               "--format=csv,noheader"], capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception as exc:  # noqa: BLE001
        return repr(exc)


def job(llm, vocab: int, seed: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    return timed(lambda: llm.generate(prompts(C, vocab, seed), params))


def instrumented(llm, vocab: int) -> dict:
    eng = llm.engine
    sched_fn, exec_fn, commit_fn, proc_fn = (eng.scheduler.schedule, eng.executor.execute,
                                             eng.scheduler.commit_step, eng._process_samples)
    clock: dict[str, float] = {}

    def wrap(name, fn):
        def inner(*a, **k):
            t0 = time.perf_counter()
            out = fn(*a, **k)
            clock[name] = clock.get(name, 0.0) + time.perf_counter() - t0
            return out
        return inner

    def schedule():
        t0 = time.perf_counter()
        out = sched_fn()
        clock["schedule"] = time.perf_counter() - t0
        clock["multi"] = sum(1 for s in out.scheduled if s.num_query_tokens != 1)
        clock["rows"] = len(out.scheduled)
        return out

    eng.scheduler.schedule = schedule
    eng.executor.execute = wrap("execute", exec_fn)
    eng.scheduler.commit_step = wrap("commit", commit_fn)
    eng._process_samples = wrap("process", proc_fn)
    params = SamplingParams(temperature=0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    for i, p in enumerate(prompts(C, vocab, 77)):
        eng.add_request(f"i{i}", p, params)
    steps = {"prefill": [], "decode": []}
    torch.cuda.synchronize()
    t_start = time.perf_counter()
    try:
        while eng.has_unfinished_requests():
            clock.clear()
            t0 = time.perf_counter()
            eng.step()
            dt = time.perf_counter() - t0
            steps["prefill" if clock.get("multi") else "decode"].append({"wall": dt, **clock})
        torch.cuda.synchronize()
        total = time.perf_counter() - t_start
    finally:
        del eng.scheduler.schedule, eng.executor.execute, eng.scheduler.commit_step, eng._process_samples
    out: dict = {"instrumented_job_s": total}
    for kind, rows in steps.items():
        out[f"{kind}_steps"] = len(rows)
        out[f"{kind}_wall_s"] = sum(r["wall"] for r in rows)
        for key in ("wall", "schedule", "execute", "commit", "process"):
            vals = sorted(r.get(key, 0.0) for r in rows)
            if vals:
                out[f"{kind}_{key}_median_ms"] = 1e3 * vals[len(vals) // 2]
    full = [r for r in steps["decode"] if r.get("rows") == C]
    out["decode_full_steps"] = len(full)
    if full:
        for key in ("wall", "schedule", "execute", "commit", "process"):
            vals = sorted(r.get(key, 0.0) for r in full)
            out[f"decode{C}_{key}_median_ms"] = 1e3 * vals[len(vals) // 2]
    return out


@torch.inference_mode()
def graph_gpu_ms(llm, b: int = C, iters: int = 50) -> dict:
    runner = llm.engine.runner
    runner._decode_in.dev64[2].fill_(-1)  # padding slots: the replays write nothing into the pool
    runner._decode_in.dev32[:b].fill_(128 + OUTPUT_LEN // 2)  # context lengths of the job's mean step
    graph, logits = runner.decode_graph(b, 10**9)
    for _ in range(5):
        graph.replay()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for a, z in ev:
        a.record()
        graph.replay()
        z.record()
    torch.cuda.synchronize()
    replay = sorted(a.elapsed_time(z) for a, z in ev)[iters // 2]
    for a, z in ev:
        a.record()
        logits[:b].argmax(-1)
        z.record()
    torch.cuda.synchronize()
    am = sorted(a.elapsed_time(z) for a, z in ev)[iters // 2]
    runner._decode_in.dev32[:b].fill_(1)
    return {f"graph{b}_replay_ms": replay, f"argmax{b}_ms": am}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="llama3.2-1b,qwen2.5-0.5b")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "shapes": []}
    for name in args.shapes.split(","):
        cfg = ModelConfig(**SHAPES[name])
        model = random_model(cfg)
        llm = build_llm(cfg, model)
        r: dict = {"shape": name, "clock_before": sm_clock()}
        r["warm_s"] = job(llm, cfg.vocab_size, 500)
        r["job_s"] = [job(llm, cfg.vocab_size, C + i) for i in range(args.repeats)]
        r["tok_s"] = [C * OUTPUT_LEN / t for t in r["job_s"]]
        r.update(instrumented(llm, cfg.vocab_size))
        r.update(graph_gpu_ms(llm))
        r["clock_after"] = sm_clock()
        print(json.dumps(r), flush=True)
        res["shapes"].append(r)
        del llm, model
        gc.collect()
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=2)


if __name__ == "__main__":
    main()
