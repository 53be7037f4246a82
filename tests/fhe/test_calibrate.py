"""Calibration: fitting lowers the block error, range enforcement, determinism, 2quad distillation, CLI."""

from __future__ import annotations

import json

import pytest
import torch

from fhe.calibrate import CalibrationConfig, CalibrationError, calibrate, collect, fit_layer, load_prompts
from fhe.plan import Plan, load_default_plan
from fhe.simulator import sequence_logits, simulate_block, simulated_model
from tests.fhe.test_simulator import tiny_model


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny tensors: one intra-op thread avoids spin-wait stalls on a loaded 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _corpus(n: int = 6, t: int = 12, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 61, (t - i % 3,), generator=g).tolist() for i in range(n)]


def _sharp_model(seed: int = 0):
    """Tiny model with larger q/k so softmax is peaked (scores of a few units, like a real model)."""
    model = tiny_model(seed)
    with torch.no_grad():
        for layer in model.layers:
            layer.self_attn.q_proj.weight.mul_(6.0)
    return model


def test_prompt_lists_are_disjoint_and_large():
    cal, ev = load_prompts("calibration"), load_prompts("evaluation")
    assert len(cal) >= 40 and len(ev) >= 40
    assert not set(cal) & set(ev) and len(set(cal)) == len(cal) and len(set(ev)) == len(ev)


def test_sqexp_fit_lowers_block_error_and_range_fits():
    model = _sharp_model()
    data = collect(model, _corpus(), (1,))
    cfg = CalibrationConfig((1,), "sqexp", steps=30, lr=0.05)
    _, info0 = fit_layer(model, 1, data[1], CalibrationConfig((1,), "sqexp", fit=False))
    lp, info = fit_layer(model, 1, data[1], cfg)
    assert info["rel_mse"] < 0.5 * info0["rel_mse"]
    assert info0["observed_range"][1] == pytest.approx(0.0, abs=1e-5)       # uncalibrated: x <= 0
    lo, hi = lp.observed_range
    assert max(-lo, hi) * cfg.margin == pytest.approx(lp.approx.bound) and lp.approx.bound <= 48.0
    # output extent, recomputed by hand from the simulator: max z and max |y_h / z_h| over the positions
    z_max, out_max = lp.observed_output
    zs, outs, gain = [], [], model.layers[1].input_layernorm.weight.double()
    for b in range(data[1].x.shape[0]):
        n = int(data[1].valid[b].sum())
        x_hat = data[1].x[b, :n].double() / gain                        # LayerData holds gain * x_hat
        y, z, _ = simulate_block(model.layers[1], model.rotary, x_hat, torch.arange(n), None, lp)
        zs.append(z.max().item())
        outs.append((y / z[..., None]).abs().max().item())
    assert z_max == pytest.approx(max(zs), rel=1e-4) and out_max == pytest.approx(max(outs), rel=1e-4)


def test_range_that_does_not_fit_is_refused():
    """R=1 tolerates |x| <= 1.5: a peaked model's scores do not fit; calibrate names the layers."""
    model = _sharp_model()
    with pytest.raises(CalibrationError, match=r"layers \[0, 1\]"):
        calibrate(model, None, CalibrationConfig((0, 1), "sqexp", squarings=1, fit=False), "tiny",
                  ckks={}, corpus=_corpus(), log=lambda _: None)


def test_calibration_is_deterministic(tmp_path):
    model = _sharp_model()
    cfg = CalibrationConfig((0, 2), "sqexp", steps=15)
    plans = [calibrate(model, None, cfg, "tiny", corpus=_corpus(), log=lambda _: None) for _ in range(2)]
    assert plans[0].content_hash == plans[1].content_hash
    back = Plan.load(plans[0].save(tmp_path / "p.json"))
    assert back.content_hash == plans[0].content_hash and back.ckks["poly_modulus_degree"] >= 16384
    assert back.calibration["layers"][0]["fits"]


def test_2quad_distillation_improves_and_round_trips(tmp_path):
    model = _sharp_model(seed=1)
    corpus = _corpus(seed=1)
    base = calibrate(model, None, CalibrationConfig((1,), "2quad", fit=False), "tiny", corpus=corpus,
                     log=lambda _: None)
    cfg = CalibrationConfig((1,), "2quad", distill_weights=True, steps=40, weight_lr=3e-3)
    dist = calibrate(model, None, cfg, "tiny", corpus=corpus, log=lambda _: None)
    i0, i1 = base.calibration["layers"][0], dist.calibration["layers"][0]
    assert i1["rel_mse"] < 0.5 * i0["rel_mse"]
    assert set(dist.layer(1).weights) >= {"q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"}
    back = Plan.load(dist.save(tmp_path / "plan"))
    ids = corpus[0]
    torch.testing.assert_close(sequence_logits(simulated_model(model, back), ids, back),
                               sequence_logits(simulated_model(model, dist), ids, dist))


def test_config_validation():
    with pytest.raises(ValueError):
        CalibrationConfig((1,), "exact")
    with pytest.raises(ValueError):
        CalibrationConfig((1,), "sqexp", distill_weights=True)
    with pytest.raises(ValueError):
        CalibrationConfig((), "sqexp")
    with pytest.raises(CalibrationError):
        calibrate(tiny_model(), None, CalibrationConfig((5,)), "tiny", corpus=_corpus(), log=lambda _: None)


def test_cli_plan_info(tmp_path, capsys):
    from server.cli import main

    assert main(["fhe", "plan-info", "default"]) == 0
    assert "layer 2: sqexp R=6" in capsys.readouterr().out
    assert main(["fhe", "plan-info", "polyexp"]) == 0                 # the polyexp option
    assert "layer 2: polyexp R=5 window [-40, 0.5]" in capsys.readouterr().out
    bad = tmp_path / "bad.json"
    doc = json.loads(load_default_plan().save(bad).read_text())
    doc["layers"][0]["approx"]["shift"][0] += 1.0
    bad.write_text(json.dumps(doc))
    assert main(["fhe", "plan-info", str(bad)]) == 2
    assert "hash mismatch" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.model
def test_cli_calibrate_smollm2(tmp_path, default_model_dir, capsys):
    """The real command on SmolLM2, scaled down (4 prompts, 8 tokens, 20 steps, 2 layers)."""
    from server.cli import main

    out = tmp_path / "plan.json"
    rc = main(["fhe", "calibrate", "--model", str(default_model_dir), "--layers", "2,3", "--prompts", "4",
               "--max-new-tokens", "8", "--steps", "20", "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    plan = Plan.load(out)
    assert plan.layer_indices == (2, 3) and plan.model_id == default_model_dir.name
    for info in plan.calibration["layers"]:
        assert info["rel_mse"] < info["rel_mse_initial"] and info["fits"]
