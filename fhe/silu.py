"""A calibrated polynomial SiLU: the server-side alternative to the client-aided MLP non-linearity.

``silu(x) = x * sigmoid(x)`` is fitted on ``[-bound, bound]`` by least squares in the Chebyshev basis of
``x / bound``, on the gate pre-activations a layer actually produces on calibration text (so the fit spends
its accuracy where the values are) plus a uniform grid (so it stays sane across the whole range).
``bound = margin * max |x|`` observed; outside it the polynomial is not trusted (:meth:`SiluPoly.coverage`).
Under CKKS a degree-d polynomial costs ``ceil(log2(d + 1))`` levels (Paterson–Stockmeyer / baby-step
giant-step evaluation); the product with ``up`` one more.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from numpy.polynomial import chebyshev

from fhe.errors import ParameterError


@dataclass(frozen=True)
class SiluPoly:
    """``p(x) = sum_k c_k T_k(x / bound)`` ≈ silu(x) on ``|x| <= bound``."""

    coeffs: tuple[float, ...]
    bound: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "coeffs", tuple(float(c) for c in self.coeffs))
        if not self.coeffs or not all(math.isfinite(c) for c in self.coeffs):
            raise ParameterError("a SiLU polynomial needs finite coefficients")
        if not (math.isfinite(self.bound) and self.bound > 0):
            raise ParameterError(f"SiLU bound must be positive and finite, got {self.bound}")

    @property
    def degree(self) -> int:
        return len(self.coeffs) - 1

    @property
    def depth(self) -> int:
        """CKKS levels the evaluation takes, ``ceil(log2(d + 1))`` (the 1/bound folds into the gate weights)."""
        return max(1, math.ceil(math.log2(self.degree + 1)))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Evaluate on a tensor (any shape), in float64, cast back to x's dtype."""
        t = (x.detach().double() / self.bound).cpu().numpy()
        return torch.from_numpy(chebyshev.chebval(t, np.asarray(self.coeffs))).to(x.dtype)

    def coverage(self, x: torch.Tensor) -> float:
        """Fraction of values inside the trusted range."""
        return float((x.abs() <= self.bound).double().mean())

    def to_dict(self) -> dict:
        return {"coeffs": list(self.coeffs), "bound": self.bound}

    @classmethod
    def from_dict(cls, d: dict) -> SiluPoly:
        try:
            return cls(tuple(d["coeffs"]), float(d["bound"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ParameterError(f"bad SiLU polynomial: {exc}") from exc


def fit_silu(samples: torch.Tensor, degree: int = 15, margin: float = 1.1, grid_weight: float = 0.1) -> SiluPoly:
    """Fit silu on the observed gate pre-activations ``samples`` (any shape).

    Args:
        samples: calibration values of ``W_gate x`` for one layer.
        degree: polynomial degree (15: depth 4 under CKKS).
        margin: bound = margin * max |samples|.
        grid_weight: total weight of a uniform grid over the range, relative to the samples'.
    """
    if degree < 1:
        raise ParameterError("degree must be >= 1")
    x = samples.detach().double().flatten().cpu().numpy()
    if x.size == 0 or not np.all(np.isfinite(x)):
        raise ParameterError("need finite calibration samples")
    bound = margin * float(np.abs(x).max()) or 1.0
    grid = np.linspace(-bound, bound, 2001)
    pts = np.concatenate([x, grid])
    wts = np.concatenate([np.ones_like(x), np.full(grid.size, grid_weight * x.size / grid.size)])
    y = pts / (1.0 + np.exp(-pts))
    coeffs = chebyshev.chebfit(pts / bound, y, degree, w=np.sqrt(wts))
    return SiluPoly(tuple(coeffs), bound)


__all__ = ["SiluPoly", "fit_silu"]
