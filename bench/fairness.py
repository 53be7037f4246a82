"""Fairness benchmark: time to first token of tenant B's short requests while tenant A streams long prompts.

Real default model (SmolLM2-135M-Instruct, fp32) on the CPU, one process, one model; each *phase* builds
an engine with one scheduler setting (``policy:budget``, e.g. ``fcfs:2048`` = the original policy and
budget, ``fair:512``) over the same weights, so before and after run in the same run on the same box.

In each phase, for ``--duration`` seconds:

* tenant A keeps ``--a-inflight`` requests of ``--a-prompt`` random tokens (no prefix-cache hits) with
  ``max_tokens`` 1 in the engine, submitting a new one as soon as one finishes (the issue's probe);
* tenant B submits a ``--b-prompt``-token request with ``max_tokens`` 4 at Poisson arrivals (mean gap
  ``--b-gap`` seconds, same seeded schedule in every phase).

Then new B requests stop, A's load continues, and the phase ends when every B request has its first
token (no censored samples). The driver steps the engine in this thread and submits requests between
steps, as ``AsyncLLM``'s engine thread does; a request's TTFT is counted from its *scheduled* arrival,
so the part of a step it arrived during counts too. Reported per phase: B's TTFT p50/p99/max; the
cost side: tokens the engine computed per second of stepping (``computed_tok_s``, partial prefills
included), A's finished prompts; step count and mean step time.

``--throughput`` also runs ``bench/engine_cpu.py``'s offline workload (32 mixed prompts, one tenant)
under each policy at that benchmark's budget (512), same run: the continuous-batching throughput cost.

``--overhead`` measures only the scheduler's own cost per step (no model) under each policy.

Usage: python bench/fairness.py [--threads 1] [--phase fcfs:2048 --phase fair:2048 ...] [--throughput]
       python bench/fairness.py --overhead
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's packages, not an installed copy
sys.path.insert(1, str(ROOT / "bench"))

import torch  # noqa: E402

from engine.default_model import default_model_dir  # noqa: E402
from engine.engine_config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.loader import load_model  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.tokenizer import Tokenizer  # noqa: E402


def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (p99 of fewer than 100 samples is the maximum)."""
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, -(-len(s) * q // 100) - 1))]


def b_schedule(duration: float, gap: float, seed: int) -> list[float]:
    """Poisson arrival offsets of B's requests in [0, duration)."""
    rng, t, out = random.Random(seed), 0.0, []
    while True:
        t += rng.expovariate(1.0 / gap)
        if t >= duration:
            return out
        out.append(t)


class Phase:
    """One engine, one scheduler setting, the A/B load; :meth:`run` returns the figures."""

    def __init__(self, engine: LLMEngine, args: argparse.Namespace) -> None:
        self.engine, self.args = engine, args
        self.rng = random.Random(args.seed)
        self.a_live: set[str] = set()
        self.b_pending: dict[str, float] = {}   # request id -> scheduled arrival
        self.ttft: list[float] = []
        self.a_prompt_tokens = 0
        self.count = 0
        self.computed = {"A": 0, "B": 0}         # tokens the engine computed per tenant (partial prefills too)
        commit = engine.scheduler.commit_step

        def counting_commit(sched):
            for s in sched.scheduled:
                self.computed[s.seq.request.cache_salt] += s.num_tokens
            commit(sched)
        engine.scheduler.commit_step = counting_commit

    def _submit(self, tenant: str, n: int, max_tokens: int, arrival: float) -> str:
        rid = f"{tenant}-{self.count}"
        self.count += 1
        ids = [self.rng.randrange(100, 40000) for _ in range(n)]
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        self.engine.enqueue(self.engine.make_request(rid, ids, params, cache_salt=tenant, arrival_time=arrival))
        return rid

    def _top_up_a(self) -> None:
        while len(self.a_live) < self.args.a_inflight:
            self.a_live.add(self._submit("A", self.args.a_prompt, 1, time.time()))

    def _collect(self, outputs) -> None:
        for out in outputs:
            if out.request_id in self.a_live and out.finished:
                self.a_live.discard(out.request_id)
                self.a_prompt_tokens += self.args.a_prompt
        for rid in list(self.b_pending):
            req = self.engine.requests.get(rid)
            first = req.metrics.first_token_time if req is not None else None
            if req is None or first is not None:
                self.ttft.append((first or time.time()) - self.b_pending.pop(rid))

    def run(self) -> dict:
        args, eng = self.args, self.engine
        arrivals = b_schedule(args.duration, args.b_gap, args.seed + 1)
        t0 = time.time()
        steps, step_s = 0, 0.0
        while arrivals or self.b_pending:
            now = time.time()
            while arrivals and t0 + arrivals[0] <= now:
                at = t0 + arrivals.pop(0)
                self.b_pending[self._submit("B", args.b_prompt, 4, at)] = at
            self._top_up_a()
            s = time.perf_counter()
            outs = eng.step()
            step_s += time.perf_counter() - s
            steps += 1
            self._collect(outs)
        wall = time.time() - t0
        for rid in list(eng.requests):
            eng.abort_request(rid)
        return {"b_requests": len(self.ttft), "b_ttft_p50_s": percentile(self.ttft, 50),
                "b_ttft_p99_s": percentile(self.ttft, 99), "b_ttft_max_s": max(self.ttft),
                "b_ttft_mean_s": statistics.mean(self.ttft), "a_prompts_done": self.a_prompt_tokens // args.a_prompt,
                "a_prompt_tok_s": self.a_prompt_tokens / wall, "phase_s": wall, "steps": steps,
                "computed_tok_s": sum(self.computed.values()) / step_s,
                "a_computed_tokens": self.computed["A"], "b_computed_tokens": self.computed["B"],
                "mean_step_s": step_s / max(steps, 1), "preemptions": eng.scheduler.num_preemptions}


def engine_for(model, tok, policy: str, budget: int, args) -> LLMEngine:
    cfg = EngineConfig(device="cpu", scheduling_policy=policy, max_num_batched_tokens=budget,
                       kv_cache_bytes=args.kv_gib << 30, max_model_len=args.a_prompt + 64)
    return LLMEngine(model, tok, cfg)


def offline_throughput(model, tok, policy: str) -> dict:
    """bench/engine_cpu.py's offline workload and engine settings, under ``policy``."""
    from engine_cpu import run_ours, workload

    from engine.llm import LLM

    llm = LLM(model, tok, EngineConfig(device="cpu", max_num_seqs=64, max_num_batched_tokens=512,
                                       kv_cache_bytes=1 << 30, max_model_len=2048, scheduling_policy=policy))
    work = workload(32, 0, False)
    llm.generate([work[0][0]], SamplingParams(max_tokens=2))  # warm-up
    dt, tokens, _ = run_ours(llm, work)
    return {"s": dt, "tok_s": tokens / dt, "output_tokens": tokens}


def scheduler_overhead(policy: str, steps: int = 200) -> float:
    """Milliseconds per ``schedule()`` + commit with 256 decodes running and 500 prompts of 8 tenants
    waiting (``max_num_seqs`` full): the per-step cost a GPU decode step (3-9 ms) would pay."""
    from engine.block_manager import BlockManager
    from engine.scheduler import Scheduler
    from engine.sequence import Request, Sequence

    cfg = EngineConfig(device="cpu", max_num_batched_tokens=2048, max_num_seqs=256, num_kv_blocks=20000,
                       block_size=16, scheduling_policy=policy)
    sched = Scheduler(cfg, BlockManager(20000, 16))
    for i in range(756):
        ids = [i * 1000 + j for j in range(64)]
        req = Request(f"r{i}", ids, SamplingParams(), float(i), f"t{i % 8}")
        req.seqs.append(Sequence(i, req, 0, ids, None))
        sched.add(req.seqs[0])

    def step() -> None:
        out = sched.schedule()
        sched.commit_step(out)
        for s in out.scheduled:
            if s.samples:
                s.seq.append_token(5)
    for _ in range(20):
        step()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - t0) / steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--phase", action="append", help="policy:budget (default fcfs:2048, fair:2048, fair:512)")
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of B arrivals per phase")
    ap.add_argument("--a-prompt", type=int, default=8000)
    ap.add_argument("--a-inflight", type=int, default=2)
    ap.add_argument("--b-prompt", type=int, default=16)
    ap.add_argument("--b-gap", type=float, default=2.0, help="mean seconds between B's requests")
    ap.add_argument("--kv-gib", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--throughput", action="store_true", help="also the offline throughput per policy")
    ap.add_argument("--overhead", action="store_true", help="only the scheduler's per-step cost (no model)")
    ap.add_argument("--json", help="write results here")
    args = ap.parse_args()
    if args.overhead:
        print(json.dumps({p: {"ms_per_step": scheduler_overhead(p)} for p in ("fcfs", "fair")}))
        return
    phases = args.phase or ["fcfs:2048", "fair:2048", "fair:512"]
    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()
    folder = default_model_dir()
    model, tok = load_model(folder), Tokenizer.from_folder(folder)
    res: dict = {"threads": args.threads, "a_prompt": args.a_prompt, "a_inflight": args.a_inflight,
                 "b_prompt": args.b_prompt, "b_gap_s": args.b_gap, "duration_s": args.duration, "phases": {}}
    for spec in phases:
        policy, budget = spec.split(":")
        engine = engine_for(model, tok, policy, int(budget), args)
        res["phases"][spec] = Phase(engine, args).run()
        print(spec, json.dumps(res["phases"][spec]), flush=True)
        del engine
        gc.collect()
    if args.throughput:
        res["offline"] = {p: offline_throughput(model, tok, p) for p in ("fcfs", "fair")}
        res["offline"]["fair_vs_fcfs"] = res["offline"]["fair"]["tok_s"] / res["offline"]["fcfs"]["tok_s"]
    res["loadavg_start"], res["loadavg_end"] = load_start, os.getloadavg()
    print(json.dumps(res, indent=2))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=2)


if __name__ == "__main__":
    main()
