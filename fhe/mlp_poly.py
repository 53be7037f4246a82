"""The encrypted SwiGLU MLP block with a polynomial SiLU on the server: one round trip, no client step.

Server, from the client's replicated x̂ (period P1) at the top level L:

1. ``t = (W_gate g / B) x̂`` and ``u = (W_up g) x̂``: two hybrid products with fold 1, so every slot that is
   not an output holds exactly 0 (a Chebyshev polynomial of junk partial sums could overflow) — L-1;
2. ``T_k(t)`` for k <= d by ``T_2k = 2 T_k^2 - 1``, ``T_2k+1 = 2 T_k T_k+1 - t``: T_k at L-1-ceil(log2 k);
3. ``sum_k T_k(t) * (c_k u)`` with ``c_k u`` made on u's own path (a plaintext product, no extra depth),
   every product at the common level m = L-1-ceil(log2 d), one relinearization, one rescale — m-1;
4. a repack slot map from the product's output slots to the period-P2 replicated layout of ``down`` — m-2;
5. ``W_down`` by the hybrid product — m-3 >= 1.

Depth ``4 + ceil(log2 d)``: d = 7 fits :data:`POLY_MLP_PARAMS` (N = 16384, seven 2^40 primes). Scales are
relabelled to 2^40 after each rescale (``set_scale``: the message changes by prime/2^40 = 1 ± 2^-20, far
below the polynomial's own error). Nothing here names a CKKS library.
"""

from __future__ import annotations

import math

import numpy as np

from engine.model import DecoderLayer
from fhe.errors import ParameterError
from fhe.evaluator import Ciphertext, EvalKeys, Evaluator, add_plain_values, check_fresh, relin_rescale
from fhe.linalg import HybridMatvec, SlotMap, hybrid_slots, pick_fold
from fhe.mlp import MLPWeights, _default_evaluator
from fhe.params import CKKSParams
from fhe.silu import SiluPoly

POLY_MLP_PARAMS = CKKSParams(16384, (60,) + (40,) * 7 + (60,), 40)


def poly_depth(degree: int) -> int:
    """Levels the block takes for a SiLU polynomial of ``degree``."""
    return 4 + max(1, math.ceil(math.log2(max(degree, 2))))


class EncryptedPolyMLP:
    """Server side of one MLP block with the plan's SiLU polynomial (plaintext weights, public keys only)."""

    def __init__(self, layer: DecoderLayer, poly: SiluPoly, params: CKKSParams = POLY_MLP_PARAMS, *,
                 evaluator: Evaluator | None = None) -> None:
        if params.depth < poly_depth(poly.degree):
            raise ParameterError(f"degree {poly.degree} needs depth {poly_depth(poly.degree)}, params have "
                                 f"{params.depth}")
        self.ev = evaluator if evaluator is not None else _default_evaluator(params)
        self.poly = poly
        w, s = MLPWeights.of(layer), self.ev.slots
        period = w.hidden
        out = hybrid_slots(s, period, 1, w.intermediate)              # fold 1: non-output slots stay 0
        self.gate = HybridMatvec(s, w.gate / poly.bound, out, period, 1)
        self.up = HybridMatvec(s, w.up, out, period, 1)
        fold2, p2 = pick_fold(s, w.intermediate, w.hidden)
        self.down = HybridMatvec(s, w.down, hybrid_slots(s, p2, fold2, w.hidden), p2, fold2)
        self.repack = _repack(s, out, p2)
        self.in_period, self.out_slots = period, self.down.out_slots
        self._encode()

    def _encode(self) -> None:
        ev, top = self.ev, self.ev.top
        self.m = top - 1 - max(1, math.ceil(math.log2(max(self.poly.degree, 2))))
        self._gate, self._up = self.gate.encode(ev, top), self.up.encode(ev, top)
        self._repack = self.repack.encode(ev, self.m - 1)
        self._down = self.down.encode(ev, self.m - 2)
        lvl = top - 1
        self._coef = [ev.encode(np.full(ev.slots, c), lvl, ev.prime(lvl)) for c in self.poly.coeffs]

    @property
    def rotation_steps(self) -> set[int]:
        steps = self.gate.rotation_steps | self.repack.rotation_steps | self.down.rotation_steps
        return {x % self.ev.slots for x in steps} - {0}

    def forward(self, ct: Ciphertext, keys: EvalKeys) -> Ciphertext:
        """Fresh replicated x̂ -> ``W_down (p(g) * u)`` at level 1."""
        ev = self.ev
        check_fresh(ev, keys, ct)
        t, u = self._gate(ev, ct, keys), self._up(ev, ct, keys)
        ev.set_scale(t, ev.scale)
        ev.set_scale(u, ev.scale)
        cheb = _chebyshev(ev, t, self.poly.degree, keys)
        acc = self._terms(cheb, u)
        acc = relin_rescale(ev, acc, keys)
        ev.set_scale(acc, ev.scale)
        a = self._repack(ev, acc, keys)
        return ev.mod_switch(self._down(ev, a, keys), 1)

    def _terms(self, cheb: dict[int, Ciphertext], u: Ciphertext) -> Ciphertext:
        """sum_k T_k * (c_k u) at level m, scale 2^80 (size 3: relinearized once by the caller)."""
        ev, m = self.ev, self.m
        terms = []
        for k, pt in enumerate(self._coef):
            cu = ev.mul_plain(u, pt)
            ev.rescale_inplace(cu)
            ev.set_scale(cu, ev.scale)
            cu = ev.mod_switch(cu, m)
            if k == 0:   # T_0 = 1: a plaintext one at scale 2^40 matches the others' 2^80
                terms.append(ev.mul_plain(cu, ev.encode(np.ones(ev.slots), m, ev.scale)))
            else:
                terms.append(ev.mul(ev.mod_switch(cheb[k], m), cu))
        return ev.add_many(terms)


def _chebyshev(ev: Evaluator, t: Ciphertext, degree: int, keys: EvalKeys) -> dict[int, Ciphertext]:
    """T_1..T_degree of t (each relabelled to the default scale)."""
    cheb = {1: t}
    for k in range(2, degree + 1):
        a, b = cheb[k // 2], cheb[k - k // 2]
        lvl = min(ev.level(a), ev.level(b))
        prod = relin_rescale(ev, ev.mul(ev.mod_switch(a, lvl), ev.mod_switch(b, lvl)), keys)
        ev.set_scale(prod, ev.scale)
        prod = ev.add(prod, prod)
        if k % 2 == 0:
            prod = add_plain_values(ev, prod, np.full(ev.slots, -1.0))
        else:   # 2 T_j T_j+1 - T_1
            prod = ev.add(prod, _negate(ev, ev.mod_switch(t, ev.level(prod))))
        cheb[k] = prod
    return cheb


def _negate(ev: Evaluator, ct: Ciphertext) -> Ciphertext:
    """-ct at no level: the product with -1 encoded at scale 1 (exact: a constant polynomial) keeps the scale."""
    return ev.mul_plain(ct, ev.encode(np.full(ev.slots, -1.0), ev.level(ct), 1.0))


def _repack(slots: int, src_slots: np.ndarray, period: int) -> SlotMap:
    """out[i] at ``src_slots[i]`` -> every ``i + k * period < slots`` (the replicated input of ``down``)."""
    n = len(src_slots)
    dst, src = [], []
    for k in range(-(-slots // period)):
        i = np.arange(n)
        keep = i + k * period < slots
        dst.append(i[keep] + k * period)
        src.append(src_slots[keep])
    dst, src = np.concatenate(dst), np.concatenate(src)
    return SlotMap(slots, dst, src, np.ones(len(dst)))


__all__ = ["POLY_MLP_PARAMS", "EncryptedPolyMLP", "poly_depth"]
