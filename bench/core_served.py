"""The engine core process's own work per streamed row-step at a served load, in one process.

At 256 streamed users on a GPU the engine core process runs near one core (docs/benchmarks.md, "Session 24's
first device call": 27-38 µs of core CPU per token), so its host work per row bounds the served rate. This
script runs, in one process, what that core does each iteration: the scheduler, input building
(``ModelRunner._stage`` for the steps a decode graph runs, ``ModelRunner.prepare`` for the others: eager
on a GPU), the overlapped loop's placeholders, detokenization and stop checks with the real tokenizer, the
streamed wire deltas with the core's coalescing (``stream_coalesce_streams``, 96), the step's
:class:`engine.engine_core.StepBatch` pickled as the core sends it. It leaves out the pipe's system calls.

The model: without ``--model``, ``bench.serve_api_cpu``'s stub executor (no forward; ordinary word tokens
sampled), so the CPU time is the core's host work alone (``--tok`` names SmolLM2's tokenizer files); with
``--model DIR --device cuda`` the real engine on that model folder (``bench/random_model.py``), CUDA graphs and
all, so the wall per row-step is the served core's ceiling on that card, and eager steps and graph replays are timed
apart.

Load: ``--users`` requests always in flight, each finished one replaced at once by a 120-token prompt
(``serve_bench.py --request-rate inf``), output lengths uniform in [L/2, 3L/2] so finishes and arrivals
spread over the steps as a server's do. Prints, per round, CPU and wall µs per row-step (over the rows the
steps scheduled) and the share of eager steps (those that mix in a prefill the decode graphs do not take:
``--mixed-tokens``, ``EngineConfig.cuda_graph_mixed_tokens``; 0 makes every such step eager).

    python -m bench.core_served --tok DIR [--rounds 5] [--steps 300] [--delay 0] [--profile]
    python -m bench.core_served --model DIR --device cuda [--delay 0]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def build(tok_dir: str | None, users: int, delay: int, model: str | None = None, device: str = "cpu",
          mixed_tokens: int = 0):
    from bench import serve_api_cpu
    from engine.config import ModelConfig
    from engine.engine_config import EngineConfig
    from engine.llm import LLM
    from engine.model import LlamaForCausalLM
    from engine.tokenizer import Tokenizer

    if model is not None:  # the real engine: the server's settings that shape a step
        conf = EngineConfig(device=device, max_num_seqs=users, async_scheduling=True, admission_delay_steps=delay,
                            cuda_graph_mixed_tokens=mixed_tokens)
        llm = LLM(model, engine_config=conf)
        return _as_core(llm.engine)
    cfg = ModelConfig(model_type="llama", vocab_size=serve_api_cpu.HIDDEN_VOCAB, hidden_size=8,
                      intermediate_size=8, num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1,
                      head_dim=8, max_position_embeddings=4096, tie_word_embeddings=True)
    conf = EngineConfig(device="cpu", max_num_seqs=users, max_num_batched_tokens=8192, max_model_len=4096,
                        async_scheduling=True, admission_delay_steps=delay, gc_freeze=True,  # the GPU defaults
                        cuda_graph_mixed_tokens=mixed_tokens)
    llm = LLM(LlamaForCausalLM(cfg), engine_config=conf, tokenizer=Tokenizer.from_folder(tok_dir),
              parts=serve_api_cpu.stub_parts())
    return _as_core(llm.engine)


def _as_core(eng):
    """What engine_core.EngineCore and core_main set in the core process."""
    eng.output_processor.cumulative, eng.emit_deltas, eng.stream_outputs = False, True, True
    eng.delta_coalescing = 96
    return eng


class Load:
    """``users`` requests in flight; a finished one is replaced at once."""

    def __init__(self, eng, users: int, output_len: int, seed: int = 7) -> None:
        import random

        from engine.engine_core import StepBatch, encode

        self.eng, self.output_len, self.rng, self.n = eng, output_len, random.Random(seed), 0
        self.prompts = [[self.rng.randrange(600, 4600) for _ in range(120)] for _ in range(4 * users)]
        self.StepBatch, self.encode = StepBatch, encode
        graph_for = eng.executor.runner._graph_for
        self.mixed, self.last_mixed = 0, False

        def spy(scheduled):
            key = graph_for(scheduled)
            self.mixed += key is None
            self.last_mixed = key is None
            return key

        eng.executor.runner._graph_for = spy
        for _ in range(users):
            self.add()

    def add(self) -> None:
        from engine.sampling_params import SamplingParams

        rng, half = self.rng, self.output_len // 2
        ids = self.prompts[self.n % len(self.prompts)]  # drawn at the start: the harness's own cost stays out
        self.eng.add_request(f"r{self.n}", list(ids),
                             SamplingParams(temperature=0, max_tokens=half + rng.randint(0, 2 * half), ignore_eos=True))
        self.n += 1

    def run(self, steps: int) -> int:
        """``steps`` core iterations; the rows they scheduled (wall seconds per kind of step in ``walls``)."""
        from multiprocessing.reduction import ForkingPickler

        eng, rows, self.walls = self.eng, 0, {True: [], False: []}
        for _ in range(steps):
            rows += len(eng.scheduler.running)
            t0 = time.perf_counter()
            outs = eng.step()
            self.walls[self.last_mixed].append(time.perf_counter() - t0)
            deltas = [o if type(o) is tuple else self.encode(o) for o in outs]
            ForkingPickler.dumps(("step", self.StepBatch(deltas, eng.stats(), [], [], 0, 0, [])))
            for o in outs:
                if (o[1] if type(o) is tuple else o.finished):
                    self.add()
        return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tok", help="a folder with SmolLM2's tokenizer files (the stub model)")
    ap.add_argument("--model", help="a model folder: the real engine instead of the stub")
    ap.add_argument("--device", default="cpu", help="the real engine's device")
    ap.add_argument("--users", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--delay", type=int, default=0, help="admission_delay_steps")
    ap.add_argument("--mixed-tokens", type=int, default=0, help="cuda_graph_mixed_tokens (0, the default: mixed "
                                                                "steps eager)")
    ap.add_argument("--steps", type=int, default=300, help="steps per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--label", default="")
    ap.add_argument("--profile", action="store_true", help="one more round under cProfile (top 30 by own time)")
    args = ap.parse_args()
    if (args.tok is None) == (args.model is None):
        ap.error("give --tok (the stub model) or --model")
    eng = build(args.tok, args.users, args.delay, args.model, args.device, args.mixed_tokens)
    load = Load(eng, args.users, args.output_len)
    load.run(3 * args.output_len)  # past the first wave: arrivals spread over the steps
    per_row, wall_row, mixed, walls = [], [], [], {True: [], False: []}
    for _ in range(args.rounds):
        load.mixed = 0
        t0, w0 = time.process_time(), time.perf_counter()
        rows = load.run(args.steps)
        per_row.append(1e6 * (time.process_time() - t0) / rows)
        wall_row.append(1e6 * (time.perf_counter() - w0) / rows)
        mixed.append(load.mixed / args.steps)
        for kind in walls:
            walls[kind] += load.walls[kind]
    step_ms = {("eager" if k else "graph") + "_step_ms_median": round(1e3 * statistics.median(v), 3)
               for k, v in walls.items() if v}
    print(json.dumps({"label": args.label, "device": args.device, "delay": args.delay,
                      "mixed_tokens": args.mixed_tokens,
                      "us_per_row_step": [round(x, 2) for x in per_row],
                      "median": round(statistics.median(per_row), 2), "min": round(min(per_row), 2),
                      "wall_us_per_row_step_median": round(statistics.median(wall_row), 2),
                      "eager_share": round(statistics.mean(mixed), 3), **step_ms}))
    if args.profile:
        import cProfile
        import pstats

        prof = cProfile.Profile(time.process_time)
        prof.enable()
        load.run(args.steps)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)
    sys.stdout.flush()
    os._exit(0)  # as the core process leaves: the frozen heap's teardown only prints nanobind's leak report


if __name__ == "__main__":
    main()
