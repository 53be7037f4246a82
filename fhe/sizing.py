"""Value sizing of the encrypted attention block: how large q, k and p are made so that the block's
outputs fill the last prime's range without overflowing it (``docs/fhe.md`` §1 and §3).

The score scaling and a common gain g are folded into Wq/Wk and beta (:func:`fold_scores`); g is sized
for the worst case at setup (:meth:`Extent.worst`) and raised per step to the plan's observed extent
(:meth:`Extent.sized`). Exact normalization on the client cancels g.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from fhe.approx import POLY_HI
from fhe.plan import LayerPlan
from fhe.simulator import BlockWeights

#: Outputs (y, z) must stay below 2^(first prime - scale - 2) at the last level.
OUTPUT_HEADROOM_BITS = 2
#: Margin over the plan's observed max of a s + b when sizing p (calibration's own margin is 1.25).
X_MARGIN = 1.5
#: polyexp: P's largest value is exp of the window's top or of the observed max x, if higher (the fit may
#: end a little above the window, where P still follows exp); this margin covers a held-out x above that.
P_MARGIN = 1.5
#: Margin over the plan's observed largest denominator and normalized output when sizing p.
OUTPUT_MARGIN = 2.0


def base_max(plan: LayerPlan) -> float:
    """Largest squared base on the calibrated range: the plan's observed max of x = a s + b (times
    :data:`X_MARGIN`, capped by the bound) when it has one, else the bound."""
    approx = plan.approx
    x_hi = approx.bound
    if plan.observed_range is not None:
        x_hi = min(approx.bound, X_MARGIN * max(abs(plan.observed_range[1]), 1.0))
    if approx.kind == "polyexp":  # p itself (the block raises the base to the power 1 here)
        top = POLY_HI if plan.observed_range is None else max(POLY_HI, plan.observed_range[1])
        return math.exp(top) * P_MARGIN
    return 1.0 + x_hi / 2 ** approx.squarings if approx.kind == "sqexp" else max(approx.bound, 1e-6)


def fold_scores(bw: BlockWeights, plan: LayerPlan, g: float, boost: float = 1.0):
    """Fold the score scaling into the projections: Wq, bq, Wk, bk and beta, all float64.

    The squared base is ``g * (alpha_h s + beta_h)`` with ``s = q.k / sqrt(D)``; the factor
    ``f_h = g * alpha_h / sqrt(D)`` is split between q and k (k's share per KV head ``c_g =
    sqrt(max_h |f_h|)``). Both are further multiplied by ``boost``: q and k then carry ``boost`` times
    larger values over the same absolute CKKS noise, and the q.k rescale by a prime ``boost^2`` times the
    scale takes the factor back out (see :meth:`EncryptedAttentionLayer._scale_chain`). Exact
    normalization on the client cancels the common factor g^n (n = 2^squarings).
    """
    approx = plan.approx
    alpha, beta = (np.asarray(v, np.float64) for v in approx.base_affine())
    f = alpha * g / math.sqrt(bw.head_dim)                                   # [Hq]
    grp = bw.num_heads // bw.num_kv_heads
    c = np.sqrt(np.abs(f).reshape(bw.num_kv_heads, grp).max(1)).clip(1e-12)  # [Hkv]
    fq = np.repeat(f / np.repeat(c, grp), bw.head_dim) * boost               # [Hq*D]
    fk = np.repeat(c, bw.head_dim) * boost                                   # [Hkv*D]

    def scaled(w, b, per_row):
        return w.numpy() * per_row[:, None], None if b is None else b.numpy() * per_row

    wq, bq = scaled(bw.wq, bw.bq, fq)
    wk, bk = scaled(bw.wk, bw.bk, fk)
    return wq, bq, wk, bk, beta * g


def value_gain(bw: BlockWeights) -> float:
    """Bound on max_o |y_h[o]| / z_h: max over heads and outputs of ||(Wo_h Wv_g)[o, :]||_2 * sqrt(hidden).

    (y_h / z_h is a convex combination of v_j Wo_h, and a normalized input has norm sqrt(hidden).)
    """
    d, g = bw.head_dim, bw.num_heads // bw.num_kv_heads
    worst = 0.0
    for h in range(bw.num_heads):
        m = bw.wo[:, h * d:(h + 1) * d] @ bw.wv[(h // g) * d:(h // g + 1) * d]   # [hidden, hidden]
        worst = max(worst, float(m.norm(dim=1).max()))
    return worst * math.sqrt(bw.wq.shape[1])


@dataclass(frozen=True)
class Extent:
    """Bounds on the block's outputs in the score map's units (p_j <= ``p_max``): z <= tokens * p_max and
    |y_h| <= z * ``gain`` always; when the plan measured them, z <= margin * z_obs and |y_h| <= z * margin
    * out_obs on its data, usually far tighter (SmolLM2 layers 2-5: out_obs ~5 vs gain ~100, z_obs ~1)."""

    p_max: float
    gain: float
    z_obs: float = math.inf
    out_obs: float = math.inf

    @classmethod
    def build(cls, plan: LayerPlan, p_max: float, gain: float) -> Extent:
        if plan.observed_output is None:
            return cls(p_max, gain)
        z_obs, out_obs = plan.observed_output
        return cls(p_max, gain, OUTPUT_MARGIN * z_obs, OUTPUT_MARGIN * out_obs)

    def worst(self, tokens: int) -> float:
        """Worst-case max(z, |y|) at this context length (what the setup sizes g for)."""
        return tokens * self.p_max * self.gain

    def sized(self, tokens: int) -> float:
        """The bound a step at this context length sizes p for."""
        return min(tokens * self.p_max, self.z_obs) * max(1.0, min(self.gain, self.out_obs))
