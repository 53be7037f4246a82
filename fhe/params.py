"""CKKS parameter sets, chosen by the multiplicative depth of the encrypted attention block.

Security follows the HomomorphicEncryption.org security standard (Albrecht et al., 2018, table for
classical 128-bit security, ternary/uniform secret): for ring degree N the total coefficient-modulus
size log2(Q) (special prime included) must not exceed ``HE_STANDARD_128[N]``. SEAL enforces the same
table (``CoeffModulus.MaxBitCount(N, tc128)``), and :class:`CKKSParams` checks it again on construction.

Depth of the block (see ``docs/fhe.md``): projection (1) + RoPE/repack (1) + q.k (1) + the
approximation's levels (sqexp: R squarings, polyexp: R for its degree 2^R - 1 polynomial, 2quad: 1)
+ weighted sum with V (1) + output projection (1). polyexp can fold the weighted sum with V into its
polynomial (``fhe.poly.PolyEvaluator.with_values``): one level less, :func:`min_block_depth`.
"""

from __future__ import annotations

from dataclasses import dataclass

from fhe.errors import ParameterError

#: HomomorphicEncryption.org standard, 128-bit classical security: N -> max log2(Q).
HE_STANDARD_128: dict[int, int] = {1024: 27, 2048: 54, 4096: 109, 8192: 218, 16384: 438, 32768: 881}
#: Encrypted block layouts use 64 bands of head dims; 8192 slots is the smallest that fits SmolLM2.
MIN_RING = 16384
#: First prime = scale + this: at the last level the block's outputs must stay below 2^(this - 1).
#: (Not more: SEAL's key-switching noise grows as first prime / special prime, see docs/fhe.md.)
FIRST_PRIME_HEADROOM_BITS = 18
SPECIAL_PRIME_BITS = 60
#: Scales tried, largest first. Measured on SmolLM2 layer 3, 24 real tokens, max error of the block
#: vs the simulator: 2^30 (N = 16384) 1.5e-2, 2^40 9.3e-4, 2^50 3.0e-5 (N = 32768); see docs/fhe.md.
MIN_SCALE_BITS, MAX_SCALE_BITS = 36, 50
#: Levels spent outside the softmax replacement: projection, repack/RoPE, q.k, x V, x Wo.
BASE_DEPTH = 5


@dataclass(frozen=True)
class CKKSParams:
    """One CKKS parameter set.

    Attributes:
        poly_modulus_degree: ring degree N (slots = N/2).
        coeff_mod_bit_sizes: prime sizes, first (last-level) prime first, special prime last.
        scale_bits: log2 of the encoding scale; the middle primes are this size.
    """

    poly_modulus_degree: int
    coeff_mod_bit_sizes: tuple[int, ...]
    scale_bits: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "coeff_mod_bit_sizes", tuple(int(b) for b in self.coeff_mod_bit_sizes))
        n = self.poly_modulus_degree
        if n not in HE_STANDARD_128:
            raise ParameterError(f"poly_modulus_degree {n} not in the 128-bit table "
                                 f"{sorted(HE_STANDARD_128)}")
        if len(self.coeff_mod_bit_sizes) < 3:
            raise ParameterError("need at least 3 primes (first, one level, special)")
        if not all(20 <= b <= 60 for b in self.coeff_mod_bit_sizes):
            raise ParameterError("every prime must have 20..60 bits")
        if self.total_bits > HE_STANDARD_128[n]:
            raise ParameterError(f"log2(Q) = {self.total_bits} > {HE_STANDARD_128[n]}: "
                                 f"not 128-bit secure for N = {n}")
        if not 20 <= self.scale_bits < self.coeff_mod_bit_sizes[0]:
            raise ParameterError("scale_bits must be below the first prime's size")

    @property
    def total_bits(self) -> int:
        """log2(Q) including the special prime (what the security table bounds)."""
        return sum(self.coeff_mod_bit_sizes)

    @property
    def slots(self) -> int:
        """Complex slots per ciphertext (N/2)."""
        return self.poly_modulus_degree // 2

    @property
    def depth(self) -> int:
        """Rescales available to a fresh ciphertext (primes minus first and special)."""
        return len(self.coeff_mod_bit_sizes) - 2

    def to_dict(self) -> dict:
        """JSON-ready form (plan metadata, key manifests)."""
        return {"poly_modulus_degree": self.poly_modulus_degree,
                "coeff_mod_bit_sizes": list(self.coeff_mod_bit_sizes), "scale_bits": self.scale_bits}

    @classmethod
    def from_dict(cls, d: dict) -> CKKSParams:
        """Inverse of :meth:`to_dict`; raises :class:`ParameterError` on a bad dict."""
        try:
            return cls(int(d["poly_modulus_degree"]), tuple(d["coeff_mod_bit_sizes"]), int(d["scale_bits"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ParameterError(f"bad CKKS parameter dict: {exc}") from exc


def block_depth(kind: str, squarings: int) -> int:
    """Multiplicative depth of the encrypted attention block for one approximation kind."""
    return BASE_DEPTH + score_depth(kind, squarings)


def min_block_depth(kind: str, squarings: int) -> int:
    """The least depth the block runs at: polyexp folds ``p * V`` into P (degree 2^R - 1 times v is degree
    2^R, still depth R), so it needs one level less than :func:`block_depth`; the others need that."""
    return block_depth(kind, squarings) - (1 if kind == "polyexp" else 0)


def score_depth(kind: str, squarings: int) -> int:
    """Levels the approximation spends after q.k: R squarings (sqexp), a degree 2^R - 1 polynomial
    at depth R (polyexp, ``fhe.poly``), one squaring (2quad)."""
    if kind in ("sqexp", "polyexp"):
        return squarings
    if kind == "2quad":
        return 1
    raise ParameterError(f"approximation {kind!r} cannot run under CKKS (only sqexp, polyexp and 2quad)")


def ckks_params_for(kind: str, squarings: int = 6, *, fold_v: bool = False) -> CKKSParams:
    """The smallest 128-bit-secure parameter set for the block with this approximation.

    ``fold_v`` (polyexp only): for the block that folds ``p * V`` into the polynomial
    (:func:`min_block_depth`: polyexp R = 5 at depth 9 fits N = 16384 with 36-bit primes).

    Picks the smallest ring (>= :data:`MIN_RING`) where the depth fits with a scale of at least
    :data:`MIN_SCALE_BITS`, then the largest scale (<= :data:`MAX_SCALE_BITS`) that fits with a first
    prime of ``scale + FIRST_PRIME_HEADROOM_BITS`` bits and a 60-bit special prime.
    """
    depth = min_block_depth(kind, squarings) if fold_v else block_depth(kind, squarings)
    for n in sorted(k for k in HE_STANDARD_128 if k >= MIN_RING):
        for scale in range(MAX_SCALE_BITS, MIN_SCALE_BITS - 1, -1):
            first = min(60, scale + FIRST_PRIME_HEADROOM_BITS)
            bits = (first,) + (scale,) * depth + (SPECIAL_PRIME_BITS,)
            if sum(bits) <= HE_STANDARD_128[n]:
                return CKKSParams(n, bits, scale)
    raise ParameterError(f"depth {depth} does not fit any 128-bit ring with scale >= 2^{MIN_SCALE_BITS}")


@dataclass(frozen=True)
class KeyLevels:
    """At which level each evaluation key is made: one Galois key per rotation step, one relinearization
    key.

    A key made in a context whose prime chain stops at level L (data primes q_0..q_{L-1} plus the special
    prime) switches any ciphertext at a level <= L, and is smaller and as fast as the full key there
    (its RNS rows for q_L.. are never read). A step used at several levels gets the highest of them.
    Levels count data primes, as everywhere (fresh = ``depth + 1``).

    Attributes:
        galois: (step, level) pairs, steps mod S without 0, sorted by step.
        relin: level of the relinearization key.
    """

    galois: tuple[tuple[int, int], ...]
    relin: int

    @classmethod
    def build(cls, params: CKKSParams, galois: dict[int, int], relin: int) -> KeyLevels:
        """Normalize steps mod S (a step given twice keeps its highest level) and check every level."""
        top = params.depth + 1
        merged: dict[int, int] = {}
        for step, level in galois.items():
            s = int(step) % params.slots
            if s:
                merged[s] = max(merged.get(s, 0), int(level))
        levels = KeyLevels(tuple(sorted(merged.items())), int(relin))
        bad = [lv for lv in [*merged.values(), levels.relin] if not 1 <= lv <= top]
        if bad:
            raise ParameterError(f"key levels {sorted(set(bad))} outside 1..{top}")
        return levels

    @classmethod
    def full(cls, params: CKKSParams, steps) -> KeyLevels:
        """Every key at the top level (what a key set without level-aware keys amounts to)."""
        top = params.depth + 1
        return cls.build(params, {int(s): top for s in steps}, top)

    @property
    def steps(self) -> tuple[int, ...]:
        return tuple(s for s, _ in self.galois)

    def level_of(self, step: int) -> int | None:
        """The level of ``step``'s key (step already mod S), or None if the set has no such key."""
        return dict(self.galois).get(step)

    def levels(self) -> tuple[int, ...]:
        """Distinct Galois-key levels, highest first."""
        return tuple(sorted({lv for _, lv in self.galois}, reverse=True))

    def steps_at(self, level: int) -> tuple[int, ...]:
        return tuple(s for s, lv in self.galois if lv == level)

    def merge(self, other: KeyLevels) -> KeyLevels:
        """The levels serving both (per step and for the relinearization key: the higher)."""
        galois = dict(self.galois)
        for s, lv in other.galois:
            galois[s] = max(galois.get(s, 0), lv)
        return KeyLevels(tuple(sorted(galois.items())), max(self.relin, other.relin))
