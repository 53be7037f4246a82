"""Where a 256-request job's wall goes on the GPU: per engine step, host parts vs the graph's GPU time.

For each shape (random bf16 weights, ``bench/engine_gpu.py``'s engine settings), after a full warm-up
(the same 256 x (128 + 256) job once, untimed), runs the job ``--repeats`` times and, in one extra instrumented
run, times every step on the host clock split into: ``schedule`` (the scheduler), ``execute`` (block copies,
input staging, graph launch or the eager forward's launches), ``commit`` and ``process`` (sampling with its
device->host read-back, which waits for the GPU, then appending tokens, stop checks, outputs). Steps are
grouped as prefill/mixed (any multi-token query) or decode-only. Also the GPU time of one replay of the
256-row decode graph (events, median of 50) and of ``argmax`` over its logits, and the SM clock before and
after (nvidia-smi).

``--loops sync,overlap``: the synchronous loop and the overlapped one (``LLMEngine.overlap``, issue 19.1) on
the same engine, one after the other in this process: both warmed on the full job first, then ``--repeats``
rounds of the 256-request job in alternating order (A B, B A, A B, ...), each job's wall, tokens/s, share of
the whole job's floor (``bench.engine_gpu.job_floor_s`` at the copy bandwidth measured at the start) and the
time the garbage collector paused it; the instrumented run and the batch-1 rows (``decode_step_time``, a
1-request job) per loop.

Usage: python bench/engine_step_split_gpu.py [--shapes llama3.2-1b,qwen2.5-0.5b] [--repeats 3]
                                             [--loops sync,overlap] [--profile DIR] [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import time

import torch

from bench.engine_gpu import (
    OUTPUT_LEN,
    SHAPES,
    build_llm,
    copy_bandwidth,
    cuda_median_ms,
    decode_step_time,
    job_floor_s,
    prompts,
    random_model,
    step_weight_bytes,
    timed,
)
from engine.config import ModelConfig
from engine.model_runner import _StaticInputs
from engine.sampling_params import SamplingParams

C = 256
KEYS = ("wall", "schedule", "execute", "launch", "commit", "process", "resolve")


def sm_clock() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw",
                               "--format=csv,noheader"], capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception as exc:  # noqa: BLE001
        return repr(exc)


def job(llm, vocab: int, seed: int, c: int = C) -> float:
    params = SamplingParams(temperature=0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    return timed(lambda: llm.generate(prompts(c, vocab, seed), params))


class GcClock:
    """Time the garbage collector spends while installed (gc.callbacks), and its collections by generation."""

    def __init__(self) -> None:
        self.paused, self.counts, self._t0 = 0.0, [0, 0, 0], 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.paused += time.perf_counter() - self._t0
            self.counts[info["generation"]] += 1

    def __enter__(self):
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self)


def timed_job(llm, vocab: int, seed: int, floor: float, gc_mode: str = "") -> dict:
    """One 256-request job. ``gc_mode`` "gcfreeze": the objects alive before it moved out of the collector's
    reach first (gc.freeze; they stay there); "gcthaw": every frozen object (the engine's start-up freeze,
    ``EngineConfig.gc_freeze``) back in the collector's reach for the job, frozen again after it."""
    if gc_mode == "gcfreeze":
        gc.collect()
        gc.freeze()
    elif gc_mode == "gcthaw":
        gc.unfreeze()
    with GcClock() as gcc:
        dt = job(llm, vocab, seed)
    if gc_mode == "gcthaw":
        gc.collect()
        gc.freeze()
    return {"job_s": dt, "tok_s": C * OUTPUT_LEN / dt, "floor_share": floor / dt, "gc_pause_s": gcc.paused,
            "gc_collections": gcc.counts}


def instrumented(llm, vocab: int) -> dict:
    eng = llm.engine
    sched_fn, exec_fn, commit_fn, proc_fn = (eng.scheduler.schedule, eng.executor.execute,
                                             eng.scheduler.commit_step, eng._process_samples)
    launch_fn, resolve_fn = eng.executor.launch, eng._resolve
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
    eng.executor.launch = wrap("launch", launch_fn)   # the overlapped loop: stage + launch + argmax + copy
    eng._resolve = wrap("resolve", resolve_fn)        # and: wait for the step's tokens, apply them
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
        del eng.executor.launch, eng._resolve
    out: dict = {"instrumented_job_s": total}
    for kind, rows in steps.items():
        out[f"{kind}_steps"] = len(rows)
        out[f"{kind}_wall_s"] = sum(r["wall"] for r in rows)
        for key in KEYS:
            vals = sorted(r.get(key, 0.0) for r in rows)
            if vals:
                out[f"{kind}_{key}_median_ms"] = 1e3 * vals[len(vals) // 2]
    full = [r for r in steps["decode"] if r.get("rows") == C]
    out["decode_full_steps"] = len(full)
    if full:
        for key in KEYS:
            vals = sorted(r.get(key, 0.0) for r in full)
            out[f"decode{C}_{key}_median_ms"] = 1e3 * vals[len(vals) // 2]
    return out


@torch.inference_mode()
def graph_gpu_ms(llm, b: int = C, iters: int = 50) -> dict:
    runner = llm.engine.runner
    runner._decode_in.dev64[_StaticInputs.SLOTS].fill_(-1)  # padding slots: the replays write nothing into the pool
    runner._decode_in.dev32[:b].fill_(128 + OUTPUT_LEN // 2)  # context lengths of the job's mean step
    graph, logits = runner.decode_graph(b, 10**9)
    for _ in range(5):
        graph.replay()
    replay = cuda_median_ms(graph.replay, iters)
    am = cuda_median_ms(lambda: logits[:b].argmax(-1), iters)
    runner._decode_in.dev32[:b].fill_(1)
    return {f"graph{b}_replay_ms": replay, f"argmax{b}_ms": am}


def same_tokens(llm, vocab: int, n: int = 64) -> dict:
    """Greedy tokens of the two loops on the same 64 prompts (random bf16 weights: near-ties are common, so
    any numerical difference between the loops' steps would show)."""
    params = SamplingParams(temperature=0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    runs = {}
    for lp in ("sync", "overlap"):
        llm.engine.overlap = lp == "overlap"
        llm.engine.block_manager.enable_prefix_caching = False
        runs[lp] = [o.outputs[0].token_ids for o in llm.generate(prompts(n, vocab, 4321), params)]
        llm.engine.block_manager.enable_prefix_caching = True
    equal = sum(a == b for a, b in zip(runs["sync"], runs["overlap"], strict=True))
    print("same tokens", equal, "of", n, flush=True)
    return {"prompts": n, "identical": equal}


def profile_job(llm, vocab: int, seed: int, path: str) -> None:
    """One 256-request job under cProfile (the host side: its times are inflated by the profiler, their
    proportions are what to read); the top functions by own time and by cumulative time into ``path``."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    job(llm, vocab, seed)
    prof.disable()
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats("tottime").print_stats(45)
    stats.sort_stats("cumulative").print_stats(35)
    with open(path, "w") as fh:
        fh.write(buf.getvalue())


def ab_shape(name: str, loops: list[str], repeats: int, bw: float, profile_dir: str | None = None) -> dict:
    """Both loops on one engine: warmed, then ``repeats`` rounds in alternating order, instrumented runs,
    batch-1 rows, the 256-row graph's GPU time."""
    cfg = ModelConfig(**SHAPES[name])
    model = random_model(cfg)
    llm = build_llm(cfg, model)
    eng, vocab = llm.engine, cfg.vocab_size
    weight_bytes, params = step_weight_bytes(llm)
    kv_elem = eng.runner.kv.k[0].element_size()
    floor = job_floor_s(cfg, weight_bytes, C, bw, params, kv_elem=kv_elem)
    floor1 = job_floor_s(cfg, weight_bytes, 1, bw, params, kv_elem=kv_elem)
    r: dict = {"shape": name, "clock_before": sm_clock(), "job_floor_s": floor, "job1_floor_s": floor1,
               "loops": {lp: {"jobs": []} for lp in loops}}
    seeds = iter(range(5000, 6000))  # every job its own prompts: no prefix-cache hits between jobs
    for lp in (lp for lp in loops if "+" not in lp):  # warm each loop on the whole job it will run
        eng.overlap = lp == "overlap"
        r["loops"][lp]["warm_s"] = job(llm, vocab, next(seeds))
    r["same_tokens"] = same_tokens(llm, vocab)
    for i in range(repeats):
        for lp in loops[i % len(loops):] + loops[:i % len(loops)]:  # each round starts one loop later
            eng.overlap = lp.startswith("overlap")
            r["loops"][lp]["jobs"].append(timed_job(llm, vocab, next(seeds), floor, lp.partition("+")[2]))
            print(name, lp, i, json.dumps(r["loops"][lp]["jobs"][-1]), flush=True)
    for lp in (lp for lp in loops if "+" not in lp):
        eng.overlap = lp == "overlap"
        d = r["loops"][lp]
        d.update(instrumented(llm, vocab))
        job(llm, vocab, next(seeds), 1)
        d["c1_job_s"] = job(llm, vocab, next(seeds), 1)
        d["c1_tok_s"] = OUTPUT_LEN / d["c1_job_s"]
        d["c1_floor_share"] = floor1 / d["c1_job_s"]
        d["batch1_step_ms"] = decode_step_time(llm, vocab) * 1e3
        if profile_dir:
            profile_job(llm, vocab, next(seeds), f"{profile_dir}/profile_{name}_{lp}.txt")
        shares = [j["floor_share"] for j in d["jobs"]]
        d["floor_share_min_max"] = [min(shares), max(shares)]
        print(name, lp, "summary", json.dumps({k: v for k, v in d.items() if k != "jobs"}), flush=True)
    eng.overlap = False
    r.update(graph_gpu_ms(llm))
    r["clock_after"] = sm_clock()
    del llm, model
    gc.unfreeze()  # the engine froze its start-up heap (EngineConfig.gc_freeze): let its cycles go
    gc.collect()
    torch.cuda.empty_cache()
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="llama3.2-1b,qwen2.5-0.5b")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--loops", help="comma list of sync, overlap, each also as NAME+gcfreeze (gc.freeze() before "
                                    "its jobs) or NAME+gcthaw (gc.unfreeze() for its jobs): the A/B of issue 19.1 "
                                    "(default: the split only)")
    ap.add_argument("--profile", metavar="DIR", help="with --loops: also one cProfile'd job per loop and shape, "
                                                     "its top functions into DIR/profile_SHAPE_LOOP.txt")
    ap.add_argument("--json")
    args = ap.parse_args()
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "shapes": []}
    if args.loops:
        res["copy_bandwidth_GBps"] = (bw := copy_bandwidth()) / 1e9
    for name in args.shapes.split(","):
        if args.loops:
            res["shapes"].append(ab_shape(name, args.loops.split(","), args.repeats, bw, args.profile))
            table(res["shapes"][-1])
        else:
            res["shapes"].append(split_shape(name, args.repeats))
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(res, fh, indent=2)


def table(r: dict) -> None:
    for lp, d in r["loops"].items():
        if "c1_tok_s" not in d:
            d.update(c1_tok_s=0.0, c1_floor_share=0.0, batch1_step_ms=0.0)
        jobs = " / ".join(f"{j['tok_s']:,.0f} ({100 * j['floor_share']:.1f} %, gc {1e3 * j['gc_pause_s']:.0f} ms)"
                          for j in d["jobs"])
        print(f"{r['shape']:>13} {lp:>7}: 256 req {jobs}; decode-256 step {d.get('decode256_wall_median_ms', 0):.2f}"
              f" ms; 1 req {d['c1_tok_s']:.0f} tok/s ({100 * d['c1_floor_share']:.1f} %), batch-1 step "
              f"{d['batch1_step_ms']:.3f} ms", flush=True)


def split_shape(name: str, repeats: int) -> dict:
    """Call 1's measurement: the synchronous loop's job, its steps taken apart."""
    cfg = ModelConfig(**SHAPES[name])
    model = random_model(cfg)
    llm = build_llm(cfg, model)
    r: dict = {"shape": name, "clock_before": sm_clock()}
    r["warm_s"] = job(llm, cfg.vocab_size, 500)
    r["job_s"] = [job(llm, cfg.vocab_size, C + i) for i in range(repeats)]
    r["tok_s"] = [C * OUTPUT_LEN / t for t in r["job_s"]]
    r.update(instrumented(llm, cfg.vocab_size))
    r.update(graph_gpu_ms(llm))
    r["clock_after"] = sm_clock()
    print(json.dumps(r), flush=True)
    del llm, model
    gc.unfreeze()  # the engine froze its start-up heap (EngineConfig.gc_freeze): let its cycles go
    gc.collect()
    torch.cuda.empty_cache()
    return r


if __name__ == "__main__":
    main()
