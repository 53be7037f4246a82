"""Offload plans: placement rules, the file format, the cost split, and the bundle that holds only the client's part."""

from __future__ import annotations

import json

import pytest
import torch

from engine.config import ModelConfig
from fhe.bundle import BundleError, offload_withheld_names, read_bundle, write_bundle, write_offload_bundle
from fhe.offload import (
    CLIENT,
    SERVER,
    LayerPlacement,
    OffloadPlan,
    OffloadPlanError,
    cost_report,
    offload_plan,
    partial_plan,
    with_poly_silu,
)
from fhe.plan import load_default_plan
from fhe.silu import fit_silu
from tests.engine.hf_tiny import hf_tiny, ours_from_hf

SMOLLM2 = ModelConfig(49152, 576, 1536, 30, 9, 3, 64, tie_word_embeddings=True, rms_norm_eps=1e-5,
                      rope_theta=100000.0)


def test_default_offload_plan_meets_the_issue_goals():
    """Layers 2-29 on the server: >= 70 % of per-token multiply-adds, client <= 30 % of the parameters."""
    plan = offload_plan(SMOLLM2, "SmolLM2-135M-Instruct", attention_plan_hash="ab" * 32)
    assert plan.server_attention == plan.server_mlp == tuple(range(2, 30))
    for context in (1, 64, 1024):
        r = cost_report(plan, context)
        assert r.server_mac_share >= 0.70, (context, r)
        assert r.client_param_share <= 0.30
    r = cost_report(plan, 64)
    per_layer = (2 * 576 * 576 + 2 * 576 * 192 + 576) + (3 * 576 * 1536 + 576)   # attention + MLP, with gains
    assert r.client_params == 49152 * 576 + 576 + 2 * per_layer                  # tied embedding, final norm
    assert plan.round_trips == 28 * 3                 # attention + two client-aided MLP halves per layer


def test_client_aided_attention_moves_scores_to_the_client():
    """softmax = client runs attention as linear steps: the server does the projections, the client q.k
    and p.v over the context (so the server's share falls with the context); >= 70 % up to 192 keys."""
    plan = offload_plan(SMOLLM2, "SmolLM2-135M-Instruct", softmax="client")
    proj = 2 * 576 * 576 + 2 * 576 * 192
    mlp = 3 * 576 * 1536
    for context in (1, 64, 192):
        r = cost_report(plan, context)
        assert r.server_macs == 28 * (proj + mlp)                         # independent of the context
        assert r.client_macs == 2 * (proj + mlp) + 30 * 2 * 9 * 64 * context + 49152 * 576
        assert r.server_mac_share >= 0.70, context
    assert cost_report(plan, 1024).server_mac_share < 0.70                 # long contexts: the client's work
    assert plan.round_trips == 28 * 4                                      # qkv, o, mlp up, mlp down


def test_the_old_partial_plan_is_still_a_choice():
    attn = load_default_plan()
    plan = partial_plan(SMOLLM2, attn)
    assert plan.server_attention == attn.layer_indices and plan.server_mlp == ()
    plan.check_attention_plan(attn)
    assert cost_report(plan, 64).server_mac_share < 0.05       # why the issue exists: ~3 % offloaded


def test_placements_are_validated():
    with pytest.raises(OffloadPlanError):
        LayerPlacement(0, SERVER, CLIENT)                      # server attention needs a softmax choice
    with pytest.raises(OffloadPlanError):
        LayerPlacement(0, CLIENT, SERVER, silu="tanh")
    with pytest.raises(OffloadPlanError):
        LayerPlacement(0, CLIENT, CLIENT, softmax="approx")    # nothing to approximate on the client
    with pytest.raises(OffloadPlanError):
        LayerPlacement(0, "gpu", CLIENT)
    with pytest.raises(OffloadPlanError):
        offload_plan(SMOLLM2, "m", softmax="approx")           # names no attention plan
    with pytest.raises(OffloadPlanError):
        offload_plan(SMOLLM2, "m", softmax="client", silu="poly")   # poly layers without polynomials
    full = offload_plan(SMOLLM2, "m", softmax="client")
    with pytest.raises(OffloadPlanError):
        OffloadPlan("m", SMOLLM2.to_hf_dict(), full.layers[:-1])    # a layer without a placement


def test_attention_plan_must_cover_the_approximated_layers():
    attn = load_default_plan()                                 # layers 2-5 only
    plan = offload_plan(SMOLLM2, "m", attention_plan_hash=attn.content_hash)
    with pytest.raises(OffloadPlanError, match="no score map"):
        plan.check_attention_plan(attn)
    with pytest.raises(OffloadPlanError, match="not the one"):
        offload_plan(SMOLLM2, "m", attention_plan_hash="00" * 32).check_attention_plan(attn)


def test_save_load_round_trip_and_tamper(tmp_path):
    poly = {i: fit_silu(torch.linspace(-6, 6, 200) * (1 + i / 30), degree=7) for i in range(2, 30)}
    plan = offload_plan(SMOLLM2, "m", softmax="client", silu="poly", silu_polys=poly)
    path = plan.save(tmp_path / "p.json")
    back = OffloadPlan.load(path)
    assert back.content_hash == plan.content_hash and back.silu[5].coeffs == poly[5].coeffs
    doc = json.loads(path.read_text())
    doc["layers"][3]["mlp"] = "client"
    doc["layers"][3]["silu"] = None
    path.write_text(json.dumps(doc))
    with pytest.raises(OffloadPlanError):
        OffloadPlan.load(path)
    path.write_text("{not json")
    with pytest.raises(OffloadPlanError):
        OffloadPlan.load(path)


def _tiny_bundle(tmp_path, plan_of):
    model = ours_from_hf(hf_tiny("qwen2-bias-tied"))
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text('{"fake": true}')
    plan = plan_of(model.config)
    info = write_offload_bundle(model, tmp_path / "tok", plan, tmp_path / "b.safetensors")
    return model, plan, info


def test_bundle_holds_no_tensor_of_a_server_side_layer(tmp_path):
    model, plan, info = _tiny_bundle(tmp_path, lambda cfg: offload_plan(cfg, "tiny", 1, softmax="client"))
    assert not any(n.startswith("model.layers.1.") for n in info["tensors"])   # layer 1: both blocks on the server
    assert set(info["withheld"]) == {n for n in model.state_dict() if n.startswith("model.layers.1.")}
    client, meta = read_bundle(tmp_path / "b.safetensors", tmp_path / "files")
    assert meta["plan_hash"] == plan.content_hash and json.loads(meta["encrypted_layers"]) == [1]
    assert all(p.is_meta for p in client.layers[1].parameters())
    ids, pos = torch.tensor([3, 1, 4, 1, 5]), torch.arange(5)
    from engine.model import DenseKVCache

    with torch.inference_mode():               # the client's own part runs and equals the full model's
        got = client.run_layers(client.embed(ids), pos, DenseKVCache(client.config, 5), 0, 1)
        want = model.run_layers(model.embed(ids), pos, DenseKVCache(model.config, 5), 0, 1)
    assert torch.equal(got, want)


def test_client_mlp_keeps_its_weights_when_only_attention_is_offloaded(tmp_path):
    def plan_of(cfg):
        layers = (LayerPlacement(0), LayerPlacement(1, SERVER, CLIENT, "client"))
        return OffloadPlan("tiny", cfg.to_hf_dict(), layers)

    model, _, info = _tiny_bundle(tmp_path, plan_of)
    assert "model.layers.1.mlp.up_proj.weight" in info["tensors"]
    assert "model.layers.1.post_attention_layernorm.weight" in info["tensors"]
    assert "model.layers.1.self_attn.q_proj.weight" not in info["tensors"]
    # the same withholding as the older attention-only bundle
    old = write_bundle(model, tmp_path / "tok", (1,), "ab" * 32, tmp_path / "old.safetensors")
    assert sorted(old["withheld"]) == sorted(offload_withheld_names(model.config, plan_of(model.config)))


def test_bundle_refuses_a_plan_of_another_shape(tmp_path):
    with pytest.raises(BundleError):
        _tiny_bundle(tmp_path, lambda cfg: offload_plan(SMOLLM2, "other", softmax="client"))


def test_poly_silu_is_a_per_layer_choice():
    base = offload_plan(SMOLLM2, "m", softmax="client")
    poly = fit_silu(torch.linspace(-5, 5, 100), degree=7)
    mixed = with_poly_silu(base, {3: poly, 7: poly})
    assert [p.silu for p in mixed.layers if p.mlp == SERVER].count("poly") == 2
    assert mixed.layers[4].silu == "client" and mixed.round_trips == base.round_trips - 2
    with pytest.raises(OffloadPlanError):
        with_poly_silu(base, {0: poly})                         # layer 0's MLP is the client's


def test_cli_plan_info_prints_the_work_split(tmp_path, capsys):
    from server.cli import main

    path = offload_plan(SMOLLM2, "SmolLM2-135M-Instruct", softmax="client").save(tmp_path / "off.json")
    assert main(["fhe", "plan-info", str(path), "--context", "64"]) == 0
    out = capsys.readouterr().out
    assert "layers 0-1: client (clear)" in out
    assert "layers 2-29: attention server linear steps (softmax: client), mlp server (silu: client)" in out
    assert "server runs 72.5 % of" in out and "(112 round trips)" in out     # q.k, p.v on the client
    assert "q.k and p.v of softmax = client layers run on the client" in out
    assert "client 26.3 % of 134.5 M" in out and "141.6 MB of fp32 tensors" in out
    doc = json.loads(path.read_text())
    doc["layers"][5]["attention"] = "client"
    path.write_text(json.dumps(doc))
    assert main(["fhe", "plan-info", str(path)]) == 2
    assert "error" in capsys.readouterr().err
    assert main(["fhe", "plan-info", "offload", "--context", "0"]) == 2
    with pytest.raises(OffloadPlanError):
        cost_report(offload_plan(SMOLLM2, "m", softmax="client"), 0)


@pytest.mark.model
def test_cli_offload_plan_writes_a_plan_for_the_model(tmp_path, capsys, default_model_dir):
    from server.cli import main

    out = tmp_path / "off.json"
    assert main(["fhe", "offload-plan", "--model", str(default_model_dir), "--softmax", "client",
                 "--out", str(out)]) == 0
    plan = OffloadPlan.load(out)
    assert plan.server_mlp == tuple(range(2, 30)) and plan.silu == {}
    assert not plan.fused and plan.round_trips == 112     # fused steps are opt-in (--fused)
    assert main(["fhe", "offload-plan", "--model", str(default_model_dir), "--softmax", "client", "--fused",
                 "--out", str(out)]) == 0
    assert OffloadPlan.load(out).fused and OffloadPlan.load(out).round_trips == 57
    capsys.readouterr()
    # approximated attention needs an attention plan that covers every server layer: the 4-layer one does not
    from fhe.plan import default_plan_path

    assert main(["fhe", "offload-plan", "--model", str(default_model_dir), "--attention-plan",
                 str(default_plan_path()), "--out", str(tmp_path / "x.json")]) == 2
    assert "no score map" in capsys.readouterr().err


def test_the_shipped_offload_plan():
    """The default offload plan: layers 2-29 (attention and MLP) on the server, client-aided MLP; if its
    attention is approximated, the shipped offload attention plan covers every server layer; the goals hold."""
    from fhe.offload import default_offload_path
    from fhe.plan import Plan

    plan = OffloadPlan.load(default_offload_path())
    assert plan.server_attention == plan.server_mlp == tuple(range(2, 30))
    assert not plan.fused and plan.round_trips == 112         # fused steps are opt-in until prefill fits
    assert all(p.silu == "client" for p in plan.layers[2:])
    if plan.approx_layers:
        attn = default_offload_path().with_name("smollm2-135m-instruct.offload-attention.plan.json")
        plan.check_attention_plan(Plan.load(attn))
    cfg = plan.model_config
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size) == (576, 1536, 30, 49152)
    r = cost_report(plan, 64)
    assert r.server_mac_share >= 0.70 and r.client_param_share <= 0.30


@pytest.mark.model
def test_cli_offload_plan_fits_poly_silu_only_where_it_fits(tmp_path, capsys, default_model_dir):
    from server.cli import main

    out = tmp_path / "poly.json"
    assert main(["fhe", "offload-plan", "--model", str(default_model_dir), "--softmax", "client", "--silu", "poly",
                 "--silu-degree", "7", "--silu-max-error", "0.05", "--prompts", "2", "--max-new-tokens", "2",
                 "--out", str(out)]) == 0
    assert "poly SiLU on" in capsys.readouterr().out
    plan = OffloadPlan.load(out)
    poly = {p.index for p in plan.layers if p.silu == "poly"}
    assert poly == set(plan.silu) and poly < set(range(2, 30))      # some layers fit, the outlier ones do not
    assert all(s.degree == 7 for s in plan.silu.values())
