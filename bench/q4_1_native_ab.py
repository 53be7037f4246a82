"""Batch-1 decode of the default model at native Q4_1, in one run: our native kernels (kernels.cpu) against
torch's int4 kernel (the same model loaded twice, the second with the native path turned off per layer).

    flock /tmp/cipherlm-bench.lock env PYTHONPATH=. python bench/q4_1_native_ab.py [--threads 1] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    import torch

    from engine.threads import configure

    configure(args.threads)
    torch.set_num_threads(args.threads)
    from llamacpp import engine_for
    from quant_cpu import cpu_time, load_formats, ppl_text

    from engine.cpu_linear import fused_modules
    from engine.quant import Int4Linear
    from engine.tokenizer import Tokenizer

    native, fp32_dir = load_formats(["q4_1"])
    plain, _ = load_formats(["q4_1"])
    tok = Tokenizer.from_folder(fp32_dir)
    prompt = tok.encode(ppl_text())[1000:1128]
    engines = {"native kernels": engine_for(native["q4_1"], tok, args.threads, True),
               "torch int4 kernel": engine_for(plain["q4_1"], tok, args.threads, True)}
    for m in list(plain["q4_1"].modules()) + fused_modules(plain["q4_1"]):
        if isinstance(m, Int4Linear):
            m._native_fn = False                      # "not eligible": the torch kernel runs
    for eng in engines.values():
        cpu_time(eng, prompt, 4, "w")
    res = {k: [] for k in engines}
    for r in range(args.rounds):
        for k, eng in engines.items():
            one = cpu_time(eng, prompt, 1, f"a{r}")
            res[k].append(32 / (cpu_time(eng, prompt, 33, f"b{r}") - one))
    med = {k: statistics.median(v) for k, v in res.items()}
    for k, v in res.items():
        print(f"{k}: decode {med[k]:.1f} tok/CPU-s (rounds {', '.join(f'{x:.1f}' for x in v)})")
    print(f"native / torch: {med['native kernels'] / med['torch int4 kernel']:.2f}x")


if __name__ == "__main__":
    main()
