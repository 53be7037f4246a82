"""Where a batch-1 CPU decode step of the real default model goes, with and without the fused native step.

For each format (``fp32``: the cached default model; ``q4_1``: its GGUF blocks natively) and each setting of
``EngineConfig.cpu_fused_decode``: decode tokens per CPU-second after a 128-token context (the difference of
a 33-token and a 1-token generation, as ``bench/llamacpp.py`` measures it), the CPU time per step inside
``ModelRunner.execute`` and in the rest of the engine step (scheduler, sampler, detokenizer), and the torch
profiler's top ops over 16 steps (the profiler adds its own cost per op: read ratios, not absolutes).
Session 13 ran it before building the fused step (docs/benchmarks.md)::

    flock /tmp/cipherlm-bench.lock nice -n 5 env PYTHONPATH=. python bench/decode_step_cpu.py --threads 1
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--formats", default="fp32,q4_1")
    ap.add_argument("--modes", default="unfused,fused")
    ap.add_argument("--top", type=int, default=12, help="profiler rows per case")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    from engine.threads import configure

    configure(args.threads)
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.set_num_threads(args.threads)
    from quant_cpu import cpu_time, load_formats, ppl_text

    from engine.engine_config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams
    from engine.tokenizer import Tokenizer

    fmts = args.formats.split(",")
    models, folder = load_formats(fmts)
    tok = Tokenizer.from_folder(folder)
    prompt = tok.encode(ppl_text())[1000:1128]
    for fmt in fmts:
        for mode in args.modes.split(","):
            eng = LLMEngine(models[fmt], tok, EngineConfig(
                device="cpu", num_threads=args.threads, kv_cache_bytes=64 << 20, enable_prefix_caching=False,
                max_num_batched_tokens=512, cpu_fused_decode=mode == "fused"))
            assert (eng.runner.fused_decode is not None) == (mode == "fused"), mode
            cpu_time(eng, prompt, 4, "w")
            one, many = cpu_time(eng, prompt, 1, "a"), cpu_time(eng, prompt, 33, "b")
            print(f"## {fmt} {mode}: decode {32 / (many - one):.1f} tok/CPU-s ({(many - one) / 32 * 1e3:.2f} ms "
                  f"CPU per step)", flush=True)
            eng.add_request("p", prompt, SamplingParams(max_tokens=33, temperature=0.0, ignore_eos=True))
            eng.step()  # the prefill
            runner, spent = eng.runner, [0.0]
            inner = runner.execute

            def timed(*a, _inner=inner, _spent=spent, **k):
                t0 = time.process_time()
                out = _inner(*a, **k)
                _spent[0] += time.process_time() - t0
                return out

            runner.execute = timed
            t0, n = time.process_time(), 0
            while eng.has_unfinished_requests():
                eng.step()
                n += 1
            total = time.process_time() - t0
            runner.execute = inner
            print(f"{n} steps: {total / n * 1e3:.2f} ms CPU each, ModelRunner.execute {spent[0] / n * 1e3:.2f} ms, "
                  f"rest of the engine {(total - spent[0]) / n * 1e3:.2f} ms", flush=True)
            eng.add_request("q", prompt, SamplingParams(max_tokens=17, temperature=0.0, ignore_eos=True))
            eng.step()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                while eng.has_unfinished_requests():
                    eng.step()
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top), flush=True)


if __name__ == "__main__":
    main()
