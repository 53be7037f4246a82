"""GPU benchmark of the plaintext engine (random weights in real model shapes: speed does not depend on them).

For each shape (Qwen2.5-0.5B, Llama-3.2-1B), in one run:
1. sanity: top-5 next-token logprobs of our paged bf16 path vs transformers on the same weights;
2. offline throughput at 1, 64 and 256 concurrent requests (128-token prompts, 256 output tokens, greedy,
   EOS ignored) for our engine and for transformers at its best setting per row (plain ``generate()`` at
   1, continuous batching ``generate_batch`` above), both warmed on the shape they will run, same
   weights, same GPU, one after the other; every row also as a share of the whole job's floor;
3. batch-1 decode step time, (t(257 new) - t(1 new)) / 256, against the bandwidth floor
   ``(weight bytes + KV bytes at the mean context) / measured copy bandwidth``.

With ``--kv-cache-dtype auto,fp8_e4m3`` each shape runs once per KV dtype (``EngineConfig.kv_cache_dtype``),
one after the other on the same weights, and each row also records the pools' resident bytes per token, the
resident weight bytes, and (after the first dtype) the quality of the fp8 engine against it: 8 random
128-token prompts, 32 greedy steps with logprobs=5, how many steps agree before the tokens part and how far
the logprobs of the reference's tokens move until then.

With ``--weight-format fp8`` (or int4) our engine runs ``EngineConfig.cuda_weight_format`` of that name; the
floors then count the weight bytes as stored (``step_weight_bytes``) and, for fp8, the GEMM FLOPs at the
fp8 matrix peak measured at the start of the run (``matmul_peaks``).

Usage: python bench/engine_gpu.py [--shapes qwen2.5-0.5b,llama3.2-1b] [--concurrency 1,64,256]
                                   [--hf-concurrency 256] [--kv-cache-dtype auto,fp8_e4m3]
                                   [--weight-format bf16|fp8|int4] [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import torch

from engine.config import ModelConfig
from engine.engine_config import EngineConfig
from engine.llm import LLM
from engine.model import LlamaForCausalLM, RotaryEmbedding
from engine.model_runner import _StaticInputs
from engine.sampling_params import SamplingParams

SHAPES = {
    "smollm2-135m": dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                         rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
                         max_position_embeddings=8192),
    "qwen2.5-0.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, head_dim=64,
                         rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True, attention_bias=True,
                         max_position_embeddings=32768),
    "llama3.2-1b": dict(model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                        rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True,
                        max_position_embeddings=131072,
                        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
}
PROMPT_LEN, OUTPUT_LEN = 128, 256


def random_model(cfg: ModelConfig, seed: int = 0) -> LlamaForCausalLM:
    """Our model with N(0, 0.02) weights, built directly on the GPU in bf16."""
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to_empty(device="cuda")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(0.0, 0.02)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.rotary = RotaryEmbedding(cfg).cuda()
    return model.to(torch.bfloat16).eval()


def hf_twin(model: LlamaForCausalLM):
    """The transformers model of the same config and weights (bf16, GPU)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    d = model.config.to_hf_dict()
    d.pop("architectures")
    cfg = AutoConfig.for_model(d.pop("model_type"), **{k: v for k, v in d.items() if v is not None})
    with torch.device("cuda"):
        hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    missing, unexpected = hf.load_state_dict(model.state_dict(), strict=False)
    ok = not unexpected and all("rotary" in k or k == "lm_head.weight" for k in missing)
    assert ok, (missing, unexpected)
    return hf.eval()


def prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, PROMPT_LEN), generator=g).tolist()


def timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def copy_bandwidth() -> float:
    """Device copy bandwidth in bytes/s, counting bytes read and written (median of 10)."""
    x = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    y.copy_(x)
    ts = sorted(timed(lambda: y.copy_(x)) for _ in range(10))  # noqa: B023
    return 2 * (4 << 30) / ts[len(ts) // 2]


@torch.inference_mode()
def sanity(llm: LLM, hf, vocab: int) -> float:
    """Our top-5 next-token logprobs (paged bf16 path) vs transformers' for the same tokens, rel. error."""
    ids = prompts(1, vocab, 99)[0]
    ref = hf(torch.tensor([ids], device="cuda")).logits[0].float()
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, logprobs=5))[0].outputs[0]
    ref_lp = ref[-1].log_softmax(-1).cpu()
    toks = list(out.logprobs[0])                       # our sampled token + our top-5
    got = torch.tensor([out.logprobs[0][t] for t in toks])
    return float(((got - ref_lp[toks]).abs().max() / ref_lp[toks].abs().max()).item())


def run_ours(llm: LLM, reqs: list[list[int]]) -> tuple[float, int]:
    params = SamplingParams(temperature=0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    outs: list = []
    dt = timed(lambda: outs.extend(llm.generate(reqs, params)))
    return dt, sum(len(o.outputs[0].token_ids) for o in outs)


def run_hf(hf, reqs: list[list[int]]) -> tuple[float, int]:
    from transformers import GenerationConfig

    gen = GenerationConfig(max_new_tokens=OUTPUT_LEN, do_sample=False, eos_token_id=None, pad_token_id=0)
    res: dict = {}
    dt = timed(lambda: res.update(hf.generate_batch(inputs=reqs, generation_config=gen, progress_bar=False)))
    return dt, sum(len(r.generated_tokens) for r in res.values())


@torch.inference_mode()
def run_hf_plain(hf, reqs: list[list[int]]) -> tuple[float, int]:
    """transformers' plain ``generate()`` one request at a time: its best setting at batch 1 (its
    ``generate_batch`` runs the paged|sdpa fallback here, 5-7x slower for one sequence)."""
    total, tokens = 0.0, 0
    for ids in reqs:
        x = torch.tensor([ids], device="cuda")
        out: list = []
        total += timed(lambda x=x, out=out: out.append(hf.generate(
            x, max_new_tokens=OUTPUT_LEN, min_new_tokens=OUTPUT_LEN, do_sample=False, pad_token_id=0)))
        tokens += out[0].shape[1] - len(ids)
    return total, tokens


def run_peer(hf, c: int, vocab: int) -> tuple[str, float, int]:
    """The peer at its best available setting for c requests, warmed on the same shape first."""
    if c == 1:
        run_hf_plain(hf, prompts(1, vocab, 2001))
        return "generate", *run_hf_plain(hf, prompts(1, vocab, c))
    run_hf(hf, prompts(c, vocab, 2000 + c))
    return "generate_batch", *run_hf(hf, prompts(c, vocab, c))


def decode_step_time(llm: LLM, vocab: int) -> float:
    ids = prompts(1, vocab, 7)[0]
    bm = llm.engine.block_manager
    bm.enable_prefix_caching = False
    run = lambda k: llm.generate([ids], SamplingParams(temperature=0, max_tokens=k, ignore_eos=True))  # noqa: E731
    run(8)
    t = (timed(lambda: run(OUTPUT_LEN + 1)) - timed(lambda: run(1))) / OUTPUT_LEN
    bm.enable_prefix_caching = True
    return t


def _median_ms(ts: list[float]) -> float:
    return sorted(ts)[len(ts) // 2]


def graph_replay_ms(llm: LLM, batch: int = 1, iters: int = 200) -> float:
    """GPU time of one replay of the decode graph of `batch` (no host work), median over `iters`."""
    runner = llm.engine.runner
    runner._decode_in.dev64[_StaticInputs.SLOTS].fill_(-1)  # padding slots: the replays write nothing into the pool
    graph, _ = runner.decode_graph(batch, PROMPT_LEN + OUTPUT_LEN)  # the graph the timed decode replays
    for _ in range(10):
        graph.replay()
    return cuda_median_ms(graph.replay, iters)


def cuda_median_ms(fn, iters: int) -> float:
    """Median GPU time of ``fn()`` over ``iters`` calls, each between its own pair of CUDA events."""
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for a, b in ev:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return _median_ms([a.elapsed_time(b) for a, b in ev])


def step_breakdown(llm: LLM, vocab: int, steps: int = 64) -> dict:
    """Host clock per engine step of a batch-1 greedy decode, split into schedule / run (the runner's
    ``launch`` in the overlapped loop, ``execute`` in the synchronous one) / the rest (in the overlapped loop:
    waiting for the step launched before, then its outputs). A rest near zero means the host, not the device,
    sets the pace. Also counts the decode steps that replayed a CUDA graph.
    """
    eng, runner = llm.engine, llm.engine.runner
    ids = prompts(1, vocab, 11)[0]
    eng.add_request("prof", ids, SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True))
    eng.step()  # the prefill
    graph_calls, orig = [0], runner._run_graph

    def counting(*args, **kw):
        graph_calls[0] += 1
        return orig(*args, **kw)

    runner._run_graph = counting
    parts: dict[str, list[float]] = {"schedule": [], "run": [], "rest": [], "step": []}
    name = "launch" if eng.overlap else "execute"
    sched_fn, run_fn = eng.scheduler.schedule, getattr(runner, name)
    clock: dict[str, float] = {}

    def timed_schedule():
        t0 = time.perf_counter()
        out = sched_fn()
        clock["s"] = time.perf_counter() - t0
        return out

    def timed_run(*args, **kw):
        t0 = time.perf_counter()
        out = run_fn(*args, **kw)
        clock["r"] = time.perf_counter() - t0
        return out

    eng.scheduler.schedule = timed_schedule
    setattr(runner, name, timed_run)
    try:
        while eng.has_unfinished_requests():
            clock.clear()
            t0 = time.perf_counter()
            eng.step()
            dt = time.perf_counter() - t0
            s, r = clock.get("s", 0.0), clock.get("r", 0.0)
            parts["step"].append(dt)
            parts["schedule"].append(s)
            parts["run"].append(r)
            parts["rest"].append(dt - s - r)
    finally:
        del eng.scheduler.schedule, runner._run_graph
        delattr(runner, name)
    res = {f"host_{k}_ms": _median_ms(v) * 1e3 for k, v in parts.items()}
    res["graph_steps"], res["decode_steps"], res["loop"] = graph_calls[0], len(parts["step"]), name
    return res


def kernel_profile(llm: LLM, batch: int = 1, replays: int = 20, top: int = 25) -> dict:
    """torch.profiler over `replays` graph replays: kernels per replay and the costliest kernels."""
    from torch.profiler import ProfilerActivity, profile

    runner = llm.engine.runner
    runner._decode_in.dev64[_StaticInputs.SLOTS].fill_(-1)
    graph, _ = runner.decode_graph(batch, PROMPT_LEN + OUTPUT_LEN)  # the graph the timed decode replays
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name, []).append(e.device_time)
    rows = sorted(((sum(v) / replays, len(v) / replays, k) for k, v in by_name.items()), reverse=True)
    first = min(e.time_range.start for e in kernels)
    last = max(e.time_range.end for e in kernels)
    return {"kernels_per_replay": len(kernels) / replays,
            "kernel_us_per_replay": sum(e.device_time for e in kernels) / replays,
            "span_us_per_replay": (last - first) / replays,
            "top": [{"us": round(us, 2), "count": c, "name": n[:90]} for us, c, n in rows[:top]]}


def step_timeline(llm: LLM, vocab: int, steps: int = 48) -> dict:
    """Where a batch-1 greedy decode's wall time goes on the device, in the engine's own loop (torch.profiler
    over ``steps`` decode steps): device busy (the union of kernel and copy intervals) and idle per step, the
    idle gaps' sizes, and the device activities per step outside the decode graph's kernels."""
    from torch.profiler import ProfilerActivity, profile

    ids = prompts(1, vocab, 13)[0]
    run = lambda k: llm.generate([ids], SamplingParams(temperature=0, max_tokens=k, ignore_eos=True))  # noqa: E731
    run(8)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:  # device activity only: the host runs as usual
        run(steps + 1)
        torch.cuda.synchronize()
    dev = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                 key=lambda e: e.time_range.start)
    busy, gaps, end = 0.0, [], None
    for e in dev:  # union of the device intervals, and the gaps between them
        a, b = e.time_range.start, e.time_range.end
        if end is None or a > end:
            if end is not None:
                gaps.append(a - end)
            busy += b - a
            end = b
        elif b > end:
            busy += b - end
            end = b
    span = end - dev[0].time_range.start
    names: dict[str, int] = {}
    for e in dev:
        names[e.name[:60]] = names.get(e.name[:60], 0) + 1
    per_step = steps + 1
    big = sorted(gaps, reverse=True)
    return {"steps": per_step, "span_us_per_step": span / per_step, "busy_us_per_step": busy / per_step,
            "idle_us_per_step": (span - busy) / per_step, "gaps_over_5us_per_step": sum(g > 5 for g in gaps) / per_step,
            "idle_in_gaps_over_5us_per_step": sum(g for g in gaps if g > 5) / per_step,
            "largest_gaps_us": [round(g, 1) for g in big[:8]],
            "rare_device_ops": {k: v / per_step for k, v in sorted(names.items(), key=lambda kv: kv[1])
                                if v < 5 * per_step}}


def eager_forward_ms(llm: LLM, iters: int = 50) -> float:
    """Host+GPU time of one eager batch-1 decode forward (what the graph replaces)."""
    runner = llm.engine.runner
    from engine.kv_cache import AttentionMetadata, PagedAttention

    inp = runner._decode_in
    ids, pos, slots = (inp.dev64[r, :1] for r in (_StaticInputs.IDS, _StaticInputs.POS, _StaticInputs.SLOTS))
    meta = AttentionMetadata(slots, 1, inp.tables[:1], inp.lens[:1])
    backend = PagedAttention(runner.kv, meta, runner.model_config.head_dim)

    def fwd():
        with torch.inference_mode():
            runner.model.logits(runner.model(ids, pos, backend))

    fwd()
    return _median_ms([timed(fwd) for _ in range(iters)]) * 1e3


@torch.inference_mode()
def profile_shape(llm: LLM, vocab: int) -> dict:
    """Where a batch-1 decode step goes: end-to-end step, host parts, graph replay, kernels."""
    res = {"decode_step_ms": decode_step_time(llm, vocab) * 1e3}
    res.update(step_breakdown(llm, vocab))
    res["graph_replay_ms"] = graph_replay_ms(llm)
    res["eager_forward_ms"] = eager_forward_ms(llm)
    res["kernels"] = kernel_profile(llm)
    return res


def step_weight_bytes(llm: LLM) -> tuple[int, int]:
    """(bytes a decode step reads for weights, GEMM parameters): every layer GEMM and the head as stored
    (bf16, int4 or fp8 with their scales), norms and biases; the embedding table is read one row a token
    (for a tied bf16 model the head is that table: the sum is then every parameter once)."""
    from engine.fused import weight_nbytes

    fused = llm.engine.runner.model
    nbytes, params = 0, 0
    for w in fused.fused:
        for t in (w.qkv, w.gate_up, w.o, w.down):
            nbytes += weight_nbytes(t)
    head = fused.quant_head if fused.quant_head is not None else fused.base.lm_head.weight
    nbytes += weight_nbytes(head)
    for name, p in fused.base.named_parameters():
        if "norm" in name or name.endswith("bias"):
            nbytes += p.numel() * p.element_size()
    cfg = fused.config
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    h, i = cfg.hidden_size, cfg.intermediate_size
    params = cfg.num_hidden_layers * h * (q + 2 * kv + 2 * i + q + i) + cfg.vocab_size * h
    return nbytes + cfg.hidden_size * 2, params


def bench_shape(name: str, concurrency: list[int], bw: float, with_hf: bool, hf_conc: list[int],
                kv_cache_dtype: str = "auto", quality_ref: list | None = None,
                peaks: dict[str, float] | None = None) -> dict:
    """One shape with one KV dtype; ``quality_ref``: the greedy runs of the first KV dtype to compare with
    (appended to when empty); ``peaks``: measured matrix rates by weight format (fp8 rows)."""
    cfg = ModelConfig(**SHAPES[name])
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    model = random_model(cfg)
    res: dict = {"shape": name, "params_M": sum(p.numel() for p in model.parameters()) / 1e6,
                 "weight_format": WEIGHT_FORMAT["fmt"], "kv_cache_dtype": kv_cache_dtype,
                 "weights_resident_bytes": torch.cuda.memory_allocated() - before}
    hf = hf_twin(model) if with_hf else None
    t0 = time.perf_counter()
    llm = build_llm(cfg, model, kv_cache_dtype)
    res["engine_init_s"] = time.perf_counter() - t0
    fmt = WEIGHT_FORMAT["fmt"]
    weight_bytes, params = step_weight_bytes(llm)
    peak = (peaks or {}).get(fmt if fmt == "fp8" else "bf16", PEAK_FLOPS)
    res.update(step_weight_bytes=weight_bytes, gemm_params=params, peak_flops=peak,
               resident_weight_bytes=llm.engine.runner.model.resident_weight_bytes())
    res["num_kv_blocks"] = llm.engine.num_blocks
    res.update(kv_memory(llm))
    kv_elem = llm.engine.runner.kv.k[0].element_size()
    if quality_ref is not None:
        runs = greedy_runs(llm, cfg.vocab_size)
        if quality_ref:
            res["quality_vs_first_kv_dtype"] = agreement(quality_ref, runs)
        else:
            quality_ref.extend(runs)
    res["cuda_graphs"] = sorted(b for b, k in llm.engine.runner._graphs if k == 0)[-1:] or None
    if hf is not None:
        res["logprob_rel_err_vs_hf_bf16"] = sanity(llm, hf, cfg.vocab_size)
    for c in concurrency:
        # warm on the job it will run, whole: c prompts x OUTPUT_LEN tokens (the prefill chunks, the mixed
        # steps, the c-row decode step at every context length compile here, not inside the timing; 16-token
        # warm-ups left the 256-request rows moving by ±20 %, docs/benchmarks.md)
        llm.generate(prompts(c, cfg.vocab_size, 1000 + c), SamplingParams(temperature=0, max_tokens=OUTPUT_LEN,
                                                                          ignore_eos=True))
        dt, tok = run_ours(llm, prompts(c, cfg.vocab_size, c))
        res[f"ours_c{c}_tok_s"] = tok / dt
        res[f"ours_c{c}_job_floor_s"] = job_floor_s(cfg, weight_bytes, c, bw, params, peak, kv_elem)
        res[f"ours_c{c}_job_floor_share"] = res[f"ours_c{c}_job_floor_s"] / dt
        print(name, kv_cache_dtype, "ours", c, tok / dt,
              f"{100 * res[f'ours_c{c}_job_floor_share']:.1f} % of the job floor", flush=True)
    step = decode_step_time(llm, cfg.vocab_size)
    floor = (weight_bytes + kv_bytes(cfg, kv_elem)) / bw
    res.update(decode_step_ms=step * 1e3, floor_ms=floor * 1e3, floor_fraction=floor / step)
    print(name, kv_cache_dtype, "decode", res["decode_step_ms"], res["floor_ms"], res["kv_bytes_per_token"],
          res.get("quality_vs_first_kv_dtype"), flush=True)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    if hf is not None:
        if not hasattr(hf, "generate_batch"):
            res["hf"] = "transformers has no generate_batch"
        for c in hf_conc:
            try:
                how, dt, tok = run_peer(hf, c, cfg.vocab_size)
                res[f"hf_c{c}_setting"] = how
                res[f"hf_c{c}_tok_s"] = tok / dt
                res[f"hf_c{c}_job_floor_share"] = job_floor_s(cfg, weight_bytes, c, bw, params, peak) / dt
                res[f"ratio_c{c}"] = res[f"ours_c{c}_tok_s"] / res[f"hf_c{c}_tok_s"]
                print(name, "hf", how, c, tok / dt, flush=True)
            except Exception as exc:  # noqa: BLE001 - record and go on
                res[f"hf_c{c}_error"] = repr(exc)[:300]
        res["hf_attn_implementation"] = getattr(hf.config, "_attn_implementation", None)
        del hf
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return res


# the issue-19.2 switches of the engine under test (--fusions): on = the engine's defaults, off = none of
# them (EngineConfig.cuda_fused_rope_store, cuda_gemv_prologues, cuda_one_pass_decode_tokens)
DECODE_FUSIONS = {"on": True}
WEIGHT_FORMAT = {"fmt": "bf16"}  # EngineConfig.cuda_weight_format of our engine (--weight-format)


def kv_memory(llm: LLM) -> dict:
    """The KV pools as allocated: resident bytes, bytes per token (K and V, all layers), tokens they hold."""
    kv = llm.engine.runner.kv
    tokens = kv.num_blocks * kv.block_size
    return {"kv_pool_bytes": kv.nbytes, "kv_bytes_per_token": kv.nbytes / tokens, "kv_pool_tokens": tokens}


QUALITY_PROMPTS, QUALITY_STEPS = 8, 32


def greedy_runs(llm: LLM, vocab: int) -> list:
    """(tokens, logprobs) of QUALITY_STEPS greedy steps with logprobs=5 on QUALITY_PROMPTS random prompts."""
    params = SamplingParams(temperature=0, max_tokens=QUALITY_STEPS, ignore_eos=True, logprobs=5)
    outs = llm.generate(prompts(QUALITY_PROMPTS, vocab, 4242), params)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def agreement(ref: list, got: list) -> dict:
    """Greedy agreement of two engines on the same prompts: the share of steps before each prompt's tokens
    first part (top-1 agreement at identical contexts), the first token's agreement (prefill), and the
    |logprob| change of the reference's token over those steps (mean, max)."""
    same, first, dlp = 0, 0, []
    for (ta, la), (tb, lb) in zip(ref, got, strict=True):
        n = 0
        while n < len(ta) and ta[n] == tb[n]:
            dlp.append(abs(la[n][ta[n]] - lb[n][ta[n]]))
            n += 1
        same, first = same + n, first + (n > 0)
    steps = sum(len(t) for t, _ in ref)
    return {"steps_before_parting_share": same / steps, "first_token_agreement": first / len(ref),
            "mean_abs_dlogprob": sum(dlp) / max(1, len(dlp)), "max_abs_dlogprob": max(dlp, default=0.0),
            "steps": steps}


def build_llm(cfg: ModelConfig, model: LlamaForCausalLM, kv_cache_dtype: str = "auto") -> LLM:
    return LLM(model, engine_config=EngineConfig(device="cuda", max_num_seqs=256, max_num_batched_tokens=8192,
                                                 gpu_memory_utilization=0.45, max_model_len=4096,
                                                 kv_cache_dtype=kv_cache_dtype,
                                                 cuda_weight_format=WEIGHT_FORMAT["fmt"],
                                                 **({} if DECODE_FUSIONS["on"] else dict(
                                                     cuda_fused_rope_store=False, cuda_gemv_prologues=False,
                                                     cuda_one_pass_decode_tokens=0))))


def switch_forward(llm: LLM, model) -> None:
    """Run the engine on another forward (fused or reference) of the same weights; re-capture bucket 1."""
    runner = llm.engine.runner
    runner.model = model
    runner._graphs.clear()
    runner._one_pass.clear()
    runner._capture_graphs(1)


@torch.inference_mode()
def forward_rel_errs(fused, reference, vocab: int) -> dict:
    """Logit errors ||x - fp32|| / ||fp32|| of the bf16 fused and bf16 reference forwards on a 128-token
    prompt (dense cache), against the reference forward in fp32 on the same weights."""
    import copy

    from engine.model import DenseKVCache

    ids = torch.tensor(prompts(1, vocab, 3)[0], device="cuda")
    pos = torch.arange(len(ids), device="cuda")
    fp32 = copy.deepcopy(reference).float()

    def logits(m, dtype):
        cache = DenseKVCache(reference.config, len(ids), dtype, "cuda")
        return m.logits(m(ids, pos, cache)).double()

    want = logits(fp32, torch.float32)
    del fp32
    err = {name: float((logits(m, torch.bfloat16) - want).norm() / want.norm())
           for name, m in (("fused_bf16_vs_fp32", fused), ("reference_bf16_vs_fp32", reference))}
    gc.collect()
    torch.cuda.empty_cache()
    return err


def profile_main(names: list[str], bw: float) -> list[dict]:
    """--profile: the batch-1 decode step taken apart, per shape, fused forward then reference forward."""
    out = []
    for name in names:
        cfg = ModelConfig(**SHAPES[name])
        model = random_model(cfg)
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        llm = build_llm(cfg, model)
        fused = llm.engine.runner.model
        llm.generate(prompts(2, cfg.vocab_size, 1), SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
        res = {"shape": name, "floor_ms": (weight_bytes + kv_bytes(cfg)) / bw * 1e3,
               "forward": type(fused).__name__, **forward_rel_errs(fused, model, cfg.vocab_size)}
        res.update(profile_shape(llm, cfg.vocab_size))
        if fused is not model:
            fused.use_gemv = False
            switch_forward(llm, fused)
            res["fused_cublas_forward"] = profile_shape(llm, cfg.vocab_size)
            switch_forward(llm, model)
            res["reference_forward"] = profile_shape(llm, cfg.vocab_size)
        print(f"{name}: floor {res['floor_ms']:.3f} ms, logits rel err vs fp32: fused bf16 "
              f"{res['fused_bf16_vs_fp32']:.2e}, reference bf16 {res['reference_bf16_vs_fp32']:.2e}", flush=True)
        print(summary_line(res), flush=True)
        for key in ("fused_cublas_forward", "reference_forward"):
            if key in res:
                print(summary_line({"shape": name, "forward": key.removesuffix("_forward"), **res[key]}), flush=True)
        out.append(res)
        del llm, model
        gc.collect()
        torch.cuda.empty_cache()
    return out


def summary_line(res: dict) -> str:
    """One line of a profile: step, GPU replay, host parts, kernels per step."""
    k = res["kernels"]
    return (f"{res['shape']:>13} {res['forward']:>15}: step {res['decode_step_ms']:.3f} ms, graph replay "
            f"{res['graph_replay_ms']:.3f} ms, host schedule/execute/rest {res['host_schedule_ms']:.3f}/"
            f"{res['host_execute_ms']:.3f}/{res['host_rest_ms']:.3f} ms, graph steps {res['graph_steps']}/"
            f"{res['decode_steps']}, {k['kernels_per_replay']:.0f} kernels ({k['kernel_us_per_replay']:.0f} us "
            f"busy of {k['span_us_per_replay']:.0f}), eager {res['eager_forward_ms']:.2f} ms")


PEAK_FLOPS = 790e12  # bf16 dense, measured on the H200 here (docs/benchmarks.md, KINDS.md)


def job_floor_s(cfg: ModelConfig, weight_bytes: int, c: int, bw: float, params: float | None = None,
                peak: float = PEAK_FLOPS, kv_elem: int = 2) -> float:
    """The whole job's floor for c requests: prefill FLOPs at the matrix peak, then OUTPUT_LEN decode steps
    each at max(weights + the c sequences' K/V at the mean context over bandwidth, 2 x params x c FLOPs).
    ``params``: GEMM parameters (default: bf16 bytes / 2); ``peak``: the matrix rate of the weights' format;
    ``kv_elem``: bytes per cached value (2: bf16, 1: fp8, whose floor is lower)."""
    params = weight_bytes / 2 if params is None else params
    prefill = 2 * params * c * PROMPT_LEN / peak
    step = max((weight_bytes + c * kv_bytes(cfg, kv_elem)) / bw, 2 * params * c / peak)
    return prefill + OUTPUT_LEN * step


def matmul_peaks(n: int = 8192) -> dict[str, float]:
    """Dense matrix rates (FLOP/s) on random data, median of 10: bf16 ``torch.mm`` and fp8 e4m3
    ``torch._scaled_mm`` with row-wise scales (the engine's fp8 GEMM), n x n x n."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    qa, qb = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    sa, sb = torch.ones(n, 1, device="cuda"), torch.ones(1, n, device="cuda")
    runs = {"bf16": lambda: torch.mm(a, b),
            "fp8": lambda: torch._scaled_mm(qa, qb.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)}
    out = {}
    for name, fn in runs.items():
        fn()
        out[name] = 2 * n**3 / _median_ms([timed(fn) for _ in range(10)])
    return out


def kv_bytes(cfg: ModelConfig, kv_elem: int = 2) -> int:
    """K and V bytes (``kv_elem`` per value: bf16 2, fp8 1) at the mean context of the timed decode."""
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * kv_elem
    return per_token * (PROMPT_LEN + OUTPUT_LEN // 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="qwen2.5-0.5b,llama3.2-1b")
    ap.add_argument("--concurrency", default="1,64,256")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--hf-concurrency", help="concurrencies run with transformers (default: --concurrency)")
    ap.add_argument("--json")
    ap.add_argument("--profile", action="store_true", help="only take the batch-1 decode step apart")
    ap.add_argument("--fusions", choices=("on", "off"), default="on",
                    help="our engine with its defaults (on) or without any of issue 19.2's fusions (off)")
    ap.add_argument("--kv-cache-dtype", default="auto",
                    help="comma list of EngineConfig.kv_cache_dtype values, each shape run once per value (e.g. "
                         "auto,fp8_e4m3: the second is compared with the first for quality)")
    ap.add_argument("--weight-format", choices=("bf16", "int4", "fp8"), default="bf16",
                    help="EngineConfig.cuda_weight_format of our engine")
    args = ap.parse_args()
    DECODE_FUSIONS["on"] = args.fusions == "on"
    WEIGHT_FORMAT["fmt"] = args.weight_format
    import transformers

    bw = copy_bandwidth()
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "transformers": transformers.__version__,
           "copy_bandwidth_GBps": bw / 1e9, "decode_fusions": DECODE_FUSIONS["on"], "results": []}
    # fp8 rows: the GEMM FLOPs at the fp8 peak measured here; bf16 rows keep PEAK_FLOPS (as before)
    peaks = {"fp8": matmul_peaks()["fp8"]} if args.weight_format == "fp8" else None
    out["peak_flops"] = peaks
    print(json.dumps(out), flush=True)
    if args.profile:
        out["profile"] = profile_main(args.shapes.split(","), bw)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(out, fh, indent=2)
        return
    kv_dtypes = args.kv_cache_dtype.split(",")
    for name in args.shapes.split(","):
        conc = [int(c) for c in args.concurrency.split(",")]
        hf_conc = [int(c) for c in args.hf_concurrency.split(",")] if args.hf_concurrency else conc
        quality_ref: list | None = [] if len(kv_dtypes) > 1 else None
        for i, kv in enumerate(kv_dtypes):  # the peer runs once per shape, beside the first KV dtype
            out["results"].append(bench_shape(name, conc, bw, not args.no_hf and i == 0, hf_conc, kv, quality_ref,
                                              peaks))
            print(json.dumps(out["results"][-1], indent=1), flush=True)
            if args.json:
                with open(args.json, "w") as fh:
                    json.dump(out, fh, indent=2)


if __name__ == "__main__":
    main()
