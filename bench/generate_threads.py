"""``cipherlm generate`` on an idle and on a loaded machine: the thread policy against torch's default.

Issue 13, item 1: with torch's default (one spinning OpenMP thread per CPU) ``cipherlm generate`` ran
~10x slower when other processes kept the cores busy. This script runs, alternated in one session:

* ``policy``  — ``cipherlm generate`` as shipped (``engine.threads``: threads from physical cores and
  current load, ``OMP_WAIT_POLICY=PASSIVE``);
* ``torch-default`` — the same generation with torch's defaults (what ``generate`` did before: the
  engine, prompt and timing of ``cipherlm generate``, without the thread policy);

each on an idle machine and with ``--busy`` processes spinning (one per usable CPU by default; they
start ``--warmup`` seconds ahead so the load average sees them). Reported: decode tokens per second
(median over rounds) and the loaded/idle slowdown of each. Run it under the heavy lock:

    flock /tmp/cipherlm-heavy.lock nice python bench/generate_threads.py --rounds 3
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import re
import statistics
import subprocess
import sys
import time

PROMPT = "What is the capital of France?"
_TIMING = re.compile(r"\[(\d+) tokens in ([\d.]+) s")
_THREADS = re.compile(r"\[cipherlm\] (\d+) CPU thread")


def _spin() -> None:
    while True:
        pass


def _torch_default(max_tokens: int) -> None:
    """``cipherlm generate``'s body without the thread policy (torch's own defaults)."""
    import torch

    from engine.default_model import default_model_dir
    from engine.engine_config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    engine = LLMEngine.from_pretrained(default_model_dir(), EngineConfig(device="cpu", kv_cache_bytes=64 << 20))
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}])
    engine.add_request("bench-0", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    t0, n = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            n = len(out.outputs[0].token_ids)
    dt = time.perf_counter() - t0
    print(f"[cipherlm] {torch.get_num_threads()} CPU thread(s) (torch default)", file=sys.stderr)
    print(f"[{n} tokens in {dt:.2f} s, {n / dt:.1f} tok/s]", file=sys.stderr)


def run_once(mode: str, max_tokens: int) -> tuple[float, int]:
    """(decode tokens/s, threads used) of one fresh process."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "CIPHERLM_THREADS")}
    if mode == "policy":
        cmd = [sys.executable, "-m", "server.cli", "generate", PROMPT, "--max-tokens", str(max_tokens)]
    else:
        cmd = [sys.executable, __file__, "--torch-default-worker", "--max-tokens", str(max_tokens)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    timing, threads = _TIMING.search(proc.stderr), _THREADS.search(proc.stderr)
    if proc.returncode != 0 or not timing or not threads:
        raise RuntimeError(f"{mode} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    n, dt = int(timing.group(1)), float(timing.group(2))
    return n / dt, int(threads.group(1))


def main(argv: list[str] | None = None) -> int:
    """Run the rounds and print a markdown table."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--busy", type=int, default=len(os.sched_getaffinity(0)), help="spinning processes")
    ap.add_argument("--warmup", type=float, default=20.0, help="seconds the load runs before measuring")
    ap.add_argument("--modes", default="policy,torch-default")
    ap.add_argument("--torch-default-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.torch_default_worker:
        _torch_default(args.max_tokens)
        return 0
    modes = args.modes.split(",")
    results: dict[tuple[str, str], list[tuple[float, int]]] = {}
    for r in range(args.rounds):
        for loaded in (False, True):
            busy = [mp.Process(target=_spin, daemon=True) for _ in range(args.busy if loaded else 0)]
            for p in busy:
                p.start()
            if busy:
                time.sleep(args.warmup)
            try:
                for mode in modes:
                    got = run_once(mode, args.max_tokens)
                    results.setdefault((mode, "loaded" if loaded else "idle"), []).append(got)
                    print(f"round {r + 1} {mode:14s} {'loaded' if loaded else 'idle':6s} "
                          f"{got[0]:6.2f} tok/s ({got[1]} threads)", file=sys.stderr, flush=True)
            finally:
                for p in busy:
                    p.terminate()
                    p.join()
    print(f"\n{args.max_tokens} tokens, {args.rounds} rounds, {args.busy} busy processes when loaded, "
          f"{len(os.sched_getaffinity(0))} CPUs\n")
    print("| mode | threads idle / loaded | idle tok/s | loaded tok/s | loaded/idle time |")
    print("|---|---|---|---|---|")
    for mode in modes:
        idle, busy = results[(mode, "idle")], results[(mode, "loaded")]
        i, b = statistics.median(x[0] for x in idle), statistics.median(x[0] for x in busy)
        threads = f"{sorted({x[1] for x in idle})} / {sorted({x[1] for x in busy})}"
        print(f"| {mode} | {threads} | {i:.2f} | {b:.2f} | {i / b:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
