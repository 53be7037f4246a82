"""The fused batch-1 CPU decode step (engine.cpu_decode, ``EngineConfig.cpu_fused_decode``) against the
unfused path it replaces: step by step on the engine's own paged cache (each one-token step runs unfused,
then fused over the same cache, and the logits are compared), on tiny architectures and on the real default
model in fp32 and Q4_1; which steps may take it (one single-token query only); and the clean fallbacks."""

from __future__ import annotations

import pytest
import torch

import kernels.cpu as native
from engine import cpu_decode
from engine.engine_config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model import greedy_generate
from engine.sampling_params import SamplingParams
from tests.engine.engine_helpers import random_prompts, tiny_model

needs_native = pytest.mark.skipif(not native.available(), reason="native CPU kernels unavailable")


def _engine(model, tok=None, **kw) -> LLMEngine:
    base = dict(device="cpu", block_size=4, kv_cache_bytes=16 << 20, enable_prefix_caching=False,
                max_model_len=256)
    return LLMEngine(model, tok, EngineConfig(**{**base, **kw}))


def _instrument(engine: LLMEngine):
    """Run every one-token step unfused, then fused over the same cache; record both logits.
    Returns the list of (fused, unfused) logits pairs and a counter of fused steps."""
    runner, pairs = engine.runner, []
    fused, orig = runner.fused_decode, runner.execute
    assert fused is not None

    def both(sched, **kw):
        one = len(sched.scheduled) == 1 and sched.scheduled[0].num_query_tokens == 1
        if not one:
            return orig(sched, **kw)
        runner.fused_decode = None
        ref, _ = orig(sched, **kw)        # the unfused forward (stores this token's K/V)
        runner.fused_decode = fused
        got, sampling = orig(sched, **kw)  # the fused step over the same cache (stores them again)
        pairs.append((got.clone(), ref.clone()))
        return got, sampling

    runner.execute = both
    return pairs


def _run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int | list[int]) -> list[list[int]]:
    lens = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    for i, (p, n) in enumerate(zip(prompts, lens, strict=True)):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    out: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = list(o.outputs[0].token_ids)
    return [out[f"r{i}"] for i in range(len(prompts))]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@needs_native
@pytest.mark.parametrize("variant, length", [("llama-mha", 13), ("llama-gqa", 13), ("llama3-rope-scaling", 13),
                                             ("llama-gqa", 150)])
def test_fused_steps_equal_unfused_steps_on_tiny_models(variant, length):
    """Contexts across several blocks (block size 4), GQA and MHA, scaled RoPE, a longer context; greedy = the
    dense reference."""
    model = tiny_model(variant)
    prompt = random_prompts([length])[0]
    ref = greedy_generate(tiny_model(variant), prompt, 20)
    engine = _engine(model)
    pairs = _instrument(engine)
    assert _run(engine, [prompt], 20) == [ref]
    assert len(pairs) == 19  # every decode step after the prefill
    assert max(_rel(g, r) for g, r in pairs) < 1e-5


@needs_native
def test_one_token_prompt_runs_fused_from_its_first_step():
    """A one-token prompt's prefill is a one-token step at position 0: fused too, same tokens."""
    model = tiny_model("llama-gqa")
    ref = greedy_generate(tiny_model("llama-gqa"), [5], 9)
    engine = _engine(model)
    pairs = _instrument(engine)
    assert _run(engine, [[5]], 9) == [ref]
    assert len(pairs) == 9


@needs_native
def test_only_batch_1_single_token_steps_are_fused():
    """Two requests in flight, a prefill, or drafts in the query: the unfused path; the fused step only once a
    single request decodes alone; outputs equal the unfused engine's."""
    prompts = random_prompts([9, 21])
    plain = _run(_engine(tiny_model(), cpu_fused_decode=False), prompts, [3, 9])
    engine = _engine(tiny_model())
    fused, calls = engine.runner.fused_decode, []
    orig = fused.hidden
    fused.hidden = lambda *a: calls.append(a) or orig(*a)
    batched = engine.runner.execute

    def spy(sched, **kw):
        rows = sum(s.num_query_tokens for s in sched.scheduled)
        n = len(calls)
        out = batched(sched, **kw)
        assert (len(calls) > n) == (rows == 1), rows
        return out

    engine.runner.execute = spy
    assert _run(engine, prompts, [3, 9]) == plain
    assert len(calls) == 6  # the second request's last 6 decodes, alone once the first has finished
    # a speculative request: its verify steps carry drafts (several query rows), never the fused step
    spec = _engine(tiny_model(), speculative_method="ngram", num_speculative_tokens=3)
    rep = [1, 2, 3, 4] * 6
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    spec.add_request("s", rep, params)
    verify_rows = []
    inner = spec.runner.execute

    def watch(sched, **kw):
        if any(s.draft_token_ids for s in sched.scheduled):
            verify_rows.append(sched.scheduled[0].num_query_tokens)
        return inner(sched, **kw)

    spec.runner.execute = watch
    while spec.has_unfinished_requests():
        spec.step()
    assert verify_rows and min(verify_rows) > 1


def test_falls_back_cleanly():
    """Off by setting, without the native kernels, with biases, or without fused projections: the unfused path,
    and generation unchanged."""
    prompt = random_prompts([11])[0]
    assert _engine(tiny_model(), cpu_fused_decode=False).runner.fused_decode is None
    assert _engine(tiny_model(), cpu_fused_projections=False).runner.fused_decode is None
    assert cpu_decode.build(tiny_model(), 64) is None  # a bare model: q/k/v and gate/up not fused
    eng = _engine(tiny_model("qwen2-bias-tied"))
    assert eng.runner.fused_decode is None  # q/k/v biases: not taken
    ref = greedy_generate(tiny_model("qwen2-bias-tied"), prompt, 8)
    assert _run(eng, [prompt], 8) == [ref]


def test_no_native_kernels_means_no_fused_step(monkeypatch):
    monkeypatch.setattr(native, "available", lambda: False)
    monkeypatch.setattr(native, "unavailable_reason", lambda: "test")
    prompt = random_prompts([7])[0]
    eng = _engine(tiny_model())
    assert eng.runner.fused_decode is None
    assert _run(eng, [prompt], 6) == [greedy_generate(tiny_model(), prompt, 6)]


@needs_native
def test_decode_step_refuses_bad_inputs():
    model = tiny_model("llama-gqa")
    eng = _engine(model)
    fd = eng.runner.fused_decode
    with pytest.raises(RuntimeError, match="block table shorter"):
        fd.hidden(3, 9, [0, 1])           # position 9 needs a third block of 4
    with pytest.raises(RuntimeError, match="out of range"):
        fd.hidden(3, 1, [10 ** 6])
    h, cache = torch.ones(1, 64), eng.runner.kv.k[0].clone()
    for weights in (fd._weights[:-1], fd._weights + fd._weights[:4]):  # the last layer short, or one too many
        with pytest.raises(RuntimeError, match="ends inside a layer|left over"):
            native.decode_step(h, weights, 2, 4, 2, 0, [0], fd.cos, fd.sin, 1e-6)
    assert torch.equal(h, torch.ones(1, 64)) and torch.equal(eng.runner.kv.k[0], cache)  # nothing written


# ---- the real default model ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2(default_model_dir):
    from engine import Tokenizer, load_model
    from engine.default_model import pull_native

    tok = Tokenizer.from_folder(default_model_dir)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Write a short story about a lighthouse."}])
    return {"fp32": lambda: load_model(default_model_dir),
            "q4_1": lambda: load_model(pull_native(), weight_format="native")}, tok, prompt


@pytest.mark.model
@needs_native
def test_smollm2_fp32_fused_steps_equal_unfused_steps(smollm2):
    """The default model in fp32: 24 decode steps, each fused and unfused over the same paged cache, equal to
    float rounding (the norms' and the attention's sums run in another order)."""
    loaders, tok, prompt = smollm2
    engine = _engine(loaders["fp32"](), tok, block_size=16)
    assert engine.runner.fused_decode is not None
    pairs = _instrument(engine)
    _run(engine, [prompt], 25)
    assert len(pairs) == 24
    errs = [_rel(g, r) for g, r in pairs]
    assert max(errs) < 1e-5, errs
    assert all(int(g.argmax()) == int(r.argmax()) for g, r in pairs)


@pytest.mark.model
@needs_native
def test_smollm2_q4_1_fused_layers_equal_unfused_layers(smollm2):
    """The default model's Q4_1 blocks (head Q8_0), natively: every layer of 24 decode steps run both ways
    on the same input and cache.

    The Q4_1 products quantize their input to int8 per block of 32 (as llama.cpp does), so where a norm's
    output differs by one ulp between the two paths an activation can land one int8 step away: a few of the
    720 layer calls differ by up to ~1e-3 and the rest to float rounding. Over 30 layers those steps compound
    (whole-model logits differ by ~0.03 of the largest logit in most steps, ~1e-6 in steps where none
    happened), so the whole model is checked the way such noise is judged: fused and unfused are equally close
    to the fp32 model (the dequantization of the same blocks)."""
    from engine.kv_cache import PagedAttention
    from engine.model import DenseKVCache

    loaders, tok, prompt = smollm2
    model = loaders["q4_1"]()
    engine = _engine(model, tok, block_size=16)
    runner, fd = engine.runner, engine.runner.fused_decode
    assert fd is not None
    layer_errs, orig = [], runner.execute

    def per_layer(sched, **kw):
        s = sched.scheduled[0]
        # (_instrument below calls this twice per one-token step: unfused first, with fused_decode unset)
        if len(sched.scheduled) == 1 and s.num_query_tokens == 1 and runner.fused_decode is None:
            inp = runner.prepare(sched)
            backend = PagedAttention(runner.kv, inp.meta, model.config.head_dim, cpu_decode=True)
            with torch.inference_mode(), model.rotary.shared_tables(inp.positions):
                h = model.embed(inp.input_ids)
                for i, layer in enumerate(model.layers):
                    ref = layer(h, inp.positions, model.rotary, backend)
                    got, w = h.clone(), fd.layer_weights[i]
                    native.decode_step(got, [w[0], w[1], runner.kv.k[i], runner.kv.v[i], *w[2:]], 1,
                                       fd.num_heads, fd.num_kv_heads, s.start, s.seq.block_table, fd.cos, fd.sin,
                                       fd.eps)
                    layer_errs.append(_rel(got, ref))
                    h = ref
        return orig(sched, **kw)

    runner.execute = per_layer
    pairs = _instrument(engine)
    out = _run(engine, [prompt], 25)[0]
    assert len(pairs) == 24 and len(layer_errs) == 24 * model.config.num_hidden_layers
    layer_errs.sort()
    assert layer_errs[len(layer_errs) // 2] < 1e-6 and layer_errs[int(0.9 * len(layer_errs))] < 1e-5
    assert layer_errs[-1] < 1e-2, layer_errs[-10:]
    # whole model: as close to the fp32 model as the unfused path is
    fp32 = loaders["fp32"]()
    full = prompt + out[:len(pairs)]  # what the decode steps fed
    with torch.inference_mode():
        ref32 = fp32.logits(fp32(torch.tensor(full), torch.arange(len(full)), DenseKVCache(fp32.config, len(full))))
    rows = ref32[len(prompt):len(prompt) + len(pairs)]

    def kl(lg):
        lp, lq = rows.log_softmax(-1), lg.log_softmax(-1)
        return float((lp.exp() * (lp - lq)).sum(-1).mean())

    fused, unfused = torch.cat([g for g, _ in pairs]), torch.cat([r for _, r in pairs])
    assert kl(fused) < 1.5 * kl(unfused) + 1e-3 and kl(fused) < 1e-2, (kl(fused), kl(unfused))
    agree = [int((x.argmax(-1) == rows.argmax(-1)).sum()) for x in (fused, unfused)]
    assert agree[0] >= agree[1] - 1, agree

