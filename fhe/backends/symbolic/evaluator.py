"""The symbolic evaluator (see the package docstring). No encryption, no noise: values are exact.

Each ciphertext is ``(values [S] float64, level, scale, size)``. The prime chain is SEAL's own
(:func:`seal_primes` reproduces ``CoeffModulus::Create``), so the scales the block computes from primes
are the ones it computes under SEAL, and the scale-equality checks bite where SEAL's would.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from fhe.errors import KeyMismatchError, LevelError, ShapeError, WireError
from fhe.evaluator import LoopRotations, ParamsQueries
from fhe.fingerprint import key_fingerprint
from fhe.params import CKKSParams

#: Scales are equal when they differ by less than this, relatively (SEAL's are_close is ~1 ulp; the
#: block's scales are recomputed with the same double operations, so they agree to the last bits).
SCALE_RTOL = 1e-12


def _is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin for n < 2^64."""
    if n < 2:
        return False
    for p in (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37):
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d, r = d // 2, r + 1
    for a in (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37):
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def seal_primes(params: CKKSParams) -> list[int]:
    """The coefficient-modulus primes SEAL's ``CoeffModulus::Create(N, bit_sizes)`` picks: for each bit
    size, the ``count`` largest primes ``p ≡ 1 (mod 2N)`` below ``2^bits``, handed out smallest first
    (SEAL pops them from the back of its list) in the order of ``bit_sizes``."""
    two_n = 2 * params.poly_modulus_degree
    pools: dict[int, list[int]] = {}
    for bits in set(params.coeff_mod_bit_sizes):
        need, found = params.coeff_mod_bit_sizes.count(bits), []
        value = (1 << bits) - two_n + 1
        while len(found) < need and value > (1 << (bits - 1)):
            if _is_prime(value):
                found.append(value)
            value -= two_n
        pools[bits] = found
    return [pools[bits].pop() for bits in params.coeff_mod_bit_sizes]


@dataclass
class SymbolicCiphertext:
    """A 'ciphertext' in the clear: the message, its level, scale and polynomial count."""

    values: np.ndarray
    level: int
    scale: float
    size: int = 2


@dataclass(frozen=True)
class SymbolicPlaintext:
    values: np.ndarray
    level: int
    scale: float


@dataclass(frozen=True)
class SymbolicKeys:
    """The symbolic backend's :class:`fhe.evaluator.EvalKeys` (just the steps that have a key)."""

    params: CKKSParams
    rotation_steps: tuple[int, ...]
    fingerprint: str
    backend: str = "symbolic"


@dataclass
class SymbolicEvaluator(ParamsQueries, LoopRotations):
    """:class:`fhe.evaluator.Evaluator` over plaintext values (every contract checked, see the module)."""

    params: CKKSParams
    name: str = field(default="symbolic", init=False)
    #: Counts of operations by name (what a schedule costs, for tests and estimates).
    counts: dict[str, int] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        chain = seal_primes(self.params)
        self._primes = chain[:-1]                                   # data primes, q0 first
        self._log2_q = np.cumsum([math.log2(p) for p in self._primes])   # log2 Q at level l: [l - 1]

    def _count(self, op: str) -> None:
        self.counts[op] = self.counts.get(op, 0) + 1

    # --- parameters and queries ---------------------------------------------------------------
    def prime(self, level: int) -> float:
        return float(self._primes[level - 1])

    def level(self, ct: SymbolicCiphertext) -> int:
        return ct.level

    def scale_of(self, ct: SymbolicCiphertext) -> float:
        return ct.scale

    def size(self, ct: SymbolicCiphertext) -> int:
        return ct.size

    def nbytes(self, ct: SymbolicCiphertext) -> int:
        return ct.size * ct.level * self.params.poly_modulus_degree * 8

    def set_scale(self, ct: SymbolicCiphertext, scale: float) -> None:
        ct.values = ct.values * (ct.scale / scale)     # same integers, another label
        ct.scale = scale

    # --- checks -------------------------------------------------------------------------------------
    def _fits(self, values: np.ndarray, level: int, scale: float, what: str) -> None:
        """|message| * scale must stay below Q_level / 2, or decryption wraps around."""
        if not 1 <= level <= self.top:
            raise LevelError(f"{what}: level {level} outside 1..{self.top}")
        if math.log2(scale) >= self._log2_q[level - 1]:
            raise LevelError(f"{what}: scale 2^{math.log2(scale):.1f} out of bounds at level {level}")
        if not np.all(np.isfinite(values)):
            raise LevelError(f"{what}: non-finite values")
        peak = float(np.max(np.abs(values))) if len(values) else 0.0
        if peak > 0 and math.log2(peak) + math.log2(scale) >= self._log2_q[level - 1] - 1:
            raise LevelError(f"{what}: |value| {peak:.3g} at scale 2^{math.log2(scale):.1f} overflows "
                             f"level {level} (Q = 2^{self._log2_q[level - 1]:.1f})")

    @staticmethod
    def _same_scale(a: float, b: float, what: str) -> None:
        if abs(a - b) > SCALE_RTOL * max(abs(a), abs(b)):
            raise LevelError(f"{what}: scales differ ({a!r} vs {b!r})")

    @staticmethod
    def _same_level(a: int, b: int, what: str) -> None:
        if a != b:
            raise LevelError(f"{what}: levels differ ({a} vs {b})")

    def _new(self, values: np.ndarray, level: int, scale: float, size: int, what: str) -> SymbolicCiphertext:
        self._count(what)
        self._fits(values, level, scale, what)
        return SymbolicCiphertext(values, level, scale, size)

    # --- encoding -----------------------------------------------------------------------------------
    def encode(self, values: np.ndarray, level: int, scale: float) -> SymbolicPlaintext:
        values = np.asarray(values, np.float64)
        if values.ndim != 1 or len(values) > self.slots:
            raise ShapeError(f"need <= {self.slots} values, got shape {values.shape}")
        v = np.zeros(self.slots)
        v[: len(values)] = values
        self._fits(v, level, scale, "encode")
        return SymbolicPlaintext(v, level, scale)

    # --- arithmetic -------------------------------------------------------------------------------
    def add(self, a: SymbolicCiphertext, b: SymbolicCiphertext) -> SymbolicCiphertext:
        self._same_level(a.level, b.level, "add")
        self._same_scale(a.scale, b.scale, "add")
        return self._new(a.values + b.values, a.level, a.scale, max(a.size, b.size), "add")

    def add_inplace(self, a: SymbolicCiphertext, b: SymbolicCiphertext) -> None:
        out = self.add(a, b)
        a.values, a.size = out.values, out.size

    def add_many(self, cts: Sequence[SymbolicCiphertext]) -> SymbolicCiphertext:
        if not cts:
            raise ShapeError("add_many of nothing")
        out = cts[0]
        for c in cts[1:]:
            out = self.add(out, c)
        return out if len(cts) > 1 else SymbolicCiphertext(out.values.copy(), out.level, out.scale, out.size)

    def add_plain(self, ct: SymbolicCiphertext, pt: SymbolicPlaintext) -> SymbolicCiphertext:
        self._same_level(ct.level, pt.level, "add_plain")
        self._same_scale(ct.scale, pt.scale, "add_plain")
        return self._new(ct.values + pt.values, ct.level, ct.scale, ct.size, "add_plain")

    def add_plain_inplace(self, ct: SymbolicCiphertext, pt: SymbolicPlaintext) -> None:
        ct.values = self.add_plain(ct, pt).values

    def mul_plain(self, ct: SymbolicCiphertext, pt: SymbolicPlaintext) -> SymbolicCiphertext:
        self._same_level(ct.level, pt.level, "mul_plain")
        if not np.any(pt.values):
            raise LevelError("mul_plain: an all-zero plaintext gives a transparent ciphertext (SEAL refuses)")
        return self._new(ct.values * pt.values, ct.level, ct.scale * pt.scale, ct.size, "mul_plain")

    def dot_plain(self, pairs: Sequence[tuple[SymbolicCiphertext, SymbolicPlaintext]]) -> SymbolicCiphertext:
        return self.add_many([self.mul_plain(c, p) for c, p in pairs])

    def mul(self, a: SymbolicCiphertext, b: SymbolicCiphertext) -> SymbolicCiphertext:
        self._same_level(a.level, b.level, "mul")
        if a.size != 2 or b.size != 2:
            raise LevelError(f"mul: operands of size {a.size}, {b.size} (relinearize first)")
        return self._new(a.values * b.values, a.level, a.scale * b.scale, 3, "mul")

    def square(self, ct: SymbolicCiphertext) -> SymbolicCiphertext:
        return self.mul(ct, ct)

    def relinearize(self, ct: SymbolicCiphertext, keys: SymbolicKeys) -> SymbolicCiphertext:
        self._check_keys(keys)
        if ct.size != 3:
            raise LevelError(f"relinearize: size {ct.size} (expected 3)")
        return self._new(ct.values.copy(), ct.level, ct.scale, 2, "relinearize")

    def rescale(self, ct: SymbolicCiphertext) -> SymbolicCiphertext:
        if ct.level < 2:
            raise LevelError("rescale: no prime left to drop")
        return self._new(ct.values.copy(), ct.level - 1, ct.scale / self.prime(ct.level), ct.size, "rescale")

    def rescale_inplace(self, ct: SymbolicCiphertext) -> None:
        out = self.rescale(ct)
        ct.level, ct.scale = out.level, out.scale

    def mod_switch(self, ct: SymbolicCiphertext, level: int) -> SymbolicCiphertext:
        if level > ct.level:
            raise LevelError(f"ciphertext at level {ct.level} cannot go up to {level}")
        if level == ct.level:
            return ct
        return self._new(ct.values.copy(), level, ct.scale, ct.size, "mod_switch")

    def rotate(self, ct: SymbolicCiphertext, step: int, keys: SymbolicKeys) -> SymbolicCiphertext:
        step %= self.slots
        if step == 0:
            return ct
        self._check_keys(keys)
        if ct.size != 2:
            raise LevelError(f"rotate: size {ct.size} (relinearize first)")
        if step not in keys.rotation_steps:
            raise KeyMismatchError(f"no Galois key for step {step}")
        return self._new(np.roll(ct.values, -step), ct.level, ct.scale, 2, "rotate")

    def _check_keys(self, keys: SymbolicKeys) -> None:
        if keys.backend != self.name or keys.params != self.params:
            raise KeyMismatchError("keys of another backend or parameter set")

    # --- serialization --------------------------------------------------------------------------------
    _HEAD = struct.Struct("<4sIdI")

    def serialize(self, ct: SymbolicCiphertext) -> bytes:
        return self._HEAD.pack(b"SYMC", ct.level, ct.scale, ct.size) + ct.values.astype("<f8").tobytes()

    def deserialize(self, data: bytes) -> SymbolicCiphertext:
        if len(data) != self._HEAD.size + 8 * self.slots:
            raise WireError(f"symbolic ciphertext of {len(data)} bytes")
        magic, level, scale, size = self._HEAD.unpack_from(data)
        if magic != b"SYMC" or size != 2 or not 1 <= level <= self.top:
            raise WireError("not a symbolic ciphertext for these parameters")
        values = np.frombuffer(data, "<f8", offset=self._HEAD.size).copy()
        self._fits(values, level, scale, "deserialize")
        return SymbolicCiphertext(values, level, scale, size)

    def load_keys(self, blobs: Mapping[str, bytes], rotation_steps: Iterable[int]) -> SymbolicKeys:
        steps = tuple(sorted({int(s) % self.slots for s in rotation_steps} - {0}))
        return SymbolicKeys(self.params, steps, key_fingerprint(self.params, blobs))


@dataclass
class SymbolicClient:
    """The symbolic backend's :class:`fhe.evaluator.KeyHolder`: 'encrypts' by labelling values fresh."""

    params: CKKSParams
    rotation_steps: tuple[int, ...]
    fingerprint: str = field(init=False)

    def __post_init__(self) -> None:
        self.rotation_steps = tuple(sorted({int(s) % self.params.slots for s in self.rotation_steps} - {0}))
        self.fingerprint = hashlib.sha256(repr((self.params, self.rotation_steps)).encode()).hexdigest()

    def encrypt(self, values: np.ndarray) -> SymbolicCiphertext:
        values = np.asarray(values, np.float64)
        if values.ndim != 1 or len(values) > self.params.slots:
            raise ShapeError(f"need a vector of <= {self.params.slots} values, got shape {values.shape}")
        v = np.zeros(self.params.slots)
        v[: len(values)] = values
        return SymbolicCiphertext(v, self.params.depth + 1, 2.0 ** self.params.scale_bits)

    def decrypt(self, ct: SymbolicCiphertext) -> np.ndarray:
        return ct.values.copy()

    def server_keys(self) -> SymbolicKeys:
        return SymbolicKeys(self.params, self.rotation_steps, self.fingerprint)


def make_evaluator(params: CKKSParams) -> SymbolicEvaluator:
    """The backend factory :func:`fhe.backends.evaluator_for` calls."""
    return SymbolicEvaluator(params)
