"""The offload-plan simulator: exact where the plan is exact, each approximation where the plan puts it."""

from __future__ import annotations

import pytest
import torch

from fhe.approx import ScoreApprox
from fhe.offload import OffloadPlanError, offload_plan
from fhe.offload_sim import OffloadSimulator, collect_gates, fidelity
from fhe.plan import LayerPlan, Plan, model_fingerprint
from fhe.silu import fit_silu
from fhe.simulator import sequence_logits
from tests.engine.hf_tiny import hf_tiny, ours_from_hf

IDS = [5, 17, 3, 88, 42, 9, 61, 23, 7, 30]


@pytest.fixture(scope="module")
def model():
    return ours_from_hf(hf_tiny("llama-gqa")).eval()


def _sqexp_plan(model, layers=(1,)) -> Plan:
    hq = model.config.num_attention_heads
    lps = tuple(LayerPlan(i, ScoreApprox("sqexp", (0.2,) * hq, (-2.0,) * hq, 6, 20.0)) for i in layers)
    return Plan("tiny", model_fingerprint(model), lps)


def test_client_aided_everywhere_is_the_plaintext_model(model):
    exact = sequence_logits(model, IDS, None)
    for client_layers in (2, 0):                        # nothing offloaded / everything offloaded
        sim = OffloadSimulator(model, offload_plan(model.config, "tiny", client_layers, softmax="client"))
        assert torch.allclose(sim.logits(IDS), exact, atol=1e-5)


def test_approximated_softmax_matches_the_attention_simulator(model):
    attn = _sqexp_plan(model)
    plan = offload_plan(model.config, "tiny", 1, attention_plan_hash=attn.content_hash)
    got = OffloadSimulator(model, plan, attn).logits(IDS)
    assert torch.allclose(got, sequence_logits(model, IDS, attn), atol=1e-5)
    assert not torch.allclose(got, sequence_logits(model, IDS, None), atol=1e-4)
    with pytest.raises(OffloadPlanError):
        OffloadSimulator(model, plan, None)              # the plan names an attention plan


def test_polynomial_silu_and_noise_change_the_output_where_placed(model):
    seqs = [IDS, IDS[::-1]]
    gates = collect_gates(model, seqs, (0, 1))
    assert set(gates) == {0, 1} and gates[1].numel() > 2
    exact = [sequence_logits(model, s, None) for s in seqs]
    polys = {i: fit_silu(gates[i], degree=15) for i in (0, 1)}
    good = offload_plan(model.config, "tiny", 0, softmax="client", silu="poly", silu_polys=polys)
    rough = offload_plan(model.config, "tiny", 0, softmax="client", silu="poly",
                         silu_polys={i: fit_silu(gates[i], degree=1) for i in (0, 1)})
    f_good = fidelity(OffloadSimulator(model, good), seqs, [1, 1], exact)
    f_rough = fidelity(OffloadSimulator(model, rough), seqs, [1, 1], exact)
    assert f_good["positions"] == 2 * (len(IDS) - 1)
    assert 0 < f_good["kl"] < f_rough["kl"]
    noisy = offload_plan(model.config, "tiny", 0, softmax="client")
    f_noise = fidelity(OffloadSimulator(model, noisy, noise=1e-2), seqs, [1, 1], exact)
    assert f_noise["kl"] > 0
    assert fidelity(OffloadSimulator(model, noisy), seqs, [1, 1], exact)["kl"] < 1e-9


def test_linear_attention_noise_reaches_q_k_v_and_leaves_the_model_clean(model):
    """softmax = client: the attn_qkv answer carries the server's noise too (hooks only during a pass)."""
    from fhe.offload import CLIENT, SERVER, LayerPlacement, OffloadPlan

    layers = (LayerPlacement(0, SERVER, CLIENT, "client"), LayerPlacement(1))
    plan = OffloadPlan("tiny", model.config.to_hf_dict(), layers)
    sim = OffloadSimulator(model, plan, noise=1e-2, seed=1)
    noise, shapes = sim.noise, []

    def counting(x):
        shapes.append(tuple(x.shape))
        return noise(x)

    counting.std = noise.std
    sim.noise = counting
    cfg = model.config
    got = sim.logits(IDS)
    t = len(IDS)
    assert shapes == [(t, cfg.num_attention_heads * cfg.head_dim), (t, cfg.num_key_value_heads * cfg.head_dim),
                      (t, cfg.num_key_value_heads * cfg.head_dim), (t, cfg.hidden_size)]   # q, k, v, then Wo u
    assert not model.layers[0].self_attn.q_proj._forward_hooks           # nothing left installed
    exact = sequence_logits(model, IDS, None)
    assert not torch.allclose(got, exact, atol=1e-5)
    assert torch.allclose(OffloadSimulator(model, plan).logits(IDS), exact, atol=1e-5)
