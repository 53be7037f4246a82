"""FHE-friendly replacements for the attention softmax (the numerator part only).

The server computes, per query head h, unnormalized weights ``p_hij = f_h(s_hij)`` of the scores
``s_hij = q_hi . k_hj / sqrt(D)`` and returns ``y_h = (sum_j p_hij v_j) Wo_h`` and ``z_h = sum_j p_hij``;
the client divides after decrypting, so normalization is exact and only ``f`` is approximated:

* ``exact``  ``p = exp(s - rowmax)`` (the plaintext baseline; not computable under CKKS),
* ``sqexp``  ``p = (1 + x / 2^R) ^ (2^R)`` with ``x = a_h s + b_h``: R squarings of an affine map,
  a good ``exp(x)`` while ``|x| / 2^R`` is well below 1 (and the base stays positive),
* ``2quad``  ``p = (a_h s + b_h) ^ 2`` (MPCFormer's 2Quad; one squaring),
* ``polyexp`` ``p = P(x)``: the degree ``2^R - 1`` Chebyshev interpolant of ``exp`` on the window
  ``[-window, POLY_HI]``, evaluated at depth R (``fhe.poly``). R = 5 (degree 31, max error 1e-10 on
  [-40, 0.5]) is one level shallower than sqexp R=6 and practically exact; R = 4 (degree 15, 4e-4 on
  [-32, 0.5]) is not enough: its absolute error swamps rows whose weights are all small.

``bound`` is the calibrated bound on ``|a_h s + b_h|`` over calibration text; the squaring
approximation is only trusted inside it (see :func:`range_report`). Future (masked) positions
contribute exactly 0. See ``docs/approximations.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

KINDS = ("exact", "sqexp", "2quad", "polyexp")
#: sqexp's base 1 + x/2^R must stay positive: |x| must stay below this fraction of 2^R.
SQEXP_MAX_BOUND_FRACTION = 0.75
#: polyexp's window reaches this far above 0: the fitted shift puts each head's largest x near 0, and a
#: held-out prompt may go a little past it (outside the window a polynomial leaves exp quickly).
POLY_HI = 0.5
#: Default window (lower end -window): max |P - exp| is 1.0e-10 at R = 5 (1.6e-12 for 32; R = 4: 1.7e-3,
#: 4.0e-4 for 32). SmolLM2's fitted layers reach |x| ~ 27-30, and the bound (1.25x) must stay inside.
POLY_WINDOW = 40.0


@dataclass(frozen=True)
class ScoreApprox:
    """One layer's score-to-weight map ``f_h`` (per query head h).

    Attributes:
        kind: ``"exact"``, ``"sqexp"``, ``"2quad"`` or ``"polyexp"``.
        scale: ``a_h`` per query head.
        shift: ``b_h`` per query head.
        squarings: R for ``sqexp`` (p = (1 + x/2^R)^(2^R)) and ``polyexp`` (degree 2^R - 1 at depth R);
            ignored otherwise.
        bound: calibrated bound on ``|a_h s + b_h|`` (``inf`` only for ``exact``).
        window: polyexp only: P approximates exp on ``[-window, POLY_HI]`` (0 for the other kinds).
    """

    kind: str
    scale: tuple[float, ...]
    shift: tuple[float, ...]
    squarings: int = 6
    bound: float = math.inf
    window: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown approximation kind {self.kind!r} (expected one of {KINDS})")
        object.__setattr__(self, "scale", tuple(float(a) for a in self.scale))
        object.__setattr__(self, "shift", tuple(float(b) for b in self.shift))
        if not self.scale or len(self.scale) != len(self.shift):
            raise ValueError("scale and shift need one entry per query head")
        if not all(math.isfinite(v) for v in self.scale + self.shift):
            raise ValueError("scale and shift must be finite")
        if not isinstance(self.squarings, int) or not 1 <= self.squarings <= 12:
            raise ValueError(f"squarings must be an int in [1, 12], got {self.squarings!r}")
        self._check_bound()

    def _check_bound(self) -> None:
        if math.isnan(self.bound) or self.bound <= 0:
            raise ValueError(f"bound must be positive, got {self.bound}")
        if self.kind != "exact" and not math.isfinite(self.bound):
            raise ValueError(f"{self.kind} needs a finite calibrated bound")
        if self.kind == "sqexp" and self.bound > SQEXP_MAX_BOUND_FRACTION * 2 ** self.squarings:
            raise ValueError(f"sqexp bound {self.bound} too large for R={self.squarings}: "
                             f"needs <= {SQEXP_MAX_BOUND_FRACTION} * 2^R so the base stays positive")
        if (self.kind == "polyexp") != (self.window > 0) or not math.isfinite(self.window):
            raise ValueError("polyexp needs a finite window > 0, the other kinds none")
        if self.kind == "polyexp" and self.bound > self.window:
            raise ValueError(f"polyexp bound {self.bound} exceeds its window {self.window}")

    @property
    def num_heads(self) -> int:
        """Number of query heads Hq."""
        return len(self.scale)

    @classmethod
    def exact(cls, num_heads: int) -> ScoreApprox:
        """The exact-softmax baseline (identity affine map, no bound)."""
        return cls("exact", (1.0,) * num_heads, (0.0,) * num_heads)

    def with_params(self, scale, shift, bound: float | None = None) -> ScoreApprox:
        """A copy with new per-head scale/shift (and bound)."""
        return ScoreApprox(self.kind, tuple(scale), tuple(shift), self.squarings,
                           self.bound if bound is None else bound, self.window)

    def base_affine(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """Per head (alpha, beta) with the squared base = alpha * s + beta.

        sqexp: base = 1 + (a s + b)/2^R, so alpha = a/2^R, beta = 1 + b/2^R; 2quad: (a, b);
        polyexp: the polynomial's variable t = (a s + b - c)/r in [-1, 1] on the window (c, r: its
        centre and half-width). This is what the encrypted block evaluates before its squarings
        (or its polynomial).
        """
        if self.kind == "sqexp":
            n = 2.0 ** self.squarings
            return tuple(a / n for a in self.scale), tuple(1.0 + b / n for b in self.shift)
        if self.kind == "polyexp":
            c, r = window_affine(self.window)
            return tuple(a / r for a in self.scale), tuple((b - c) / r for b in self.shift)
        return self.scale, self.shift

    @property
    def num_squarings(self) -> int:
        """Squarings the encrypted block performs after the affine map (0 for exact)."""
        return {"exact": 0, "sqexp": self.squarings, "2quad": 1, "polyexp": 0}[self.kind]

    @property
    def score_depth(self) -> int:
        """Levels the encrypted block spends on the map after q.k (sqexp/polyexp: R, 2quad: 1)."""
        return 0 if self.kind == "exact" else 1 if self.kind == "2quad" else self.squarings

    def poly_coefficients(self) -> np.ndarray:
        """polyexp: P's power-basis coefficients in t (see :meth:`base_affine`), lowest first."""
        if self.kind != "polyexp":
            raise ValueError(f"{self.kind} has no polynomial")
        return exp_poly_coefficients(self.window, 2 ** self.squarings - 1)

    def to_dict(self) -> dict:
        """JSON-ready form (plan metadata); ``window`` only for polyexp (older plans keep their hash)."""
        out = {"kind": self.kind, "scale": list(self.scale), "shift": list(self.shift),
               "squarings": self.squarings, "bound": self.bound if math.isfinite(self.bound) else None}
        if self.kind == "polyexp":
            out["window"] = self.window
        return out

    @classmethod
    def from_dict(cls, d: dict) -> ScoreApprox:
        """Inverse of :meth:`to_dict`."""
        bound = math.inf if d.get("bound") is None else float(d["bound"])
        return cls(d["kind"], tuple(d["scale"]), tuple(d["shift"]), int(d["squarings"]), bound,
                   float(d.get("window", 0.0)))


def window_affine(window: float) -> tuple[float, float]:
    """Centre c and half-width r of polyexp's window [-window, POLY_HI] (x = c + r t)."""
    return (POLY_HI - window) / 2, (POLY_HI + window) / 2


def exp_poly_coefficients(window: float, degree: int) -> np.ndarray:
    """Power-basis coefficients (in t, lowest first) of the Chebyshev interpolant of exp(c + r t).

    Interpolation at the Chebyshev points is within a factor ~2 of the minimax error and fully
    deterministic (the simulator and the encrypted block use the very same numbers).
    """
    c, r = window_affine(window)
    cheb = np.polynomial.chebyshev.Chebyshev.interpolate(lambda t: np.exp(c + r * t), degree)
    return np.polynomial.chebyshev.cheb2poly(cheb.coef)


def poly_eval(t: torch.Tensor, coeffs: np.ndarray) -> torch.Tensor:
    """sum_k coeffs[k] t^k by Horner (the plaintext reference of ``fhe.poly``; differentiable)."""
    y = torch.full_like(t, float(coeffs[-1]))
    for c in coeffs[-2::-1]:
        y = y * t + float(c)
    return y


def affine_scores(scores: torch.Tensor, approx: ScoreApprox) -> torch.Tensor:
    """x = a_h s + b_h for scores [..., Hq, Tq, Tk] (a, b broadcast over the head axis -3)."""
    hq = scores.shape[-3]
    if hq != approx.num_heads:
        raise ValueError(f"scores have {hq} heads, approximation has {approx.num_heads}")
    a = torch.tensor(approx.scale, dtype=scores.dtype, device=scores.device).view(hq, 1, 1)
    b = torch.tensor(approx.shift, dtype=scores.dtype, device=scores.device).view(hq, 1, 1)
    return a * scores + b


def sqexp(x: torch.Tensor, squarings: int) -> torch.Tensor:
    """(1 + x/2^R)^(2^R) by R squarings, exactly as the encrypted block computes it."""
    y = 1.0 + x / (2.0 ** squarings)
    for _ in range(squarings):
        y = y * y
    return y


def _masked(scores: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Boolean mask of positions that contribute 0: given mask (True = future) or -inf scores."""
    m = torch.isneginf(scores)
    return m if mask is None else m | mask


def unnormalized_weights(scores: torch.Tensor, approx: ScoreApprox,
                         mask: torch.Tensor | None = None) -> torch.Tensor:
    """Unnormalized attention weights p [..., Hq, Tq, Tk] from scores s [..., Hq, Tq, Tk].

    Args:
        scores: q.k/sqrt(D) per query head; masked entries may be ``-inf``.
        approx: the layer's score map.
        mask: optional bool, broadcastable to scores, True where the key is in the query's future.

    Returns:
        p with masked entries exactly 0 (exact: exp(s - rowmax); sqexp/2quad: the polynomial).
    """
    if scores.shape[-3] != approx.num_heads:
        raise ValueError(f"scores have {scores.shape[-3]} heads, approximation has {approx.num_heads}")
    a = torch.tensor(approx.scale, dtype=scores.dtype, device=scores.device)
    b = torch.tensor(approx.shift, dtype=scores.dtype, device=scores.device)
    return score_map(scores, approx.kind, a, b, approx.squarings, mask, approx.window)


def score_map(scores: torch.Tensor, kind: str, scale: torch.Tensor, shift: torch.Tensor, squarings: int,
              mask: torch.Tensor | None = None, window: float = 0.0, clamp: bool = False) -> torch.Tensor:
    """:func:`unnormalized_weights` with scale/shift as tensors [Hq] (differentiable, for calibration).

    ``clamp`` (polyexp, calibration only) holds x inside the window while the fit moves: outside it the
    polynomial leaves exp by orders of magnitude and its gradients with it. The encrypted block cannot
    clamp, so a plan is only accepted when its range fits the window unclamped.
    """
    masked = _masked(scores, mask)
    s = scores.masked_fill(masked, 0.0)
    if kind == "exact":
        rowmax = scores.masked_fill(masked, float("-inf")).amax(-1, keepdim=True)
        p = torch.exp(s - rowmax.clamp_min(torch.finfo(s.dtype).min))
    else:
        x = scale[:, None, None] * s + shift[:, None, None]
        p = _apply_map(x, kind, squarings, window, clamp)
    return p.masked_fill(masked, 0.0)


def _apply_map(x: torch.Tensor, kind: str, squarings: int, window: float, clamp: bool) -> torch.Tensor:
    if kind == "sqexp":
        return sqexp(x, squarings)
    if kind == "polyexp":
        c, r = window_affine(window)
        if clamp:  # below only: above the window P still follows exp for a while, and the fit must see it
            x = x.clamp(min=-window)
        return poly_eval((x - c) / r, exp_poly_coefficients(window, 2 ** squarings - 1))
    return x * x


def range_report(scores: torch.Tensor, approx: ScoreApprox, mask: torch.Tensor | None = None) -> dict:
    """Observed range of x = a s + b over unmasked entries and whether it fits ``approx.bound``.

    Returns:
        ``{"min": float, "max": float, "absmax": float, "fits": bool}`` (exact always fits).
    """
    masked = _masked(scores, mask)
    x = affine_scores(scores.masked_fill(masked, 0.0), approx)
    vals = x[~masked.expand_as(x)]
    lo, hi = (float(vals.min()), float(vals.max())) if vals.numel() else (0.0, 0.0)
    absmax = max(abs(lo), abs(hi))
    return {"min": lo, "max": hi, "absmax": absmax, "fits": approx.kind == "exact" or absmax <= approx.bound}
