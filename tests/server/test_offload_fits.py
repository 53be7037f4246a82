"""Which offload plans the service runs (``server.private.offload.check_fits``): plain plan files, no CKKS."""

from __future__ import annotations

import pytest

from engine.config import ModelConfig
from fhe.offload import CLIENT, SERVER, LayerPlacement, OffloadPlan, OffloadPlanError, default_offload_path, with_fused
from fhe.plan import Plan
from server.private.feature import default_plan_path
from server.private.offload import OffloadSteps, check_fits


@pytest.fixture(scope="module")
def shipped():
    att = Plan.load(default_plan_path())
    off = OffloadPlan.load(default_offload_path())
    return att, off, off.model_config


def _two_layer(att: Plan, cfg: ModelConfig, server=(2, 3), softmax="approx") -> tuple[Plan, OffloadPlan]:
    sub = Plan(att.model_id, att.weights_sha256, tuple(lp for lp in att.layers if lp.index in server), att.ckks,
               "test", att.calibration)
    layers = tuple(LayerPlacement(i, SERVER, SERVER, softmax, "client") if i in server else LayerPlacement(i, CLIENT)
                   for i in range(cfg.num_hidden_layers))
    return sub, OffloadPlan(att.model_id, cfg.to_hf_dict(), layers, sub.content_hash)


def test_the_calibrated_layers_run(shipped):
    att, _, cfg = shipped
    sub, off = _two_layer(att, cfg)
    check_fits(off, sub, cfg)
    man = OffloadSteps.of(off).manifest(cfg)
    assert man["server_mlp"] == [2, 3] and man["round_trips_per_token"] == 6
    # the MLP's one-position steps (5) and its chunk layout's (m = 8: 8, 64, 128, 512, 1024, 2048)
    assert man["mlp"]["ckks"]["poly_modulus_degree"] == 8192 and len(man["mlp"]["rotation_steps"]) == 11


def test_the_shipped_28_layer_plan_runs_with_attention_as_linear_steps(shipped):
    """softmax = client layers need no score map: the 28-layer plan fits any attention plan of the model;
    its manifest names them and one key set's Galois steps cover both kinds of linear step."""
    from fhe.offload_steps import offload_rotation_steps

    att, off, cfg = shipped
    check_fits(off, att, cfg)
    man = OffloadSteps.of(off).manifest(cfg)
    assert man["server_attention_linear"] == man["server_mlp"] == list(range(2, 30))
    off = with_fused(off)        # the shipped plan is unfused (fused steps are opt-in); its fused twin:
    man = OffloadSteps.of(off).manifest(cfg)
    assert off.fused and man["fused"] is True and man["round_trips_per_token"] == 57    # 1 + 28 + 27 + 1
    # 9 one-position (and pack17) steps, 9 more of the chunk layout, and the fused parts' two more (34 and 46, one
    # position; their chunk layout's are among the others')
    steps = offload_rotation_steps(cfg, fused=True)
    assert man["mlp"]["rotation_steps"] == list(steps) and len(steps) == 20
    assert set(offload_rotation_steps(cfg)) < set(steps)
    assert man["mlp"]["outputs_per_position"]["attn_qkv"] == man["mlp"]["outputs_per_position"]["attn_o"] == 1
    assert man["mlp"]["outputs_per_position"]["o_up"] == 2 and man["mlp"]["outputs_per_position"]["down_qkv"] == 1
    unfused = OffloadSteps.of(with_fused(off, False)).manifest(cfg)    # the four-step protocol, as before
    assert "fused" not in unfused and unfused["round_trips_per_token"] == 112
    assert len(unfused["mlp"]["rotation_steps"]) == 18


def test_a_client_softmax_layer_runs_beside_calibrated_ones(shipped):
    att, _, cfg = shipped
    sub, off = _two_layer(att, cfg, softmax="client")
    check_fits(off, sub, cfg)
    assert OffloadSteps.of(off).attention_layers == (2, 3)


def test_an_approx_layer_needs_its_score_map(shipped):
    att, _, cfg = shipped
    sub, _ = _two_layer(att, cfg, server=(2, 3))
    _, off = _two_layer(att, cfg, server=(2, 3, 7))       # layer 7 has no score map in the sub-plan
    with pytest.raises(OffloadPlanError, match=r"layers \[7\].*no score map"):
        check_fits(off, sub, cfg)
