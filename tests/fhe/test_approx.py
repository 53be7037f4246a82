"""ScoreApprox validation and the score maps (exact / sqexp / 2quad)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fhe.approx import ScoreApprox, range_report, score_map, sqexp, unnormalized_weights


def test_validation():
    ScoreApprox("sqexp", (1.0,), (0.0,), 6, 40.0)
    with pytest.raises(ValueError):
        ScoreApprox("softmax", (1.0,), (0.0,), 6, 1.0)
    with pytest.raises(ValueError):
        ScoreApprox("sqexp", (1.0, 2.0), (0.0,), 6, 1.0)          # heads disagree
    with pytest.raises(ValueError):
        ScoreApprox("sqexp", (1.0,), (0.0,), 6)                    # no finite bound
    with pytest.raises(ValueError):
        ScoreApprox("sqexp", (1.0,), (0.0,), 4, 13.0)              # 13 > 0.75 * 16: base may go negative
    with pytest.raises(ValueError):
        ScoreApprox("2quad", (math.nan,), (0.0,), 6, 1.0)
    with pytest.raises(ValueError):
        ScoreApprox("sqexp", (1.0,), (0.0,), 0, 0.5)
    assert ScoreApprox.exact(3).num_heads == 3


def test_dict_round_trip_and_base_affine():
    a = ScoreApprox("sqexp", (2.0, 0.5), (-3.0, 1.0), 6, 20.0)
    assert ScoreApprox.from_dict(a.to_dict()) == a
    assert ScoreApprox.from_dict(ScoreApprox.exact(2).to_dict()) == ScoreApprox.exact(2)
    alpha, beta = a.base_affine()
    assert alpha == (2 / 64, 0.5 / 64) and beta == (1 - 3 / 64, 1 + 1 / 64)
    assert a.num_squarings == 6 and ScoreApprox("2quad", (1.0,), (0.0,), bound=3.0).num_squarings == 1


@settings(max_examples=60, deadline=None)
@given(st.floats(-40, 20))
def test_sqexp_brackets_exp(x):
    """exp(x) * exp(-x^2 / (2n min(1, 1+x/n))) <= (1 + x/n)^n <= exp(x), n = 2^R (log1p bounds)."""
    n, u = 64, x / 64
    got = float(sqexp(torch.tensor(x, dtype=torch.float64), 6))
    assert got <= math.exp(x) * (1 + 1e-12)
    assert got >= math.exp(x - n * u * u / (2 * min(1.0, 1 + u))) * (1 - 1e-12)


def test_maps_and_mask():
    s = torch.tensor([[[1.0, 2.0, 3.0], [0.5, -1.0, 4.0]]])      # [Hq=1, Tq=2, Tk=3]
    mask = torch.tensor([[False, True, True], [False, False, True]])
    ex = unnormalized_weights(s, ScoreApprox.exact(1), mask)
    torch.testing.assert_close(ex, torch.tensor([[[1.0, 0, 0], [1.0, math.exp(-1.5), 0]]]))
    sq = unnormalized_weights(s, ScoreApprox("sqexp", (2.0,), (-1.0,), 6, 30.0), mask)
    assert float(sq[0, 0, 0]) == pytest.approx((1 + 1 / 64) ** 64, rel=1e-5) and sq[0, 0, 1:].eq(0).all()
    q2 = unnormalized_weights(s, ScoreApprox("2quad", (1.0,), (5.0,), 6, 30.0), mask)
    torch.testing.assert_close(q2, torch.tensor([[[36.0, 0, 0], [30.25, 16.0, 0]]]))
    # -inf scores are masked like the mask says
    s_inf = s.masked_fill(mask, float("-inf"))
    torch.testing.assert_close(unnormalized_weights(s_inf, ScoreApprox("2quad", (1.0,), (5.0,), 6, 30.0)), q2)


def test_per_head_parameters_broadcast_over_head_axis():
    s = torch.zeros(2, 3, 4, 4)                                     # [B, Hq, Tq, Tk]
    a = ScoreApprox("2quad", (1.0, 1.0, 1.0), (1.0, 2.0, 3.0), bound=5.0)
    p = unnormalized_weights(s, a)
    assert p[:, 0].eq(1).all() and p[:, 1].eq(4).all() and p[:, 2].eq(9).all()
    with pytest.raises(ValueError):
        unnormalized_weights(torch.zeros(2, 4, 4), a)


def test_score_map_is_differentiable():
    s = torch.randn(2, 3, 3)
    a = torch.ones(2, requires_grad=True)
    b = torch.zeros(2, requires_grad=True)
    score_map(s, "sqexp", a, b, 6).sum().backward()
    assert a.grad is not None and b.grad.abs().sum() > 0


def test_range_report():
    s = torch.tensor([[[1.0, 50.0], [-3.0, 2.0]]])
    mask = torch.tensor([[False, True], [False, False]])
    r = range_report(s, ScoreApprox("sqexp", (1.0,), (-2.0,), 6, 4.0), mask)
    assert r == {"min": -5.0, "max": 0.0, "absmax": 5.0, "fits": False}
    assert range_report(s, ScoreApprox("sqexp", (1.0,), (-2.0,), 6, 6.0), mask)["fits"]
