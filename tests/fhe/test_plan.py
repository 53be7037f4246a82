"""Plan artifact: save/load round trips, content hash, tamper detection, model check, default plan."""

from __future__ import annotations

import json

import pytest
import torch

from fhe.approx import ScoreApprox
from fhe.errors import FHEError
from fhe.plan import LayerPlan, Plan, PlanError, default_plan_path, load_default_plan, model_fingerprint
from tests.fhe.test_simulator import tiny_model


def _plan(weights: bool = False) -> Plan:
    a = ScoreApprox("sqexp", (1.0, 1.5, 0.75, 1.0), (-2.0, -1.0, -3.0, -4.0), 6, 30.0)
    w = {"o_proj.weight": torch.randn(32, 32), "q_proj.bias": torch.randn(32)} if weights else {}
    layers = (LayerPlan(2, a, (-20.0, -0.5), w, (2.5, 7.0)), LayerPlan(0, a, (-10.0, 0.0)))
    return Plan("tiny", "ab" * 32, layers, {"poly_modulus_degree": 16384}, "test", {"seed": 0})


def test_json_round_trip(tmp_path):
    plan = _plan()
    path = plan.save(tmp_path / "p.json")
    back = Plan.load(path)
    assert back.content_hash == plan.content_hash and back.layer_indices == (0, 2)
    assert back.layer(2).approx == plan.layer(2).approx and back.layer(2).observed_range == (-20.0, -0.5)
    assert back.layer(2).observed_output == (2.5, 7.0) and back.layer(0).observed_output is None
    assert json.loads(path.read_text())["content_hash"] == plan.content_hash


def test_folder_round_trip_with_weights(tmp_path):
    plan = _plan(weights=True)
    with pytest.raises(PlanError):
        plan.save(tmp_path / "p.json")                   # tensors need a folder
    back = Plan.load(plan.save(tmp_path / "plan"))
    assert back.content_hash == plan.content_hash
    assert torch.equal(back.layer(2).weights["o_proj.weight"], plan.layer(2).weights["o_proj.weight"])


def test_hash_covers_parameters_and_tensors():
    a, b = _plan(True), _plan(True)
    assert a.content_hash != b.content_hash              # different random weights
    p = _plan()
    a2 = p.layer(2).approx.with_params((1.0, 1.5, 0.75, 1.0000001), p.layer(2).approx.shift)
    q = Plan(p.model_id, p.weights_sha256, (LayerPlan(2, a2, (-20.0, -0.5)), p.layer(0)), p.ckks,
             p.created_by, p.calibration)
    assert p.content_hash != q.content_hash
    r = Plan(p.model_id, p.weights_sha256, (LayerPlan(2, p.layer(2).approx, (-20.0, -0.5), {}, (2.5, 7.5)),
                                            p.layer(0)), p.ckks, p.created_by, p.calibration)
    assert p.content_hash != r.content_hash             # the output bounds size the encrypted values


@pytest.mark.parametrize("edit", ["scale", "version", "format", "hash", "garbage", "drop_key", "output"])
def test_tampered_json_is_refused(tmp_path, edit):
    path = _plan().save(tmp_path / "p.json")
    doc = json.loads(path.read_text())
    if edit == "scale":
        doc["layers"][0]["approx"]["scale"][0] = 1.01
    elif edit == "version":
        doc["format_version"] = 99
    elif edit == "format":
        doc["format"] = "something-else"
    elif edit == "hash":
        doc["content_hash"] = "0" * 64
    elif edit == "drop_key":
        del doc["layers"][0]["approx"]["kind"]
    elif edit == "output":
        doc["layers"][1]["observed_output"] = [-1.0, 7.0]
    path.write_text("{not json" if edit == "garbage" else json.dumps(doc))
    with pytest.raises(PlanError) as info:
        Plan.load(path)
    assert isinstance(info.value, FHEError)


def test_drop_key_with_rehash_still_refused(tmp_path):
    """A structurally broken plan whose hash was recomputed is refused as malformed, not a crash."""
    from fhe.plan import _hash_metadata

    doc = json.loads(_plan().save(tmp_path / "p.json").read_text())
    doc.pop("content_hash")
    del doc["layers"][0]["approx"]["kind"]
    doc["content_hash"] = _hash_metadata(doc)
    (tmp_path / "p.json").write_text(json.dumps(doc))
    with pytest.raises(PlanError):
        Plan.load(tmp_path / "p.json")


def test_tampered_tensor_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = _plan(weights=True).save(tmp_path / "plan")
    tensors = load_file(str(folder / "weights.safetensors"))
    tensors["layers.2.o_proj.weight"][0, 0] += 1
    save_file(tensors, str(folder / "weights.safetensors"))
    with pytest.raises(PlanError):
        Plan.load(folder)
    (folder / "weights.safetensors").write_bytes(b"garbage")
    with pytest.raises(PlanError):
        Plan.load(folder)


def test_missing_plan_and_bad_layers(tmp_path):
    with pytest.raises(PlanError):
        Plan.load(tmp_path / "nope.json")
    a = ScoreApprox.exact(4)
    with pytest.raises(PlanError):
        Plan("m", "00", (LayerPlan(1, a), LayerPlan(1, a)))
    with pytest.raises(PlanError):
        LayerPlan(0, a, None, {"mlp.up_proj.weight": torch.zeros(1)})
    with pytest.raises(PlanError):
        _plan().layer(7)


def test_check_model():
    model = tiny_model()
    a = ScoreApprox.exact(4)
    plan = Plan("tiny", model_fingerprint(model), (LayerPlan(1, a),))
    plan.check_model(model)
    with pytest.raises(PlanError):
        plan.check_model(tiny_model(seed=9))
    with pytest.raises(PlanError):
        Plan("tiny", model_fingerprint(model), (LayerPlan(5, a),)).check_model(model)


@pytest.mark.parametrize("name,kind,depth,ring", [("default", "sqexp", 11, 32768), ("polyexp", "polyexp", 10, 32768),
                                                  ("n16384", "polyexp", 9, 16384)])
def test_shipped_plans_ship_and_verify(name, kind, depth, ring):
    from fhe.params import CKKSParams, block_depth, min_block_depth
    from fhe.plan import shipped_plan_path

    plan = Plan.load(shipped_plan_path(name))
    assert shipped_plan_path(name).suffix == ".json"
    assert plan.model_id == "SmolLM2-135M-Instruct" and len(plan.layers) >= 4
    for lp in plan.layers:
        assert lp.approx.kind == kind and lp.approx.num_heads == 9 and not lp.weights
        lo, hi = lp.observed_range
        limit = lp.approx.window if kind == "polyexp" else 0.75 * 2 ** lp.approx.squarings
        assert max(abs(lo), abs(hi)) <= lp.approx.bound <= limit
        assert depth in (block_depth(kind, lp.approx.squarings), min_block_depth(kind, lp.approx.squarings))
        z_max, out_max = lp.observed_output                # the encrypted block sizes its values by these
        assert 0.5 < z_max < 20 and 0.5 < out_max < 50
    params = CKKSParams.from_dict(plan.ckks)
    assert params.depth == depth and params.poly_modulus_degree == ring


def test_default_plan_is_the_shipped_default():
    assert load_default_plan().content_hash == Plan.load(default_plan_path()).content_hash
    assert default_plan_path().name == "smollm2-135m-instruct.plan.json"   # server/private/feature.py names it
    with pytest.raises(PlanError):
        from fhe.plan import shipped_plan_path

        shipped_plan_path("n4096")
