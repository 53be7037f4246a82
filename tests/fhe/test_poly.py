"""polyexp: the degree 2^R - 1 exp polynomial, its encrypted evaluation at depth R, its parameters, its fit."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fhe.approx import POLY_HI, ScoreApprox, exp_poly_coefficients, poly_eval, sqexp, unnormalized_weights
from fhe.calibrate import CalibrationConfig, collect, fit_layer
from fhe.errors import LevelError
from fhe.params import HE_STANDARD_128, block_depth, ckks_params_for, min_block_depth
from fhe.poly import PolyEvaluator, poly_depth


def _approx(**kw) -> ScoreApprox:
    args = {"kind": "polyexp", "scale": (1.0, 0.5), "shift": (0.0, -1.0), "squarings": 4, "bound": 30.0,
            "window": 32.0} | kw
    return ScoreApprox(**args)


def test_exp_polynomial_beats_six_squarings_on_the_window():
    x = torch.linspace(-32.0, POLY_HI, 20001, dtype=torch.float64)
    c = exp_poly_coefficients(32.0, 15)
    t = (x - (POLY_HI - 32.0) / 2) / ((POLY_HI + 32.0) / 2)
    err = (poly_eval(t, c) - x.exp()).abs().max().item()
    assert err <= 5e-4, err                                   # measured 4.0e-4
    assert err < 0.2 * (sqexp(x[x <= 0], 6) - x[x <= 0].exp()).abs().max().item()   # sqexp R=6: 4.3e-3


def test_polyexp_weights_follow_exp_and_mask_to_zero():
    a = _approx()
    s = torch.linspace(-20.0, 0.0, 12, dtype=torch.float64).expand(2, 3, 12).clone()
    mask = torch.zeros(3, 12, dtype=torch.bool)
    mask[0, 5:] = True
    p = unnormalized_weights(s, a, mask)
    x = torch.tensor(a.scale).view(2, 1, 1) * s + torch.tensor(a.shift).view(2, 1, 1)
    assert torch.allclose(p[:, 1:], x.exp()[:, 1:], atol=5e-4)
    assert torch.all(p[:, 0, 5:] == 0)


def test_polyexp_round_trip_and_old_kinds_keep_their_dict():
    a = _approx()
    assert ScoreApprox.from_dict(a.to_dict()) == a and a.to_dict()["window"] == 32.0
    old = ScoreApprox("sqexp", (1.0,), (0.0,), 6, 30.0)
    assert "window" not in old.to_dict()                      # shipped sqexp plans keep their content hash
    assert a.score_depth == 4 and old.score_depth == 6 and len(a.poly_coefficients()) == 16
    alpha, beta = a.base_affine()                             # t = alpha s + beta spans [-1, 1] on the window
    assert alpha[0] * 0.0 + beta[0] == pytest.approx((0.0 - (POLY_HI - 32) / 2) / ((POLY_HI + 32) / 2))


@pytest.mark.parametrize("kw", [{"window": 0.0}, {"window": math.inf}, {"bound": 33.0},
                                {"kind": "sqexp", "window": 32.0}])
def test_bad_polyexp_is_refused(kw):
    with pytest.raises(ValueError):
        _approx(**kw)


def test_polyexp_fits_n16384_at_depth_9():
    p = ckks_params_for("polyexp", 4)
    assert block_depth("polyexp", 4) == 9 and p.depth == 9
    assert p.poly_modulus_degree == 16384 and p.total_bits <= HE_STANDARD_128[16384]
    assert 36 <= p.scale_bits <= 40 and all(36 <= b <= 60 for b in p.coeff_mod_bit_sizes)
    assert ckks_params_for("polyexp", 5).poly_modulus_degree == 32768   # depth 10 does not fit 16384
    folded = ckks_params_for("polyexp", 5, fold_v=True)                  # p * V inside P: depth 9
    assert folded.depth == min_block_depth("polyexp", 5) == 9 and folded.poly_modulus_degree == 16384
    assert folded.total_bits <= HE_STANDARD_128[16384]
    assert min_block_depth("sqexp", 6) == block_depth("sqexp", 6)        # only polyexp folds V


def test_poly_depth_needs_a_power_of_two():
    assert poly_depth(16) == 4 and poly_depth(2) == 1
    for n in (1, 3, 12):
        with pytest.raises(ValueError):
            poly_depth(n)


@pytest.fixture(scope="module")
def seal16k():
    from fhe.backends import evaluator_for
    from fhe.backends.seal.keys import CKKSClient

    params = ckks_params_for("polyexp", 4)
    client = CKKSClient(params, [1])
    return client, client.server_keys(), evaluator_for(params)


def test_encrypted_polynomial_matches_reference_at_depth_r(seal16k):
    """Depth 4 exactly (level L -> L - 4), the asked-for scale, masked slots 0: the block's score map."""
    client, keys, ev = seal16k
    rng = np.random.default_rng(0)
    t = rng.uniform(-1, 1, ev.slots)
    mask = np.ones(ev.slots)
    mask[::3] = 0.0
    t[::3] = 0.0                                              # rows past the cache end: t = 0, no constants
    coeffs = exp_poly_coefficients(32.0, 15) * 1000.0         # the block's gain rides on the coefficients
    ct = ev.mod_switch(client.encrypt(t), 7)
    out = PolyEvaluator(ev, coeffs, ev.scale, mask)(ct, keys)
    assert ev.level(out) == 3 and ev.scale_of(out) == ev.scale
    ref = poly_eval(torch.tensor(t), coeffs).numpy() * mask
    got = client.decrypt(out)
    assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max()
    with pytest.raises(LevelError):
        PolyEvaluator(ev, coeffs, ev.scale, mask)(ev.mod_switch(ct, 4), keys)


def test_encrypted_polynomial_times_v_costs_no_level(seal16k):
    """P(t) and P(t) * v both at depth R (v one level above t): the block's p * V folded into P (fold_v)."""
    from fhe.evaluator import relin_rescale

    client, keys, ev = seal16k
    rng = np.random.default_rng(1)
    t, v = rng.uniform(-1, 1, ev.slots), rng.uniform(-2, 2, ev.slots)
    mask = np.ones(ev.slots)
    mask[::3] = 0.0
    t[::3] = 0.0
    coeffs = exp_poly_coefficients(32.0, 15) * 1000.0
    ct_t, ct_v = ev.mod_switch(client.encrypt(t), 7), ev.mod_switch(client.encrypt(v), 8)
    evaluator = PolyEvaluator(ev, coeffs, ev.scale, mask)
    p, pv = evaluator.with_values(ct_t, ct_v, ev.scale, keys)
    assert ev.level(p) == 3 and ev.scale_of(p) == ev.scale
    assert ev.level(pv) == 4 and ev.size(pv) == 3              # summed by the caller before one relin
    pv = relin_rescale(ev, pv, keys)
    assert ev.level(pv) == 3 and ev.scale_of(pv) == pytest.approx(ev.scale, rel=1e-12)
    ref = poly_eval(torch.tensor(t), coeffs).numpy() * mask
    assert np.abs(client.decrypt(p) - ref).max() <= 1e-5 * np.abs(ref).max()
    assert np.abs(client.decrypt(pv) - ref * v).max() <= 1e-5 * np.abs(ref * v).max()
    with pytest.raises(LevelError):
        evaluator.with_values(ct_t, ev.mod_switch(ct_v, 7), ev.scale, keys)    # v must sit above t


def test_calibration_fits_polyexp_inside_its_window():
    from tests.fhe.test_calibrate import _corpus, _sharp_model

    torch.set_num_threads(1)
    model = _sharp_model()
    data = collect(model, _corpus(), (1,))
    cfg = CalibrationConfig((1,), "polyexp", squarings=4, steps=30, lr=0.05, window=16.0)
    _, info0 = fit_layer(model, 1, data[1], CalibrationConfig((1,), "polyexp", squarings=4, fit=False,
                                                               window=16.0))
    lp, info = fit_layer(model, 1, data[1], cfg)
    assert lp is not None and lp.approx.kind == "polyexp" and lp.approx.window == 16.0
    assert lp.approx.bound <= 16.0 and info["rel_mse"] < info0["rel_mse"]


def _shaped_polyexp_plan(model, x: torch.Tensor, squarings: int, window: float = 40.0):
    """A layer-1 polyexp plan with x = s - max score per head (inside the window on these tokens)."""
    from fhe.plan import LayerPlan
    from fhe.simulator import block_weights, causal_mask, gqa_scores, project_qkv

    pos = torch.arange(len(x))
    q, k, _ = project_qkv(block_weights(model.layers[1], None), x.double(), pos, model.rotary)
    s = gqa_scores(q, k).masked_fill(causal_mask(pos, len(pos)), float("-inf"))
    shift = -s.amax(dim=(1, 2))
    xs = s + shift[:, None, None]
    lo = xs[torch.isfinite(xs)].min().item()
    hq = s.shape[0]
    approx = ScoreApprox("polyexp", (1.0,) * hq, tuple(shift.tolist()), squarings, 1.25 * abs(lo), window)
    return LayerPlan(1, approx, (lo, 0.0))


@pytest.mark.parametrize("squarings,ring", [(4, 16384), (5, 32768)])
def test_polyexp_block_runs_on_the_symbolic_evaluator(squarings, ring):
    """The whole block with the polynomial, every level/scale/size checked by the symbolic backend
    (exact values), over several cache blocks: equal to the simulator, results at level 1."""
    from fhe.attention import BlockClient, EncryptedAttentionLayer, required_rotation_steps
    from fhe.backends import evaluator_for
    from fhe.backends.symbolic import SymbolicClient
    from fhe.simulator import finish, simulate_block
    from tests.fhe.test_attention import layer_input
    from tests.fhe.test_symbolic import wide_model

    model = wide_model()
    x = layer_input(model, 1, torch.randint(0, 61, (50,), generator=torch.Generator().manual_seed(1)))
    plan = _shaped_polyexp_plan(model, x, squarings)
    cfg, params = model.config, ckks_params_for("polyexp", squarings)
    assert params.poly_modulus_degree == ring
    ev = evaluator_for(params, "symbolic")
    client = SymbolicClient(params, required_rotation_steps(cfg, params, "polyexp", squarings))
    block = EncryptedAttentionLayer(model.layers[1], model.rotary, plan, cfg, params, max_tokens=64, evaluator=ev)
    bc = BlockClient.for_model(client, cfg, "polyexp", squarings)
    cache = block.new_cache()
    outs = block.prefill(cache, bc.encrypt_input(x), 0, client.server_keys())
    assert len(cache.k_blocks) > 1 and {ev.level(c) for c in outs} == {1}
    ys, zs, _ = simulate_block(model.layers[1], model.rotary, x, torch.arange(len(x)), None, plan)
    err = (finish(*bc.decrypt_output(outs)) - finish(ys, zs)).abs().max().item()
    assert err < 1e-6, err


@pytest.mark.slow
def test_tiny_polyexp_block_matches_simulator():
    """The whole encrypted block with polyexp at N = 16384 (depth 9) vs the simulator (~40 s)."""
    from fhe.plan import LayerPlan
    from fhe.simulator import block_weights, causal_mask, finish, gqa_scores, project_qkv, simulate_block
    from tests.fhe.test_attention import layer_input, run_encrypted, tiny_model

    model = tiny_model(bias=True)
    x = layer_input(model, 1, torch.tensor([3, 14, 15, 9, 26, 5, 35]))
    pos = torch.arange(len(x))
    q, k, _ = project_qkv(block_weights(model.layers[1], None), x.double(), pos, model.rotary)
    s = gqa_scores(q, k).masked_fill(causal_mask(pos, len(pos)), float("-inf"))
    shift = -s.amax(dim=(1, 2))
    xs = s + shift[:, None, None]
    lo = xs[torch.isfinite(xs)].min().item()
    approx = ScoreApprox("polyexp", (1.0,) * 4, tuple(shift.tolist()), 4, 1.25 * abs(lo), 32.0)
    plan = LayerPlan(1, approx, (lo, 0.0))
    (y, z), (_, server, _, _) = run_encrypted(model, 1, x, plan)
    assert server.ev.params.poly_modulus_degree == 16384
    ys, zs, _ = simulate_block(model.layers[1], model.rotary, x, pos, None, plan)
    err = (finish(y, z) - finish(ys, zs)).abs().max().item()
    assert err <= 1e-3, err


def test_keys_of_the_former_plan_are_refused_by_name():
    """An upload made for the N = 32768 sqexp plan's chain, sent to the polyexp default's: typed refusal."""
    from fhe.backends.seal import wire
    from fhe.backends.seal.keys import CKKSClient
    from fhe.errors import KeyMismatchError

    old, new = ckks_params_for("sqexp", 6), ckks_params_for("polyexp", 5)
    assert old != new and old.poly_modulus_degree == new.poly_modulus_degree == 32768
    upload = wire.dump_public_keys(CKKSClient(old, []))
    with pytest.raises(KeyMismatchError, match=r"other CKKS parameters than this plan's \(N = 32768, 12 primes"):
        wire.load_server_keys(upload, new, [])


def test_keys_across_the_ring_change_are_refused_by_name():
    """N = 32768 keys (either former plan) at the depth-9 N = 16384 plan, and back: typed refusals that name
    the plan's ring and chain, never a crash in the loader."""
    from fhe.backends.seal import wire
    from fhe.backends.seal.keys import CKKSClient
    from fhe.errors import KeyMismatchError

    small, large = ckks_params_for("polyexp", 5, fold_v=True), ckks_params_for("polyexp", 5)
    with pytest.raises(KeyMismatchError, match=r"other CKKS parameters than this plan's \(N = 16384, 11 primes"):
        wire.load_server_keys(wire.dump_public_keys(CKKSClient(large, [])), small, [])
    with pytest.raises(KeyMismatchError, match=r"\(N = 32768, 12 primes"):
        wire.load_server_keys(wire.dump_public_keys(CKKSClient(small, [])), large, [])


def test_calibrate_fold_v_needs_polyexp(tmp_path, capsys):
    """``cipherlm fhe calibrate --fold-v`` records the depth-9 parameters for polyexp only: a typed refusal
    (exit 2, a message) for another kind, before any model loads."""
    from server.cli import main

    assert main(["fhe", "calibrate", "--approx", "sqexp", "--fold-v", "--out", str(tmp_path / "x.json")]) == 2
    assert "--fold-v needs --approx polyexp" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()
