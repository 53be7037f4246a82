"""The engine's host work per step, without a model: what the GPU engine's Python costs per row.

The model is replaced by a stub executor that builds the inputs the way the GPU path does (decode steps:
``ModelRunner._stage`` into the CUDA graphs' static buffers, here in plain CPU memory; other steps:
``ModelRunner.prepare``) and returns small logits (vocab 64) instead of running a forward, so a job's wall
is the host's own time: scheduler, block tables, input staging, sampling bookkeeping, stop checks, outputs
(``tokenizer``: detokenization too). Both loops (sync, overlap), the job of ``bench/engine_gpu.py``
(256 requests x (128 + 256) tokens), the Qwen2.5-0.5B pool size (183k blocks) by default.

``--steady 0,8``: a server's load instead (256 requests always in flight, each finished one replaced at once)
at these ``admission_delay_steps``: the share of steps that mix a prefill into the decodes (eager on a GPU).

Usage: python bench/engine_host_cpu.py [--loops sync,overlap] [--repeats 3] [--blocks 183000] [--profile]
       python bench/engine_host_cpu.py --requests 1 --repeats 5   # a batch-1 job: µs of host per step
       python bench/engine_host_cpu.py --steady 0,8
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch

from engine.config import ModelConfig
from engine.engine_config import EngineConfig
from engine.llm import LLM
from engine.model import LlamaForCausalLM
from engine.model_runner import LaunchedStep, ModelRunner, _StaticInputs, graph_buckets
from engine.parts import EngineParts
from engine.sampling_params import SamplingParams

C, PROMPT_LEN, OUTPUT_LEN, VOCAB = 256, 128, 256, 64


class StubRunner(ModelRunner):
    """A ModelRunner without a model: the GPU path's input building on the CPU, logits of zeros + row id."""

    def __init__(self, config: EngineConfig, max_model_len: int, num_blocks: int) -> None:  # noqa: D107
        self.config, self.device, self.block_size = config, torch.device("cpu"), config.block_size
        self.max_model_len, self.max_blocks_per_seq = max_model_len, -(-max_model_len // config.block_size)
        self.num_blocks, self.kv = num_blocks, None
        self._graph_max_batch, self._mixed_tokens = config.max_num_seqs, config.cuda_graph_mixed_tokens
        self._decode_buckets = graph_buckets(config.max_num_seqs, self._mixed_tokens)
        top = self._decode_buckets[-1]
        self._decode_in = _StaticInputs(top, top, self.max_blocks_per_seq, self.device)
        self._decode_in.upload = self._flip  # the host->device copy is the GPU's; on the CPU it only costs noise
        logits = torch.zeros(config.max_num_seqs, VOCAB)
        self._graphs = {(b, 0): (None, logits) for b in self._decode_buckets}
        self._one_pass, self._verify_cu = {}, {}
        self._sampled = self._decode_in.dev64[_StaticInputs.SAMPLED, :config.max_num_seqs]
        self._host_tokens, self._launches, self.graph_steps = [], 0, 0

    def init_kv_cache(self) -> int:
        return self.num_blocks

    def _flip(self, b: int) -> None:
        inp = self._decode_in
        inp._turn ^= 1
        inp._use(inp._turn)

    def _logits(self, n: int) -> torch.Tensor:
        out = torch.zeros(n, VOCAB)
        out[:, 1] = 1.0  # argmax: token 1
        return out

    def _run_graph(self, scheduled, b, k, feed: LaunchedStep | None = None):
        _, sampling = self._stage(scheduled, b, k, feed)
        self.graph_steps += 1
        return self._logits(len(sampling)), sampling

    def execute(self, sched, *, eager: bool = False):
        key = self._graph_for(sched.scheduled)
        if key is not None:
            return self._run_graph(sched.scheduled, *key)
        inputs = self.prepare(sched)
        return self._logits(len(inputs.logits_rows)), inputs.sampling

    def launch(self, sched, prev):
        key = self._graph_for(sched.scheduled)
        if key is not None:
            logits, sampling = self._run_graph(sched.scheduled, key[0], 0, prev)
        else:
            inputs = self.prepare(sched, prev)
            logits, sampling = self._logits(len(inputs.logits_rows)), inputs.sampling
        sampled = self._sampled[:len(sampling)]
        torch.argmax(logits, -1, out=sampled)
        return LaunchedStep(sampling, sampled.clone(), None)


class StubExecutor:
    """The in-process executor's calls over a :class:`StubRunner`."""

    def __init__(self, config: EngineConfig, max_model_len: int, num_blocks: int) -> None:
        from engine.executor import ModelOutput

        self.runner, self.device = StubRunner(config, max_model_len, num_blocks), torch.device("cpu")
        self._out = ModelOutput

    def init_kv_cache(self) -> int:
        return self.runner.init_kv_cache()

    def execute(self, sched):
        return self._out(*self.runner.execute(sched))

    def launch(self, sched, prev):
        return self.runner.launch(sched, prev)

    @property
    def graph_steps(self) -> int:
        return self.runner.graph_steps

    def shutdown(self) -> None:
        pass


def build(overlap: bool, num_blocks: int, admission_delay_steps: int = 0) -> LLM:
    cfg = ModelConfig(model_type="llama", vocab_size=VOCAB, hidden_size=8, intermediate_size=8,
                      num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1, head_dim=8,
                      max_position_embeddings=4096)
    config = EngineConfig(device="cpu", max_num_seqs=C, max_num_batched_tokens=8192, max_model_len=4096,
                          num_kv_blocks=num_blocks, async_scheduling=overlap,
                          admission_delay_steps=admission_delay_steps)
    parts = EngineParts(executor=lambda model, conf, max_len: StubExecutor(conf, max_len, num_blocks))
    return LLM(LlamaForCausalLM(cfg), engine_config=config, parts=parts)


def job(llm: LLM, seed: int) -> float:
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(2, VOCAB, (PROMPT_LEN,), generator=g).tolist() for _ in range(C)]
    params = SamplingParams(temperature=0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    assert all(len(o.outputs[0].token_ids) == OUTPUT_LEN for o in outs)
    return dt


def steady(delay: int, steps: int, output_len: int = 128) -> dict:
    """A server's load: ``C`` requests always in flight (each finished one replaced at once, as
    ``bench/serve_bench.py --request-rate inf`` does; output lengths uniform in [L/2, 3L/2]), the overlapped
    loop; counts the steps that stay
    decode-only (a CUDA graph replay on the GPU) and those that mix in a prefill (eager on the GPU)."""
    llm = build(True, 183_000, delay)
    eng, g, n = llm.engine, torch.Generator().manual_seed(7), 0

    def add() -> None:  # output lengths spread around output_len, so finishes (and arrivals) spread over steps
        nonlocal n
        length = output_len // 2 + int(torch.randint(0, output_len + 1, (1,), generator=g))
        eng.add_request(f"r{n}", torch.randint(2, VOCAB, (PROMPT_LEN,), generator=g).tolist(),
                        SamplingParams(temperature=0, max_tokens=length, ignore_eos=True))
        n += 1

    runner = eng.executor.runner
    counts = {"graph": 0, "mixed": 0}
    graph_for = runner._graph_for

    def spy(scheduled):
        key = graph_for(scheduled)
        counts["graph" if key is not None else "mixed"] += 1
        return key

    runner._graph_for = spy
    for _ in range(C):
        add()
    warm = 3 * output_len  # past the first wave, arrivals are spread over the steps
    t0, tokens = 0.0, 0
    for i in range(warm + steps):
        if i == warm:
            counts, t0, tokens = {"graph": 0, "mixed": 0}, time.perf_counter(), 0
        for out in eng.step():
            tokens += len(out.outputs[0].token_ids) if out.finished else 0
            if out.finished:
                add()
    wall = time.perf_counter() - t0
    return {"admission_delay_steps": delay, "steps": steps, **counts,
            "mixed_share": counts["mixed"] / steps, "deferrals": eng.scheduler.num_deferrals,
            "host_us_per_step": 1e6 * wall / steps, "tokens_finished": tokens}


def main() -> None:
    global C
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--loops", default="sync,overlap")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--blocks", type=int, default=183_000, help="KV pool blocks (Qwen2.5-0.5B's on an H100)")
    ap.add_argument("--requests", type=int, default=256, help="requests of a job, all at once (1: a batch-1 job)")
    ap.add_argument("--profile", action="store_true", help="one more job per loop under cProfile (top 30)")
    ap.add_argument("--steady", metavar="DELAYS", help="instead: the steady-arrival load at these admission "
                    "delays (e.g. 0,8), 600 steps each; how many steps mix in a prefill")
    args = ap.parse_args()
    C = args.requests
    if args.steady:
        for delay in args.steady.split(","):
            print(json.dumps(steady(int(delay), 600)))
        return
    res = {}
    llms = {lp: build(lp == "overlap", args.blocks) for lp in args.loops.split(",")}
    for llm in llms.values():
        job(llm, 0)
    for i in range(args.repeats):
        for lp, llm in llms.items():
            res.setdefault(lp, []).append(job(llm, 1 + i))
    for lp, walls in res.items():
        med = statistics.median(walls)
        print(json.dumps({"loop": lp, "job_s": walls, "us_per_row_step": 1e6 * med / (C * OUTPUT_LEN)}))
    if args.profile:
        import cProfile
        import pstats

        for lp, llm in llms.items():
            gc.collect()
            prof = cProfile.Profile()
            prof.enable()
            job(llm, 99)
            prof.disable()
            print(f"---- {lp}")
            pstats.Stats(prof).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
