"""Which offload plans the service runs (``server.private.offload.check_fits``): plain plan files, no CKKS."""

from __future__ import annotations

import pytest

from engine.config import ModelConfig
from fhe.offload import CLIENT, SERVER, LayerPlacement, OffloadPlan, OffloadPlanError, default_offload_path
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
    assert man["mlp"]["ckks"]["poly_modulus_degree"] == 8192 and len(man["mlp"]["rotation_steps"]) == 5


def test_the_shipped_28_layer_plan_is_refused_naming_the_missing_softmax(shipped):
    att, off, cfg = shipped
    with pytest.raises(OffloadPlanError, match="attention layers|client-aided softmax"):
        check_fits(off, att, cfg)


def test_a_client_softmax_layer_is_refused(shipped):
    att, _, cfg = shipped
    sub, off = _two_layer(att, cfg, softmax="client")
    with pytest.raises(OffloadPlanError, match="client-aided softmax"):
        check_fits(off, sub, cfg)


def test_server_layers_must_be_the_attention_plans(shipped):
    att, _, cfg = shipped
    sub, _ = _two_layer(att, cfg, server=(2, 3))
    _, off = _two_layer(att, cfg, server=(2, 3, 4))
    with pytest.raises(OffloadPlanError, match="not the attention plan's"):
        check_fits(off, sub, cfg)
