"""Tensor parallelism on the CPU (gloo): decode step time at 1 vs N ranks and the all-reduce time per step.

One run, same machine, same weights, same requests: the engine at ``tensor_parallel_size = 1`` (all
cores in one process) and at each N given (the cores shared out among N rank processes). Decode-only
steps of ``--batch`` sequences after their prefill; the collectives of rank 0 are timed inside the forward
(``engine.tp_linear.Comm``: two all-reduces per layer, one for the embedding, the head's all-gather).

    python bench/tp_cpu.py [--shape smollm2|mid] [--tp 1 3] [--batch 1 8] [--steps 24] [--threads 2]

``smollm2`` is the real default model (9 / 3 heads: N = 3 divides them, 2 does not); ``mid`` is a
random-weight Llama shape of 212 M parameters with 16 / 4 heads (N = 2 and 4 divide them).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: the ranks share the cores

import torch  # noqa: E402

MID = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=16,
           num_attention_heads=16, num_key_value_heads=4, head_dim=64, tie_word_embeddings=True,
           max_position_embeddings=2048)


def build(shape: str):
    from engine.config import ModelConfig
    from engine.default_model import default_model_dir
    from engine.loader import load_model
    from engine.model import LlamaForCausalLM

    if shape == "smollm2":
        return load_model(default_model_dir())
    torch.manual_seed(0)
    model = LlamaForCausalLM(ModelConfig(**MID))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    return model.eval()


def measure(model, tp: int, batch: int, steps: int, threads: int) -> dict:
    from engine.engine_config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    cfg = EngineConfig(device="cpu", num_kv_blocks=8 * batch + 16, max_model_len=1024, num_threads=threads,
                       tensor_parallel_size=tp)
    torch.set_num_threads(threads if tp == 1 else max(1, threads // tp))
    engine = LLMEngine(model, None, cfg)
    try:
        timed = tp > 1
        if timed:
            engine.executor.enable_timing()
        params = SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True)
        g = torch.Generator().manual_seed(1)
        for i in range(batch):
            engine.add_request(f"r{i}", torch.randint(0, 1000, (32,), generator=g).tolist(), params)
        while any(s.num_computed_tokens < 32 for s in engine.scheduler.running + engine.scheduler.waiting):
            engine.step()  # prefills
        engine.step()
        times, comm = [], []
        for _ in range(steps):
            c0 = engine.executor.comm.seconds if timed else 0.0
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
            comm.append(engine.executor.comm.seconds - c0 if timed else 0.0)
        calls = engine.executor.comm.calls if timed else 0
    finally:
        engine.shutdown()
    return dict(step_ms=1e3 * statistics.median(times), comm_ms=1e3 * statistics.median(comm),
                calls_per_step=calls / (steps + 1) if timed else 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=["smollm2", "mid"], default="mid")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    model = build(args.shape)
    print(f"shape {args.shape}, threads {args.threads} in all, decode steps {args.steps}")
    base = {}
    for batch in args.batch:
        for tp in args.tp:
            r = measure(model, tp, batch, args.steps, args.threads)
            base.setdefault(batch, r["step_ms"])
            print(f"batch {batch:3d}  tp {tp}: step {r['step_ms']:7.1f} ms  ({r['step_ms'] / base[batch]:.2f}x tp1)"
                  f"  collectives {r['comm_ms']:6.1f} ms/step over {r['calls_per_step']:.0f} calls", flush=True)


if __name__ == "__main__":
    main()
