"""FHE-friendly replacements for the attention softmax (the numerator part only).

The server computes, per query head h, unnormalized weights ``p_hij = f_h(s_hij)`` of the scores
``s_hij = q_hi . k_hj / sqrt(D)`` and returns ``y_h = (sum_j p_hij v_j) Wo_h`` and ``z_h = sum_j p_hij``;
the client divides after decrypting, so normalization is exact and only ``f`` is approximated:

* ``exact``  ``p = exp(s - rowmax)`` (the plaintext baseline; not computable under CKKS),
* ``sqexp``  ``p = (1 + x / 2^R) ^ (2^R)`` with ``x = a_h s + b_h``: R squarings of an affine map,
  a good ``exp(x)`` while ``|x| / 2^R`` is well below 1 (and the base stays positive),
* ``2quad``  ``p = (a_h s + b_h) ^ 2`` (MPCFormer's 2Quad; one squaring).

``bound`` is the calibrated bound on ``|a_h s + b_h|`` over calibration text; the squaring
approximation is only trusted inside it (see :func:`range_report`). Future (masked) positions
contribute exactly 0. See ``docs/approximations.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

KINDS = ("exact", "sqexp", "2quad")
#: sqexp's base 1 + x/2^R must stay positive: |x| must stay below this fraction of 2^R.
SQEXP_MAX_BOUND_FRACTION = 0.75


@dataclass(frozen=True)
class ScoreApprox:
    """One layer's score-to-weight map ``f_h`` (per query head h).

    Attributes:
        kind: ``"exact"``, ``"sqexp"`` or ``"2quad"``.
        scale: ``a_h`` per query head.
        shift: ``b_h`` per query head.
        squarings: R for ``sqexp`` (p = (1 + x/2^R)^(2^R)); ignored otherwise.
        bound: calibrated bound on ``|a_h s + b_h|`` (``inf`` only for ``exact``).
    """

    kind: str
    scale: tuple[float, ...]
    shift: tuple[float, ...]
    squarings: int = 6
    bound: float = math.inf

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
                           self.bound if bound is None else bound)

    def base_affine(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """Per head (alpha, beta) with the squared base = alpha * s + beta.

        sqexp: base = 1 + (a s + b)/2^R, so alpha = a/2^R, beta = 1 + b/2^R; 2quad: (a, b).
        This is what the encrypted block evaluates before its squarings.
        """
        if self.kind == "sqexp":
            n = 2.0 ** self.squarings
            return tuple(a / n for a in self.scale), tuple(1.0 + b / n for b in self.shift)
        return self.scale, self.shift

    @property
    def num_squarings(self) -> int:
        """Squarings the encrypted block performs after the affine map (0 for exact)."""
        return {"exact": 0, "sqexp": self.squarings, "2quad": 1}[self.kind]

    def to_dict(self) -> dict:
        """JSON-ready form (plan metadata)."""
        return {"kind": self.kind, "scale": list(self.scale), "shift": list(self.shift),
                "squarings": self.squarings, "bound": self.bound if math.isfinite(self.bound) else None}

    @classmethod
    def from_dict(cls, d: dict) -> ScoreApprox:
        """Inverse of :meth:`to_dict`."""
        bound = math.inf if d.get("bound") is None else float(d["bound"])
        return cls(d["kind"], tuple(d["scale"]), tuple(d["shift"]), int(d["squarings"]), bound)


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
    return score_map(scores, approx.kind, a, b, approx.squarings, mask)


def score_map(scores: torch.Tensor, kind: str, scale: torch.Tensor, shift: torch.Tensor, squarings: int,
              mask: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`unnormalized_weights` with scale/shift as tensors [Hq] (differentiable, for calibration)."""
    masked = _masked(scores, mask)
    s = scores.masked_fill(masked, 0.0)
    if kind == "exact":
        rowmax = scores.masked_fill(masked, float("-inf")).amax(-1, keepdim=True)
        p = torch.exp(s - rowmax.clamp_min(torch.finfo(s.dtype).min))
    else:
        x = scale[:, None, None] * s + shift[:, None, None]
        p = sqexp(x, squarings) if kind == "sqexp" else x * x
    return p.masked_fill(masked, 0.0)


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
