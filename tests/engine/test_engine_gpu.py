"""The engine on CUDA: Triton kernels, CUDA-graph decode, bf16 (skipped without CUDA)."""

from __future__ import annotations

import gc

import pytest
import torch

from engine.engine_config import EngineConfig
from engine.llm import LLM
from engine.model import greedy_generate
from engine.sampling_params import SamplingParams
from tests.engine.engine_helpers import random_prompts, tiny_model

pytestmark = pytest.mark.gpu


def _free_gpu_memory() -> None:
    """Engines size their KV pool from free memory: release a dropped engine's pool before the next is built."""
    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture(autouse=True)
def _release_gpu_memory():
    """Free the previous test's pool first."""
    _free_gpu_memory()


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("graphs", [True, False])
def test_fp32_gpu_engine_equals_cpu_reference(graphs, overlap):
    prompts = random_prompts([5, 17, 33, 1, 40, 64, 9], seed=1)
    ref_model = tiny_model("qwen2-bias-tied")
    refs = [greedy_generate(ref_model, p, 24) for p in prompts]
    cfg = EngineConfig(device="cuda", dtype="float32", block_size=16, max_num_batched_tokens=48,
                       max_model_len=256,
                       gpu_memory_utilization=0.3, max_num_seqs=16, cuda_graphs=graphs, async_scheduling=overlap)
    llm = LLM(tiny_model("qwen2-bias-tied"), engine_config=cfg)
    assert bool(llm.engine.runner._graphs) == graphs and llm.engine.overlap == overlap
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == refs


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("mixed_tokens", [256, 0])
def test_mixed_steps_replay_decode_graphs_and_keep_the_tokens(mixed_tokens, overlap):
    """fp32, more prompts than running slots: later prompts join running decodes, and with
    cuda_graph_mixed_tokens those mixed steps replay decode graphs (prompt tokens as rows, some in the mixed
    buckets above the batch ones): the greedy tokens stay the CPU reference's."""
    prompts = random_prompts([5, 17, 33, 1, 40, 64, 9, 23, 50, 2] * 2, seed=11)
    ref_model = tiny_model("qwen2-bias-tied")
    refs = [greedy_generate(ref_model, p, 20) for p in prompts]
    cfg = EngineConfig(device="cuda", dtype="float32", block_size=16, max_num_batched_tokens=96, max_model_len=256,
                       gpu_memory_utilization=0.3, max_num_seqs=8, cuda_graph_mixed_tokens=mixed_tokens,
                       async_scheduling=overlap)
    llm = LLM(tiny_model("qwen2-bias-tied"), engine_config=cfg)
    runner = llm.engine.runner
    keys, graph_for = [], runner._graph_for

    def spy(scheduled):
        key = graph_for(scheduled)
        if any(s.num_tokens > 1 for s in scheduled):
            keys.append(key)
        return key

    runner._graph_for = spy
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    finally:  # the spy refers to the runner, which gc_freeze put beyond the collector: break the cycle
        del runner._graph_for
    assert [o.outputs[0].token_ids for o in outs] == refs
    graphed = [k for k in keys if k is not None]
    assert llm.engine.stats().graph_steps_total > len(graphed)  # every decode-only step and the graphed mixed ones
    if mixed_tokens:
        assert graphed and any(b > 8 for b, _ in graphed), keys
    else:
        assert keys and not graphed


@pytest.mark.parametrize("graphs", [True, False])
def test_overlapped_loop_gives_the_sync_tokens_on_cuda(graphs):
    """bf16, more prompts than running slots, stop tokens: the overlapped loop (device gather into the graph's
    ids, pinned read-back one step late) emits the synchronous loop's tokens and finish reasons."""
    prompts = random_prompts([5, 17, 33, 1, 40, 64, 9, 23] * 3, seed=7)

    def run(overlap: bool, params):
        cfg = EngineConfig(device="cuda", block_size=16, max_num_batched_tokens=64, max_model_len=256,
                           gpu_memory_utilization=0.3, max_num_seqs=8, cuda_graphs=graphs, async_scheduling=overlap)
        llm = LLM(tiny_model("llama-gqa"), engine_config=cfg)
        outs = llm.generate(prompts, params)
        assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks
        return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]

    free = run(False, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    params = [SamplingParams(temperature=0, max_tokens=(30, 1, 2, 17)[i % 4], ignore_eos=True,
                             stop_token_ids=[free[i][0][5]] if i % 3 == 0 else []) for i in range(len(prompts))]
    want = run(False, params)
    assert run(True, params) == want
    assert any(r == "stop" for _, r in want) and any(r == "length" for _, r in want)


@torch.inference_mode()
def test_bf16_gpu_logprobs_close_to_fp32_reference():
    model = tiny_model("llama-gqa")
    prompt = random_prompts([50], seed=2)[0]
    ref = greedy_generate(model, prompt, 1)
    from engine.model import DenseKVCache

    cache = DenseKVCache(model.config, len(prompt))
    logits = model.logits(model(torch.tensor(prompt), torch.arange(len(prompt)), cache))[-1].log_softmax(-1)
    llm = LLM(tiny_model("llama-gqa"), engine_config=EngineConfig(device="cuda", gpu_memory_utilization=0.3,
                                                                  max_model_len=256, max_num_seqs=8))
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, logprobs=5))[0].outputs[0]
    assert out.token_ids == ref
    for tok, lp in out.logprobs[0].items():
        assert abs(lp - float(logits[tok])) < 1e-2 * float(logits.abs().max())


@pytest.mark.parametrize("variant", ["llama-gqa", "qwen2-bias-tied", "llama3-rope-scaling"])
@torch.inference_mode()
def test_fused_cuda_forward_close_to_fp32_reference(variant):
    """The fused bf16 forward (Triton norm/RoPE/SwiGLU, fused QKV and gate/up GEMMs) vs fp32 on CPU."""
    from engine.fused import FusedLlama
    from engine.model import DenseKVCache, rope_inv_freq

    prompt = random_prompts([41], seed=5)[0]
    ids, pos = torch.tensor(prompt), torch.arange(len(prompt))
    ref_model = tiny_model(variant, seed=7)
    ref = ref_model.logits(ref_model(ids, pos, DenseKVCache(ref_model.config, len(prompt))))
    model = tiny_model(variant, seed=7).to("cuda", torch.bfloat16)
    model.rotary.inv_freq = rope_inv_freq(model.config).cuda()  # fp32 angles, as the runner keeps them
    fused = FusedLlama(model)
    cache = DenseKVCache(ref_model.config, len(prompt), torch.bfloat16, "cuda")
    got = [fused.logits(fused(ids[:40].cuda(), pos[:40].cuda(), cache))]  # prefill: cuBLAS GEMMs
    cache.advance()
    got.append(fused.logits(fused(ids[40:].cuda(), pos[40:].cuda(), cache)))  # one row: kernels.gemv
    got = torch.cat(got).cpu()
    assert not torch.isnan(got).any()
    assert float((got - ref).norm() / ref.norm()) < 1e-2
    assert float((got[40] - ref[40]).norm() / ref[40].norm()) < 1e-2


def test_engine_runs_the_fused_forward_on_cuda():
    from engine.fused import FusedLlama

    llm = LLM(tiny_model("llama-gqa"), engine_config=EngineConfig(device="cuda", gpu_memory_utilization=0.3,
                                                                  max_model_len=256, max_num_seqs=8))
    assert isinstance(llm.engine.runner.model, FusedLlama)


ALL_FUSIONS = dict(cuda_fused_rope_store=True, cuda_gemv_prologues=True, cuda_one_pass_decode_tokens=32)
NO_FUSIONS = dict(cuda_fused_rope_store=False, cuda_gemv_prologues=False, cuda_one_pass_decode_tokens=0)


def _engine(switches: dict, **kw) -> LLM:
    cfg = EngineConfig(device="cuda", gpu_memory_utilization=0.3, max_model_len=256, max_num_seqs=8, **switches,
                       **kw)
    return LLM(tiny_model("llama-gqa"), engine_config=cfg)


def _alone_and_together(llm: LLM, prompts, params) -> tuple[list, list]:
    """The greedy token ids of each prompt alone (batch-1 steps), then of all at once (a batch of several)."""
    alone = [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    return alone, [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("fmt", ["bf16", "int4"])
def test_decode_fusions_keep_the_greedy_tokens(fmt):
    """Issue 19.2: the engine with every decode fusion (norm / SiLU·mul in GEMV prologues, RoPE + K/V store
    in one kernel, one-pass attention graphs) generates the tokens of the engine without them, in fp32
    (bf16 rounds the normed row differently, and a random tiny model has near-ties: see the bf16 test
    below): batch-1 steps (one prompt at a time, the fused GEMV rows) and a batch of several (cuBLAS rows,
    RoPE + store fused); contexts cross the one-pass limit (32 tokens here), so both graphs of a bucket run."""
    prompts = random_prompts([5, 17, 33, 40], seed=3)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    tokens = []
    for switches in (NO_FUSIONS, ALL_FUSIONS):
        llm = _engine(switches, dtype="float32", cuda_weight_format=fmt)
        assert llm.engine.runner.model.gemv_prologues == switches["cuda_gemv_prologues"]
        assert bool(llm.engine.runner._one_pass) == bool(switches["cuda_one_pass_decode_tokens"])
        tokens.append(_alone_and_together(llm, prompts, params))
        del llm
        _free_gpu_memory()
    assert tokens[0] == tokens[1]


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="programmatic dependent launch needs compute capability 9.0")
@pytest.mark.parametrize("fmt", ["bf16", "int4"])
def test_pdl_keeps_the_greedy_tokens_and_the_graphs(fmt):
    """EngineConfig.cuda_pdl: the decode kernels launched with programmatic dependent launch, captured in the
    CUDA graphs (a failed capture would fall back to eager steps: asserted not to), give the tokens of plain
    launches, fp32, batch-1 graphs and a batch of several."""
    import kernels

    prompts = random_prompts([5, 17, 33, 40], seed=5)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    tokens = []
    try:
        for pdl in (False, True):
            llm = _engine({}, dtype="float32", cuda_weight_format=fmt, cuda_pdl=pdl)
            assert kernels.pdl_enabled() == pdl and llm.engine.runner._graphs
            tokens.append(_alone_and_together(llm, prompts, params))
            del llm
            _free_gpu_memory()
    finally:
        kernels.set_pdl(False)   # process-wide: a failure here must not leave it on for the next tests
    assert tokens[0] == tokens[1]


def _assert_first_decode_logprobs_close(off_switches: dict, on_switches: dict) -> None:
    """bf16: the first decode step's top-5 log-probs of an engine with ``on_switches`` are those of one with
    ``off_switches``, to bf16 precision, after the same prefill token (the prefill runs the unfused path on both)."""
    prompt = random_prompts([40], seed=4)[0]
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, logprobs=5)
    got = []
    for switches in (off_switches, on_switches):
        llm = _engine(switches)
        got.append(llm.generate([prompt], params)[0].outputs[0])
        del llm
        _free_gpu_memory()
    assert got[0].token_ids[0] == got[1].token_ids[0]
    off, on = got[0].logprobs[1], got[1].logprobs[1]  # the first decode step (batch-1 graph)
    scale = max(abs(v) for v in off.values())
    for tok in set(off) & set(on):
        assert abs(on[tok] - off[tok]) < 2e-2 * scale
    assert len(set(off) & set(on)) >= 4


def test_decode_fusions_bf16_logprobs_close():
    """bf16: the first decode step's top-5 log-probs with every fusion on are those without, to bf16 precision."""
    _assert_first_decode_logprobs_close(NO_FUSIONS, ALL_FUSIONS)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fp8_kv_engine_stays_close_to_model_dtype_pools(dtype):
    """Issue 19.5: fp8 pools on CUDA (Triton store / rope+store, prefill and split-K decode kernels, decode
    steps replayed from CUDA graphs) against pools of the model dtype, same weights: the check of
    tests/engine/test_kv_fp8.py (close logprobs until tokens part, parting only at near ties); half the pool
    bytes per token of bf16."""
    from tests.engine.test_kv_fp8 import _agreement, _generate, _good

    prompts = random_prompts([5, 17, 33, 40, 64, 3], seed=3)
    runs, per_token = [], []
    for kv in ("auto", "fp8_e4m3"):
        llm = _engine({}, dtype=dtype, kv_cache_dtype=kv, max_num_batched_tokens=32)
        runner = llm.engine.runner
        assert runner.kv.quantized == (kv != "auto") and bool(runner._graphs)
        per_token.append(runner.kv.nbytes / (runner.kv.num_blocks * runner.kv.block_size))
        runs.append(_generate(llm, prompts))
        del llm, runner
        _free_gpu_memory()
    a = _agreement(*runs)
    assert _good(a), a
    assert per_token[0] == per_token[1] * (4 if dtype == "float32" else 2)


@pytest.mark.parametrize("variant", ["llama-gqa", "qwen2-bias-tied"])
@torch.inference_mode()
def test_fp8_fused_cuda_forward_matches_the_cpu_reference(variant):
    """cuda_weight_format "fp8" (engine.fp8): the fused forward with e4m3 weights on CUDA (Triton GEMV for
    the decode row, the Triton row quantizer + torch._scaled_mm for the 40-row prefill; the head of 97 rows
    dequantizes) = the same forward on CPU, where the kernels run their torch references."""
    import copy

    from engine.fused import FusedLlama
    from engine.model import DenseKVCache, rope_inv_freq

    prompt = random_prompts([41], seed=5)[0]
    ids, pos = torch.tensor(prompt), torch.arange(len(prompt))
    model = tiny_model(variant, seed=7)
    ref = model.logits(model(ids, pos, DenseKVCache(model.config, len(prompt))))
    cpu = FusedLlama(copy.deepcopy(model), fp8=True)
    gpu_model = copy.deepcopy(model).to("cuda")
    gpu_model.rotary.inv_freq = rope_inv_freq(gpu_model.config).cuda()
    gpu = FusedLlama(gpu_model, fp8=True)
    assert torch.equal(gpu.fused[0].qkv.weight.cpu().view(torch.uint8), cpu.fused[0].qkv.weight.view(torch.uint8))
    got, want = [], []
    for fused, dev, out in ((gpu, "cuda", got), (cpu, "cpu", want)):
        cache = DenseKVCache(model.config, len(prompt), torch.float32, dev)
        out.append(fused.logits(fused(ids[:40].to(dev), pos[:40].to(dev), cache)).cpu())
        cache.advance()
        out.append(fused.logits(fused(ids[40:].to(dev), pos[40:].to(dev), cache)).cpu())
    got, want = torch.cat(got), torch.cat(want)
    assert torch.isfinite(got).all()
    assert float((got - want).norm() / want.norm()) < 2e-2       # bf16 GEMM output, other summation order
    assert float((got[40] - want[40]).norm() / want[40].norm()) < 2e-2
    assert float((got - ref).norm() / ref.norm()) < 0.1          # and near the unquantized model


@pytest.mark.parametrize("batch", [1, 8])
def test_fp8_engine_graphs_equal_eager(batch):
    """The fp8 engine (bf16, every decode fusion switched on: fp8 has no prologue GEMVs and must fall back)
    replays its decode graphs — GEMV rows at batch 1, the row quantizer + _scaled_mm at batch 8 — to the
    eager steps' log-probs."""
    prompts = random_prompts([5, 17, 33, 40, 9, 23, 12, 30][:batch], seed=6)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=5)
    outs = []
    for graphs in (True, False):
        llm = _engine(ALL_FUSIONS, cuda_weight_format="fp8", cuda_graphs=graphs)
        assert bool(llm.engine.runner._graphs) == graphs
        outs.append([o.outputs[0] for o in llm.generate(prompts, params)])
        del llm
        _free_gpu_memory()
    for on, off in zip(*outs, strict=True):
        assert on.token_ids[0] == off.token_ids[0]               # the prefill: eager in both
        a, b = on.logprobs[1], off.logprobs[1]                   # the first decode step: graph vs eager
        scale = max(abs(v) for v in b.values())
        common = set(a) & set(b)
        assert len(common) >= 4
        assert all(abs(a[t] - b[t]) < 2e-2 * scale for t in common)


@pytest.mark.parametrize("fmt", ["bf16", "int4"])
def test_fused_decode_layers_keep_the_greedy_tokens(fmt):
    """EngineConfig.cuda_fused_decode_layers (kernels.decode_layer, four launches + attention a layer on the
    GEMV rows: batch-1 steps, and int4 batches of up to 4), captured in the CUDA graphs, with the default PDL:
    fp32 greedy tokens equal the unfused engine's, prompts alone and together."""
    import kernels

    prompts = random_prompts([5, 17, 33, 40], seed=5)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    tokens = []
    try:
        for fused in (False, True):
            llm = _engine({}, dtype="float32", cuda_weight_format=fmt, cuda_fused_decode_layers=fused)
            assert llm.engine.runner.model.fused_layers == fused and llm.engine.runner._graphs
            tokens.append(_alone_and_together(llm, prompts, params))
            del llm
            _free_gpu_memory()
    finally:
        kernels.set_pdl(False)
    assert tokens[0] == tokens[1]


def test_fused_decode_layers_bf16_logprobs_close():
    """bf16: the first decode steps' top-5 log-probs with the fused decode layers are those without, to bf16
    precision (the normed row is not rounded to bf16 before the product: near-ties may part later)."""
    _assert_first_decode_logprobs_close({"cuda_fused_decode_layers": False}, {"cuda_fused_decode_layers": True})
