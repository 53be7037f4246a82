"""Prefill/decode disaggregation vs colocated on the CPU: TTFT and TPOT at a mixed load, KV transfer time.

One run, same machine, same model (the default SmolLM2, fp32), same workload, both through
``engine.disagg.Router``: **colocated** — one engine process with all the threads doing prefill and
decode; **disaggregated** — a prefill process and a decode process with half the threads each, the KV
blocks moved through a shared-memory ring. Workload: ``--streams`` short prompts decoding ``--decode-tokens``
tokens from t = 0, and ``--long`` long prompts of ``--long-len`` tokens arriving every ``--gap`` seconds
during the decodes (each answering ``--long-tokens`` tokens).

    python bench/disagg_cpu.py [--streams 4] [--long 3] [--long-len 768] [--gap 1.5] [--threads 2]

CPU caveat: the two instances split two cores, so disaggregation here trades the colocated engine's
second thread for isolation; on GPUs each instance has its own device, which is the case it is built for.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch


def workload(args, vocab: int):
    from engine.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(0)
    short = SamplingParams(temperature=0, max_tokens=args.decode_tokens, ignore_eos=True)
    long_ = SamplingParams(temperature=0, max_tokens=args.long_tokens, ignore_eos=True)
    work = [(0.0, f"s{i}", torch.randint(0, vocab, (32,), generator=g).tolist(), short)
            for i in range(args.streams)]
    work += [(args.start + i * args.gap, f"l{i}", torch.randint(0, vocab, (args.long_len,), generator=g).tolist(),
              long_) for i in range(args.long)]
    return work


def summary(traces) -> dict:
    longs = [t for rid, t in traces.items() if rid.startswith("l")]
    shorts = [t for rid, t in traces.items() if rid.startswith("s")]
    gaps = [b - a for t in shorts for a, b in zip(t.token_times, t.token_times[1:], strict=False)]
    return dict(ttft_long=statistics.median(t.ttft for t in longs),
                ttft_short=statistics.median(t.ttft for t in shorts),
                tpot_short=statistics.median(t.tpot for t in shorts),
                itl_p99=sorted(gaps)[int(0.99 * (len(gaps) - 1))],
                kv_ms=1e3 * statistics.median(t.kv_transfer_s for t in longs) if longs[0].kv_blocks else 0.0,
                kv_copy_ms=1e3 * statistics.median(t.kv_copy_s for t in longs) if longs[0].kv_blocks else 0.0,
                kv_blocks=statistics.median(t.kv_blocks for t in longs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--decode-tokens", type=int, default=96)
    ap.add_argument("--long", type=int, default=3)
    ap.add_argument("--long-len", type=int, default=768)
    ap.add_argument("--long-tokens", type=int, default=8)
    ap.add_argument("--start", type=float, default=1.0)
    ap.add_argument("--gap", type=float, default=1.5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    # idle OpenMP threads sleep: two engine processes share the cores (engine/threads.py); inherited by both
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

    from engine.default_model import default_model_dir
    from engine.disagg import Router
    from engine.sampling_params import SamplingParams

    model = str(default_model_dir())
    kw = dict(block_size=16, num_kv_blocks=512, max_model_len=2048)
    print(f"{args.streams} decode streams x {args.decode_tokens} tokens; {args.long} prompts of {args.long_len} "
          f"tokens every {args.gap} s from t = {args.start} s; {args.threads} threads in all")
    for name, colocated, threads in (("colocated", True, args.threads),
                                     ("disaggregated", False, max(1, args.threads // 2))):
        with Router(model, dict(kw, threads=threads), colocated=colocated) as router:
            warm = SamplingParams(temperature=0, max_tokens=4)  # oneDNN packing, first-step allocations
            router.run([(0.0, "warm", list(range(1, 200)), warm)])
            s = summary(router.run(workload(args, 49152)))
        print(f"{name:14s} TTFT long {1e3 * s['ttft_long']:7.0f} ms  TTFT short {1e3 * s['ttft_short']:6.0f} ms  "
              f"TPOT short {1e3 * s['tpot_short']:6.1f} ms  ITL p99 {1e3 * s['itl_p99']:6.0f} ms  "
              f"KV transfer {s['kv_ms']:.1f} ms (copies {s['kv_copy_ms']:.1f} ms) for {s['kv_blocks']:.0f} blocks",
              flush=True)


if __name__ == "__main__":
    main()
