"""The calibrated polynomial SiLU: accuracy on its range, depth, serialization, bad input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fhe.errors import ParameterError
from fhe.silu import SiluPoly, fit_silu


def test_fit_is_accurate_where_the_samples_are():
    x = torch.randn(5000, generator=torch.Generator().manual_seed(0)) * 2
    poly = fit_silu(x, degree=15)
    assert poly.bound == pytest.approx(1.1 * float(x.abs().max()))
    assert (poly(x) - F.silu(x)).abs().max() < 2e-2
    assert poly.depth == 4 and poly.coverage(x) == 1.0
    assert poly.coverage(torch.tensor([0.0, 3 * poly.bound])) == 0.5
    assert (fit_silu(x, degree=3)(x) - F.silu(x)).abs().max() > 0.05    # a low degree is visibly worse


def test_round_trip_and_bad_values():
    poly = fit_silu(torch.linspace(-4, 4, 100), degree=5)
    assert SiluPoly.from_dict(poly.to_dict()) == poly
    with pytest.raises(ParameterError):
        SiluPoly((), 1.0)
    with pytest.raises(ParameterError):
        SiluPoly((0.0, float("nan")), 1.0)
    with pytest.raises(ParameterError):
        SiluPoly((0.0,), 0.0)
    with pytest.raises(ParameterError):
        SiluPoly.from_dict({"coeffs": [1.0]})
    with pytest.raises(ParameterError):
        fit_silu(torch.tensor([1.0, float("inf")]))
