"""Single-request CPU decode: our reference model vs transformers ``generate``, same run.

Same weights (the default SmolLM2 folder, fp32), same threads, same prompt, greedy, a fixed number of
new tokens (EOS ignored). Prints tokens/s of each and the ratio (median of several alternating runs).

    python bench/decode_cpu.py [--model PATH] [--new-tokens 64] [--repeats 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    from engine import Tokenizer, default_model_dir, greedy_generate, load_model

    folder = args.model or default_model_dir()
    ours = load_model(folder)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    tok = Tokenizer.from_folder(folder)
    ids = tok.apply_chat_template([{"role": "user", "content": "Write a short story about a lighthouse."}])
    n = args.new_tokens

    def run_ours() -> list[int]:
        return greedy_generate(ours, ids, n)

    def run_hf() -> list[int]:
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                          pad_token_id=tok.eos_token_id)
        return out[0, len(ids):].tolist()

    times = {"cipherlm": [], "transformers": []}
    with torch.inference_mode():
        run_ours(), run_hf()  # warm-up
        for _ in range(args.repeats):
            for name, fn in (("cipherlm", run_ours), ("transformers", run_hf)):
                t0 = time.perf_counter()
                out = fn()
                times[name].append(time.perf_counter() - t0)
                assert len(out) == n
    tps = {k: n / statistics.median(v) for k, v in times.items()}
    print(f"prompt {len(ids)} tokens, {n} new tokens, {args.threads} threads, median of {args.repeats}")
    print("| impl | tokens/s |\n|---|---|")
    for k, v in tps.items():
        print(f"| {k} | {v:.1f} |")
    print(f"ratio cipherlm / transformers: {tps['cipherlm'] / tps['transformers']:.2f}x")


if __name__ == "__main__":
    main()
