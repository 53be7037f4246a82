"""The plaintext simulator: block numerator/denominator vs the model's own attention, backend, greedy."""

from __future__ import annotations

import pytest
import torch

from engine.config import ModelConfig
from engine.model import DenseKVCache, LlamaForCausalLM
from fhe.approx import ScoreApprox
from fhe.plan import LayerPlan, Plan, model_fingerprint
from fhe.simulator import (
    SimulatedBackend,
    approx_attention,
    batched_greedy,
    finish,
    sequence_logits,
    simulate_block,
    simulated_greedy,
    simulated_model,
)


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny tensors: one intra-op thread avoids spin-wait stalls on a loaded 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny_model(seed: int = 0, bias: bool = False, layers: int = 3) -> LlamaForCausalLM:
    """A random tiny GQA Llama (4 query heads on 2 KV heads), non-trivial norm gains."""
    cfg = ModelConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, attention_bias=bias,
                      rope_theta=10000.0)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.2)
    return model


def sqexp_approx(h: int = 4, shift: float = -2.0) -> ScoreApprox:
    return ScoreApprox("sqexp", tuple(1.0 + 0.1 * i for i in range(h)), (shift,) * h, 6, 30.0)


def tiny_plan(model, approx: ScoreApprox, layers=(1,), weights=None) -> Plan:
    lps = tuple(LayerPlan(i, approx, None, weights or {}) for i in layers)
    return Plan("tiny", model_fingerprint(model), lps)


def _layer_input(model, ids):
    """Residual entering layer 1 and its RMS-normalized form (no gain)."""
    cache = DenseKVCache(model.config, len(ids))
    h = model.run_layers(model.embed(ids), torch.arange(len(ids)), cache, 0, 1)
    return h, model.layers[1].input_layernorm.normalize(h)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("kind", ["exact", "sqexp", "2quad"])
def test_block_matches_model_attention(bias, kind):
    """finish(simulate_block) == o_proj(approx_attention(model's q, k, v)) (exact: == the model's layer)."""
    model = tiny_model(bias=bias)
    ids = torch.randint(0, 61, (7,))
    h, xn = _layer_input(model, ids)
    approx = ScoreApprox.exact(4) if kind == "exact" else (
        sqexp_approx() if kind == "sqexp" else ScoreApprox("2quad", (0.5,) * 4, (3.0,) * 4, bound=20.0))
    pos = torch.arange(7)
    y, z, (k, v) = simulate_block(model.layers[1], model.rotary, xn, pos, None, LayerPlan(1, approx))
    assert y.shape == (7, 4, 32) and z.shape == (7, 4) and k.shape == (7, 2, 8) and y.dtype == torch.float64
    attn = model.layers[1].self_attn
    q, kk, vv = attn.qkv(model.layers[1].input_layernorm(h), pos, model.rotary)
    ref = attn.o_proj(approx_attention(q, kk, vv, 0, approx).reshape(7, -1))
    torch.testing.assert_close(finish(y, z).float(), ref, atol=1e-5, rtol=1e-4)
    if kind == "exact":
        torch.testing.assert_close(finish(y, z).float(), attn(model.layers[1].input_layernorm(h), pos,
                                                               model.rotary, DenseKVCache(model.config, 7)),
                                   atol=1e-5, rtol=1e-4)


def test_block_decode_with_past_kv_equals_prefill():
    """Prefill 5 then decode 1 with the returned KV == prefill 6 (last row)."""
    model = tiny_model(seed=1)
    ids = torch.randint(0, 61, (6,))
    _, xn = _layer_input(model, ids)
    lp = LayerPlan(1, sqexp_approx())
    y6, z6, _ = simulate_block(model.layers[1], model.rotary, xn, torch.arange(6), None, lp)
    _, _, kv = simulate_block(model.layers[1], model.rotary, xn[:5], torch.arange(5), None, lp)
    y1, z1, kv2 = simulate_block(model.layers[1], model.rotary, xn[5:], torch.tensor([5]), kv, lp)
    torch.testing.assert_close(y1, y6[5:])
    torch.testing.assert_close(z1, z6[5:])
    assert kv2[0].shape[0] == 6


def test_masked_future_contributes_nothing():
    """Changing a future token's input changes nothing for earlier rows."""
    model = tiny_model(seed=2)
    ids = torch.randint(0, 61, (5,))
    _, xn = _layer_input(model, ids)
    lp = LayerPlan(1, sqexp_approx())
    y, z, _ = simulate_block(model.layers[1], model.rotary, xn, torch.arange(5), None, lp)
    xn2 = xn.clone()
    xn2[4] += 3.0
    y2, z2, _ = simulate_block(model.layers[1], model.rotary, xn2, torch.arange(5), None, lp)
    torch.testing.assert_close(y[:4], y2[:4])
    torch.testing.assert_close(z[:4], z2[:4])
    assert not torch.allclose(y[4], y2[4])


def test_exact_plan_backend_equals_plain_model():
    """An 'exact' plan reproduces the plain model; a sqexp plan differs only from its layer on."""
    model = tiny_model(seed=3)
    ids = torch.randint(0, 61, (9,)).tolist()
    plain = sequence_logits(model, ids, None)
    exact = sequence_logits(model, ids, tiny_plan(model, ScoreApprox.exact(4)))
    torch.testing.assert_close(plain, exact)
    approx = sequence_logits(model, ids, tiny_plan(model, sqexp_approx(shift=-6.0)))
    assert not torch.allclose(plain, approx, atol=1e-4)


def test_backend_decode_matches_prefill_and_greedy_runs():
    """Token-by-token decoding through SimulatedBackend equals one teacher-forced pass."""
    model = tiny_model(seed=4)
    plan = tiny_plan(model, sqexp_approx(), layers=(0, 2))
    ids = [3, 14, 15, 9, 26]
    out = simulated_greedy(model, plan, ids, 4)
    full = sequence_logits(model, ids + out, plan)
    assert full[len(ids) - 1:-1].argmax(-1).tolist() == out


def test_adjusted_weights_are_applied():
    """A plan's adjusted Wo changes the simulated model (on a copy) and the block."""
    model = tiny_model(seed=5)
    wo = model.layers[1].self_attn.o_proj.weight.detach() * 2
    plan = tiny_plan(model, sqexp_approx(), weights={"o_proj.weight": wo})
    sim = simulated_model(model, plan)
    assert sim is not model and torch.equal(sim.layers[1].self_attn.o_proj.weight, wo)
    assert not torch.equal(model.layers[1].self_attn.o_proj.weight, wo)
    ids = torch.randint(0, 61, (4,))
    _, xn = _layer_input(model, ids)
    y, z, _ = simulate_block(model.layers[1], model.rotary, xn, torch.arange(4), None, plan.layer(1))
    y0, z0, _ = simulate_block(model.layers[1], model.rotary, xn, torch.arange(4), None,
                               LayerPlan(1, plan.layer(1).approx))
    torch.testing.assert_close(y, 2 * y0)


def test_backend_rejects_overflow():
    model = tiny_model()
    backend = SimulatedBackend(model, tiny_plan(model, sqexp_approx()), 3)
    with pytest.raises(ValueError):
        model(torch.arange(4), torch.arange(4), backend)


@pytest.mark.slow
@pytest.mark.model
def test_default_plan_fidelity_smollm2(default_model_dir):
    """The shipped plan on SmolLM2, 6 held-out prompts x 12 tokens: >= 95% top-1, mean KL < 0.01."""
    from engine.loader import load_model
    from engine.tokenizer import Tokenizer
    from fhe.calibrate import chat_corpus, load_prompts
    from fhe.plan import load_default_plan

    model, tok = load_model(default_model_dir).eval(), Tokenizer.from_folder(default_model_dir)
    plan = load_default_plan()
    plan.check_model(model)
    prompts = load_prompts("evaluation")[:6]
    agree = total = 0
    kls = []
    for text, ids in zip(prompts, chat_corpus(model, tok, prompts, 12), strict=True):
        rows = slice(len(tok.apply_chat_template([{"role": "user", "content": text}])) - 1, len(ids) - 1)
        ref, got = sequence_logits(model, ids, None)[rows], sequence_logits(model, ids, plan)[rows]
        agree, total = agree + int((ref.argmax(-1) == got.argmax(-1)).sum()), total + ref.shape[0]
        lr, lg = ref.log_softmax(-1), got.log_softmax(-1)
        kls.append((lr.exp() * (lr - lg)).sum(-1))
    assert total >= 60
    assert agree / total >= 0.95 and float(torch.cat(kls).mean()) < 0.01


@pytest.mark.parametrize("with_plan", [False, True])
def test_batched_greedy_matches_single(with_plan):
    """Batched greedy (ragged prompts, an early stop) == one-at-a-time greedy, exact and simulated."""
    from engine.model import greedy_generate

    model = tiny_model(seed=6)
    plan = tiny_plan(model, sqexp_approx(), layers=(1, 2)) if with_plan else None
    prompts = [[1, 2, 3], [7, 8, 9, 10, 11], [4], [20, 21]]

    def single(p, n, stop=None):
        return simulated_greedy(model, plan, p, n, stop) if plan else greedy_generate(model, p, n, stop)

    first = single(prompts[1], 2)[1]                          # make prompt 1 stop after 2 tokens
    outs = batched_greedy(model, prompts, 6, {first}, plan)
    for p, out in zip(prompts, outs, strict=True):
        assert out == single(p, 6, {first})
    assert len(outs[1]) <= 2
