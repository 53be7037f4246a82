"""CPU benchmark of the plaintext engine against Hugging Face transformers on SmolLM2-135M.

Measures, in one run and with the same torch thread count for both:
1. offline throughput on 32 prompts of mixed lengths and mixed requested output lengths (greedy, EOS
   ignored): our engine (continuous batching, paged KV) vs ``transformers`` ``generate`` with static,
   left-padded batches (a static batch runs until its longest request is done; only requested tokens
   are counted as useful output for both);
2. single-request decode tokens/s (128-token prompt): (t(65 new) - t(1 new)) / 64 for both, the median of
   ``--decode-repeats`` alternating measurements;
3. KV slot usage under the workload: tokens held / slots allocated, paged (blocks in use) vs a contiguous
   per-sequence reservation of the workload's maximum length, time-averaged over engine steps.

The load average of the machine is recorded at the start and the end (other jobs skew CPU figures).
``--hf-batch`` may be given several times to measure more than one static batch size for the peer in
the same run; ``throughput_ratio`` is against the first.

Usage: python bench/engine_cpu.py [--threads 2] [--hf-batch 8 [--hf-batch 32]] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

import torch

from engine.default_model import default_model_dir
from engine.engine_config import EngineConfig
from engine.llm import LLM
from engine.sampling_params import SamplingParams


def workload(n: int, seed: int, quick: bool) -> list[tuple[list[int], int]]:
    """(prompt ids, requested new tokens) pairs: prompts 16-384 tokens, outputs 16-160 tokens."""
    rng = random.Random(seed)
    hi_p, hi_o = (96, 48) if quick else (384, 160)
    return [([rng.randrange(100, 40000) for _ in range(rng.randint(16, hi_p))], rng.randint(16, hi_o))
            for _ in range(n)]


def run_ours(llm: LLM, work) -> tuple[float, int, dict]:
    """Offline throughput of our engine; also samples KV slot usage after every step."""
    engine = llm.engine
    max_len = max(len(p) for p, _ in work) + max(n for _, n in work)
    usage = {"paged": [], "contiguous": []}
    step = engine.step

    def sampled_step():
        outs = step()
        seqs = engine.scheduler.running
        held = sum(s.num_computed_tokens for s in seqs)
        blocks = engine.block_manager.num_blocks - engine.block_manager.num_free_blocks
        if seqs and blocks:
            usage["paged"].append(held / (blocks * engine.block_manager.block_size))
            usage["contiguous"].append(held / (len(seqs) * max_len))
        return outs

    engine.step = sampled_step
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in work]
    t0 = time.perf_counter()
    outs = llm.generate([p for p, _ in work], params)
    dt = time.perf_counter() - t0
    engine.step = step
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return dt, tokens, {k: statistics.mean(v) for k, v in usage.items()}


@torch.inference_mode()
def run_hf(hf, work, batch: int, pad_id: int) -> tuple[float, int, int]:
    """Static batches in submission order, left-padded; returns (seconds, useful tokens, computed tokens)."""
    useful = computed = 0
    t0 = time.perf_counter()
    for i in range(0, len(work), batch):
        chunk = work[i:i + batch]
        width = max(len(p) for p, _ in chunk)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p, _ in chunk])
        pads = torch.tensor([width - len(p) for p, _ in chunk])
        mask = (torch.arange(width)[None, :] >= pads[:, None]).long()
        new = max(n for _, n in chunk)
        hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                    do_sample=False, pad_token_id=pad_id)
        useful += sum(n for _, n in chunk)
        computed += new * len(chunk)
    return time.perf_counter() - t0, useful, computed


def decode_rate_ours(llm: LLM, prompt: list[int], n: int) -> float:
    def t(k):
        t0 = time.perf_counter()
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=k, ignore_eos=True))
        return time.perf_counter() - t0
    salt = llm.engine.block_manager
    salt.enable_prefix_caching = False  # the second run must not skip its prefill
    t(2)
    rate = n / (t(n + 1) - t(1))
    salt.enable_prefix_caching = True
    return rate


@torch.inference_mode()
def decode_rate_hf(hf, prompt: list[int], n: int, pad_id: int) -> float:
    ids = torch.tensor([prompt])

    def t(k):
        t0 = time.perf_counter()
        hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=k, min_new_tokens=k,
                    do_sample=False, pad_token_id=pad_id)
        return time.perf_counter() - t0
    t(2)
    return n / (t(n + 1) - t(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--hf-batch", type=int, action="append", help="static batch size(s) of the peer (default 8)")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--decode-repeats", type=int, default=3, help="single-request rates: median of this many")
    ap.add_argument("--quick", action="store_true", help="short prompts/outputs (smoke test)")
    ap.add_argument("--json", help="write results here")
    args = ap.parse_args()
    batches = args.hf_batch or [8]
    load_start = os.getloadavg()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    folder = default_model_dir()
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    pad_id = hf.config.eos_token_id if isinstance(hf.config.eos_token_id, int) else 0
    llm = LLM(folder, engine_config=EngineConfig(device="cpu", max_num_seqs=64, max_num_batched_tokens=512,
                                                 kv_cache_bytes=1 << 30, max_model_len=2048))
    work = workload(args.requests, 0, args.quick)
    llm.generate([work[0][0]], SamplingParams(max_tokens=2))  # warm-up
    dt_o, tok_o, kv = run_ours(llm, work)
    peers = {b: run_hf(hf, work, b, pad_id) for b in batches}
    dt_h, tok_h, comp_h = peers[batches[0]]
    prompt = workload(1, 1, False)[0][0][:128]
    prompt += [101] * (128 - len(prompt))
    n_dec = 32 if args.quick else 64
    rates = [(decode_rate_ours(llm, prompt, n_dec), decode_rate_hf(hf, prompt, n_dec, pad_id))
             for _ in range(args.decode_repeats)]  # alternating, so a load change hits both sides
    r_o = statistics.median(r for r, _ in rates)
    r_h = statistics.median(r for _, r in rates)
    res = {
        "threads": args.threads, "requests": len(work),
        "prompt_tokens": sum(len(p) for p, _ in work), "output_tokens": tok_o,
        "ours_s": dt_o, "ours_tok_s": tok_o / dt_o,
        f"hf_static_b{batches[0]}_s": dt_h, "hf_tok_s": tok_h / dt_h, "hf_computed_tokens": comp_h,
        "throughput_ratio": (tok_o / dt_o) / (tok_h / dt_h),
        **{f"hf_static_b{b}": {"s": d, "tok_s": t / d, "computed_tokens": c, "ratio": (tok_o / dt_o) / (t / d)}
           for b, (d, t, c) in peers.items() if b != batches[0]},
        "decode_ours_tok_s": r_o, "decode_hf_tok_s": r_h, "decode_ratio": r_o / r_h,
        "kv_used_fraction_paged": kv["paged"], "kv_used_fraction_contiguous": kv["contiguous"],
        "loadavg_start": load_start, "loadavg_end": os.getloadavg(),
    }
    print(json.dumps(res, indent=2))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=2)


if __name__ == "__main__":
    main()
