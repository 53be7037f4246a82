"""Encrypted evaluation of a real polynomial of degree 2^R - 1 at multiplicative depth R.

``P(t) = lo(t) + t^(2^(R-1)) * hi(t)`` recursively (baby-step/giant-step on the power-of-two powers
``t^2, t^4, ...``), down to ``c0 + c1 t``. The scalar multiplications of a naive evaluation cost one
level more; here every scalar sits on ``t`` itself (level L, one level above where ``c1 t`` is
needed), so a degree 2^R - 1 polynomial leaves at level ``L - R``, the optimum. Cost at R = 4 (degree
15): 10 ciphertext products (3 powers + 7 giant steps), each with one relinearization, 8 products by a
constant and 8 constant additions; at R = 5 (degree 31, the default plan): 19 products (4 + 15), 16, 16.

Scales are steered top-down: each node is asked for a (level, scale), and the constant of ``c1 t`` is
encoded at the scale that lands exactly there, so every addition meets equal scales without a
correction step. Constants are added on ``mask`` only (the block's valid rows): where ``t`` is 0 (rows
past the cache's end) P's value is then exactly 0 up to noise, as masking needs.

``P(t) * v`` for a ciphertext v costs no level more (:meth:`PolyEvaluator.with_values`): degree 2^R - 1
times one more factor is degree 2^R, still depth R. The top chain ``t^(2^(R-1)) ... t^2 (c_top t + c) v``
carries v instead of its scalar (``c_top`` rides on v, one level above t), and each lo half of the
chain, computed one level higher than P needs it, is multiplied by v there. This is how the block
spends no level on ``p * V`` (docs/fhe.md §3, the depth-9 plan at N = 16384).

Only :class:`fhe.evaluator.Evaluator` calls; the plaintext reference is :func:`fhe.approx.poly_eval`.
"""

from __future__ import annotations

import math

import numpy as np

from fhe.errors import LevelError
from fhe.evaluator import Ciphertext, EvalKeys, Evaluator, Plaintext, relin_rescale


def poly_depth(num_coeffs: int) -> int:
    """R for a polynomial of ``num_coeffs = 2^R`` coefficients (ValueError for any other count)."""
    r = int(math.log2(num_coeffs)) if num_coeffs >= 2 else 0
    if r < 1 or 2 ** r != num_coeffs:
        raise ValueError(f"need 2^R >= 2 coefficients (degree 2^R - 1), got {num_coeffs}")
    return r


class PolyEvaluator:
    """Evaluates ``sum_k coeffs[k] t^k`` on ciphertexts; the result carries ``out_scale`` at level(t) - R.

    Args:
        ev: the backend.
        coeffs: 2^R power-basis coefficients, lowest first; the odd ones (each ``c1`` of the
            recursion) must be non-zero (SEAL refuses a product with an all-zero plaintext).
        mask: [S] 0/1 vector of the slots that get the constants (None = all).
        out_scale: the scale of the result.
        basis: ``"power"`` (giant steps t^(2^j)) or ``"chebyshev"``: the same tree on T_(2^j)(t) =
            2 T_(2^(j-1))^2 - 1, each split ``p = lo + T_h hi`` by Chebyshev division. Same depth and
            products; its coefficients stay of the size of P (sum |a_k| ~ max P for exp) where the power
            basis cancels terms ~30x larger, so CKKS's absolute noise costs ~30x less where P is small.
    """

    def __init__(self, ev: Evaluator, coeffs, out_scale: float, mask: np.ndarray | None = None, *,
                 basis: str = "power") -> None:
        self.ev, self.coeffs = ev, np.asarray(coeffs, np.float64)
        self.depth = poly_depth(len(self.coeffs))
        if basis not in ("power", "chebyshev"):
            raise ValueError(f"basis {basis!r}: 'power' or 'chebyshev'")
        self.basis = basis
        self._leaves = _leaves(self.coeffs, basis)     # tree position lo -> (c0, c1) of its linear leaf
        if not all(c1 for _, c1 in self._leaves.values()):
            raise ValueError("every leaf's linear coefficient must be non-zero (it multiplies t)")
        self.out_scale = out_scale
        self.mask = np.ones(ev.slots) if mask is None else np.asarray(mask, np.float64)
        self._pts: dict[tuple, Plaintext] = {}     # encoded constants, reused while t's scale holds

    def __call__(self, t: Ciphertext, keys: EvalKeys) -> Ciphertext:
        """P(t): t at level L (>= R + 1) -> ciphertext at level L - R with scale ``out_scale``."""
        ev = self.ev
        if ev.level(t) <= self.depth:
            raise LevelError(f"t at level {ev.level(t)} cannot take a depth-{self.depth} polynomial")
        powers = self._powers(t, keys)
        return self._node(powers, 0, len(self.coeffs), ev.level(t) - self.depth, self.out_scale, keys)

    def with_values(self, t: Ciphertext, v: Ciphertext, pv_scale: float,
                    keys: EvalKeys) -> tuple[Ciphertext, Ciphertext]:
        """(P(t), P(t) * v) at the same depth R as P(t) alone.

        Args:
            t: at level L (>= R + 1).
            v: at level >= L + 1, any scale (its slots multiply P's slot-wise).
            pv_scale: the scale ``P(t) * v`` has after its last rescale.

        Returns:
            P(t) at (L - R, ``out_scale``), and ``P(t) * v`` at level L - R + 1 *before* its last
            relinearization and rescale (size 3, scale exactly ``pv_scale * prime(L - R + 1)``), so that
            a caller sums many of them before one relinearization (cost: 9 more products at R = 5).
        """
        ev = self.ev
        lvl = ev.level(t)
        if lvl <= self.depth or ev.level(v) <= lvl:
            raise LevelError(f"t at level {lvl}, v at {ev.level(v)}: need t above {self.depth}, v above t")
        powers = self._powers(t, keys)
        los: dict[int, Ciphertext] = {}
        n = len(self.coeffs)
        p = self._chain(powers, 0, n, lvl - self.depth, self.out_scale, keys, los)
        return p, self._chain_v(powers, v, 0, n, lvl - self.depth, pv_scale, keys, los, last=True)

    def _powers(self, t: Ciphertext, keys: EvalKeys) -> dict[int, Ciphertext]:
        """The giant steps at level L - j: t^(2^j), or T_(2^j)(t) (its -1 on the mask only, so P stays 0
        where t is)."""
        ev = self.ev
        powers = {1: t}
        for j in range(1, self.depth):
            k = 2 ** j
            sq = relin_rescale(ev, ev.square(powers[k // 2]), keys)
            if self.basis == "chebyshev":
                sq = ev.add(sq, sq)
                ev.add_plain_inplace(sq, self._const(("T", k, ev.level(sq), ev.scale_of(sq)), -self.mask, ev.level(sq),
                                                     ev.scale_of(sq)))
            powers[k] = sq
        return powers

    def _chain(self, powers, lo: int, n: int, level: int, scale: float, keys: EvalKeys,
               los: dict) -> Ciphertext:
        """:meth:`_node` on the top chain, each lo half made one level higher (kept in ``los`` for v)."""
        ev = self.ev
        if n == 2:
            return self._linear(powers[1], lo, level, scale)
        half = n // 2
        tk = ev.mod_switch(powers[half], level + 1)
        hi = self._chain(powers, lo + half, half, level + 1, scale * ev.prime(level + 1) / ev.scale_of(tk),
                         keys, los)
        prod = relin_rescale(ev, ev.mul(tk, hi), keys)
        ev.set_scale(prod, scale)
        los[lo] = self._node(powers, lo, half, level + 1, scale, keys)  # its tight level: v multiplies it there
        return ev.add(prod, ev.mod_switch(los[lo], level))

    def _chain_v(self, powers, v: Ciphertext, lo: int, n: int, level: int, scale: float, keys: EvalKeys,
                 los: dict, last: bool = False) -> Ciphertext:
        """sum_{k<n} coeffs[lo + k] t^k v at (level, scale), or (``last``) its size-3 form one level up."""
        ev = self.ev
        target = scale * ev.prime(level + 1)
        if n == 2:      # c1 (t + c0/c1) v: the scalar rides on v, t only gets a constant added
            t = powers[1]
            c0, c1 = self._leaves[lo]
            if c0:
                key = ("r", lo, level, ev.scale_of(t))
                t = ev.add_plain(t, self._const(key, self.mask * (c0 / c1), level + 1, ev.scale_of(t)))
            prod = ev.mul(t, self._scaled_v(v, c1, level + 1, target / ev.scale_of(t)))
        else:
            half = n // 2
            tk = ev.mod_switch(powers[half], level + 1)
            hi = self._chain_v(powers, v, lo + half, half, level + 1, target / ev.scale_of(tk), keys, los)
            hi_prod = ev.mul(tk, hi)
            low = los[lo]
            lo_prod = ev.mul(low, self._scaled_v(v, 1.0, level + 1, target / ev.scale_of(low)))
            ev.set_scale(hi_prod, target)                # equal up to float rounding: make it exact
            ev.set_scale(lo_prod, target)
            prod = ev.add(hi_prod, lo_prod)
        ev.set_scale(prod, target)
        if last:
            return prod
        out = relin_rescale(ev, prod, keys)
        ev.set_scale(out, scale)
        return out

    def _scaled_v(self, v: Ciphertext, c: float, level: int, scale: float) -> Ciphertext:
        """c * v at (level, scale): one constant product one level up (v has the level to spare)."""
        ev = self.ev
        v1 = ev.mod_switch(v, level + 1)
        pt_scale = scale * ev.prime(level + 1) / ev.scale_of(v1)
        out = ev.mul_plain(v1, self._const(("v", c, level, pt_scale), np.full(ev.slots, c), level + 1, pt_scale))
        ev.rescale_inplace(out)
        ev.set_scale(out, scale)
        return out

    def _node(self, powers, lo: int, n: int, level: int, scale: float, keys: EvalKeys) -> Ciphertext:
        """sum_{k<n} coeffs[lo + k] t^k at (level, scale)."""
        ev = self.ev
        if n == 2:
            return self._linear(powers[1], lo, level, scale)
        half = n // 2
        tk = ev.mod_switch(powers[half], level + 1)
        hi_scale = scale * ev.prime(level + 1) / ev.scale_of(tk)
        hi = self._node(powers, lo + half, half, level + 1, hi_scale, keys)
        prod = relin_rescale(ev, ev.mul(tk, hi), keys)
        ev.set_scale(prod, scale)                        # equal up to float rounding: make it exact
        return ev.add(prod, self._node(powers, lo, half, level, scale, keys))

    def _linear(self, t: Ciphertext, lo: int, level: int, scale: float) -> Ciphertext:
        """c0 (on the mask) + c1 t at (level, scale): the scalar rides on t one level up."""
        ev = self.ev
        t1 = ev.mod_switch(t, level + 1)
        c0, c1 = self._leaves[lo]
        pt_scale = scale * ev.prime(level + 1) / ev.scale_of(t1)
        out = ev.mul_plain(t1, self._const(("c1", lo, level, pt_scale), np.full(ev.slots, c1),
                                           level + 1, pt_scale))
        ev.rescale_inplace(out)
        ev.set_scale(out, scale)
        if c0:
            ev.add_plain_inplace(out, self._const(("c0", lo, level, scale), self.mask * c0, level, scale))
        return out

    def _const(self, key: tuple, values: np.ndarray, level: int, scale: float) -> Plaintext:
        if key not in self._pts:
            self._pts[key] = self.ev.encode(values, level, scale)
        return self._pts[key]


def _leaves(coeffs: np.ndarray, basis: str) -> dict[int, tuple[float, float]]:
    """The (c0, c1) of every linear leaf of the tree ``p = lo + G_h hi`` (G_h = t^h or T_h), by the
    leaf's position ``lo`` (its index range's start, as the evaluator's nodes name them).

    Chebyshev division: with T_h T_j = (T_(h+j) + T_(h-j)) / 2, hi = a_h + sum_j 2 a_(h+j) T_j and
    lo_k = a_k - a_(2h-k) (0 < k < h)."""
    out: dict[int, tuple[float, float]] = {}
    cheb = basis == "chebyshev"

    def split(c: np.ndarray, lo: int) -> None:
        if len(c) == 2:
            out[lo] = (float(c[0]), float(c[1]))
            return
        h = len(c) // 2
        if cheb:
            hi = np.concatenate([c[h:h + 1], 2.0 * c[h + 1:]])
            low = c[:h].copy()
            low[1:] -= c[h + 1:][::-1]
        else:
            hi, low = c[h:], c[:h]
        split(hi, lo + h)
        split(low, lo)

    split(np.polynomial.chebyshev.poly2cheb(coeffs) if cheb else coeffs, 0)
    return out


__all__ = ["PolyEvaluator", "poly_depth"]
