"""Speculative decoding (n-gram prompt lookup) on the real default model, CPU: speed-up and acceptance.

Workload where n-grams help: chat prompts that ask the model to quote a passage, edit a JSON object or
rename a function in code and return the whole text (the answer copies long runs of the prompt). Greedy,
EOS ends a completion (both modes produce the same tokens: the script checks it).

Measures, in one run, for batch 1 (each prompt alone, one after the other), 8 and 32 (the prompts cycled,
one ``generate`` call):

* ``base``: no speculation (``num_speculative_tokens=0``);
* ``spec``: ``k`` drafts per step, never switched off;
* ``auto``: ``k`` drafts per step with the deployment's switch-off by load
  (``speculative_disable_by_batch_size``, ``--disable-by``): what a server runs.

Output: generated tokens per second of each mode, the ratios to ``base``, the acceptance rate and the
tokens a verify step emits; the load average at the start and the end (other jobs skew CPU figures).

Usage: python bench/spec_decode.py [--threads 1] [--k 8] [--max-tokens 128] [--batches 1,8,32]
       [--disable-by 4] [--repeats 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import torch

from engine.default_model import default_model_dir
from engine.engine_config import EngineConfig
from engine.llm import LLM
from engine.sampling_params import SamplingParams

PASSAGE = (
    "The old lighthouse stood at the edge of the cliff for more than two hundred years. Every night its "
    "keeper climbed the one hundred and twelve steps to light the lamp, and every morning he wrote the "
    "weather, the ships he had seen and the state of the sea in a leather book. When the lamp was finally "
    "replaced by an automatic beacon, the book was sent to the town museum, where it still lies open at "
    "the page of the great storm of 1881.")
PASSAGE_2 = (
    "To reset the router, unplug it from the wall and wait thirty seconds. Plug it back in and wait until "
    "the power light turns solid green. Then press and hold the reset button on the back for ten seconds, "
    "until all the lights blink at once. The router will restart with its factory settings, and the "
    "default network name and password are printed on the label underneath.")
JSON_DOC = json.dumps({
    "id": 4172, "title": "Quarterly report", "status": "draft", "owner": {"name": "Maria Lopez",
    "email": "maria.lopez@example.com"}, "tags": ["finance", "q3", "internal"],
    "sections": [{"heading": "Revenue", "pages": 4}, {"heading": "Costs", "pages": 3},
                 {"heading": "Outlook", "pages": 2}]}, indent=2)
CODE = '''def calc(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item["price"] * item["quantity"]
    tax = subtotal * tax_rate
    return subtotal + tax


def report(items):
    total = calc(items, 0.2)
    print("Total:", round(total, 2))
'''

PROMPTS = [
    f"Repeat the following text exactly, word for word:\n\n{PASSAGE}",
    f"Copy this paragraph exactly as it is written:\n\n{PASSAGE_2}",
    f"Here is a JSON object:\n{JSON_DOC}\nChange \"status\" to \"final\" and return the whole JSON object.",
    f"Rename the function calc to compute_total in this Python code and return the full code:\n\n{CODE}",
    f"Quote the following passage in full:\n\n{PASSAGE_2}",
    f"Return this JSON unchanged:\n{JSON_DOC}",
]


def chat_ids(llm: LLM) -> list[list[int]]:
    return [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]


def run_mode(llm: LLM, prompts: list[list[int]], batch: int, k: int, disable_by: int | None,
             max_tokens: int) -> dict:
    """One mode at one batch size: tokens/s, the outputs, the speculation counters it added."""
    spec = llm.engine.spec
    spec.config = dataclasses.replace(spec.config, disable_by_batch_size=disable_by)
    before = (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, num_speculative_tokens=k)
    work = [prompts[i % len(prompts)] for i in range(max(batch, len(prompts)) if batch == 1 else batch)]
    t0 = time.perf_counter()
    if batch == 1:
        outs = [llm.generate([p], params)[0] for p in work]
    else:
        outs = llm.generate(work, params)
    elapsed = time.perf_counter() - t0
    tokens = [o.outputs[0].token_ids for o in outs]
    drafts, scored, accepted = (a - b for a, b in zip(
        (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens), before, strict=True))
    n = sum(len(t) for t in tokens)
    return {"tokens": n, "seconds": round(elapsed, 3), "tokens_per_s": round(n / elapsed, 2),
            "acceptance_rate": round(accepted / scored, 3) if scored else None,
            "tokens_per_verify": round(1 + accepted / drafts, 2) if drafts else None,
            "verify_steps": drafts, "_outputs": tokens}


def bench_batch(llm: LLM, prompts, batch: int, args) -> dict:
    modes = {"base": (0, None), "spec": (args.k, None), "auto": (args.k, args.disable_by)}
    if batch <= args.disable_by:
        del modes["auto"]  # the switch does not fire: auto is spec
    results: dict[str, list[dict]] = {m: [] for m in modes}
    for _ in range(args.repeats):
        for name, (k, off) in modes.items():
            results[name].append(run_mode(llm, prompts, batch, k, off, args.max_tokens))
    best = {m: max(rs, key=lambda r: r["tokens_per_s"]) for m, rs in results.items()}
    same = all(r["_outputs"] == best["base"]["_outputs"] for rs in results.values() for r in rs)
    row = {"batch": batch, "identical_outputs": same}
    for m, r in best.items():
        row[m] = {key: v for key, v in r.items() if not key.startswith("_")}
        if m != "base":
            row[f"{m}_vs_base"] = round(r["tokens_per_s"] / best["base"]["tokens_per_s"], 3)
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--disable-by", type=int, default=EngineConfig().speculative_disable_by_batch_size)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()
    llm = LLM(default_model_dir(), engine_config=EngineConfig(device="cpu", num_threads=args.threads,
                                                              max_num_seqs=64))
    prompts = chat_ids(llm)
    rows = [bench_batch(llm, prompts, int(b), args) for b in args.batches.split(",")]
    report = {"model": "SmolLM2-135M-Instruct (fp32, CPU)", "threads": args.threads, "k": args.k,
              "max_tokens": args.max_tokens, "disable_by_batch_size": args.disable_by,
              "prompt_tokens": [len(p) for p in prompts], "load_avg_start": load_start,
              "load_avg_end": os.getloadavg(), "results": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
