"""The CKKS evaluator protocol: the seam between the encrypted programs and a CKKS library.

Everything above this seam (``fhe.linalg``, ``fhe.packing``, the attention block and its KV cache, the
client half) calls only the operations below and never names a library. Implementations live in
``fhe/backends/<name>/`` (``seal``: Microsoft SEAL through ``tenseal.sealapi``, the CPU backend and the
client; ``symbolic``: a checker that tracks levels and scales with plaintext values inside, no
encryption; ``gpu``: our own evaluator, issue 16) and are picked by name with
:func:`fhe.backends.evaluator_for`.

Conventions every implementation keeps (they are SEAL's, so that ciphertexts and keys the SEAL client
produces can be evaluated by any backend):

* **Slots.** S = N/2 real slots per ciphertext (the imaginary parts are unused and stay ~0).
* **Level** = the number of data primes a ciphertext or plaintext still has: a fresh ciphertext is at
  ``top = params.depth + 1``, the last usable level is 1. Operations on two operands need them at the
  same level (same prime chain); :meth:`Evaluator.mod_switch` drops primes without dividing.
* **Scale.** A ciphertext carries the real number ``scale`` by which its slot values were multiplied
  before rounding: ``message = decoded / scale``. Products multiply scales; :meth:`Evaluator.rescale`
  divides the scale by the dropped prime ``prime(level)`` (``q_{level-1}``, the chain's last data prime).
  Additions need equal scales (SEAL's ``are_close``: equal up to double rounding, so compute scales
  with the same double operations on both sides). :meth:`Evaluator.set_scale` only relabels (the stored
  integers do not change, so the message is multiplied by old/new): the block uses it to absorb
  ``prime / scale`` ratios of ~1 ± 2^-20.
* **Form.** Ciphertexts and plaintexts are kept in NTT (evaluation) form, as SEAL's CKKS does; an
  implementation may store them otherwise internally but serializes SEAL's layout.
* **Size.** A fresh or relinearized ciphertext has 2 polynomials; :meth:`Evaluator.mul` and
  :meth:`Evaluator.square` return 3; rotations and rescales are defined on size 2 only (relinearize first;
  rescale of size 3 is allowed, as in SEAL).
* **Ownership.** Methods without ``_inplace`` return a new ciphertext and leave their inputs untouched
  (except :meth:`Evaluator.rotate` by 0 and :meth:`Evaluator.mod_switch` to the same level, which may
  return the input itself: never modify a result in place unless you made it). ``_inplace`` methods
  modify their first argument and return None.
* **Keys.** Evaluation keys (relinearization + Galois keys of a fixed set of rotation steps, never a
  secret key) are an opaque :class:`EvalKeys` object made by the same backend
  (:meth:`Evaluator.load_keys`); key-switching operations take it as an argument, so one evaluator (one
  parameter set, pre-encoded weights) serves every session.
* **Rotation.** ``rotate(ct, k)`` is a cyclic *left* rotation: ``out[s] = in[(s + k) mod S]``; Galois
  element ``3^k mod 2N``. Negative steps are taken mod S.
* **Errors.** Operands at the wrong level/size/scale raise :class:`fhe.errors.LevelError`; bytes that
  do not deserialize raise :class:`fhe.errors.WireError`; a missing Galois key raises
  :class:`fhe.errors.KeyMismatchError`. Library exceptions are translated inside the backend.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from fhe.errors import BackendMismatchError, LevelError
from fhe.params import CKKSParams

#: An opaque ciphertext handle of one backend (never inspect it above the seam: ask the evaluator).
Ciphertext = Any
#: An opaque encoded plaintext of one backend (made by :meth:`Evaluator.encode`).
Plaintext = Any


@runtime_checkable
class EvalKeys(Protocol):
    """Public evaluation material of one client key set, loaded by one backend."""

    #: The backend that loaded these keys (``Evaluator.name``).
    backend: str
    #: The parameter set the keys were made for.
    params: CKKSParams
    #: Left-rotation steps (mod S, without 0) that have a Galois key.
    rotation_steps: tuple[int, ...]
    #: SHA-256 of the exact public-key bytes (:func:`fhe.fingerprint.key_fingerprint`).
    fingerprint: str


@runtime_checkable
class Evaluator(Protocol):
    """Server-side CKKS evaluation for one parameter set (no secret key; keys are passed per call)."""

    #: Backend name, e.g. ``"seal"``; written into manifests and envelopes.
    name: str
    params: CKKSParams

    # --- parameters -------------------------------------------------------------------------------
    @property
    def slots(self) -> int:
        """S = N/2."""

    @property
    def top(self) -> int:
        """Level of a fresh ciphertext (``params.depth + 1``)."""

    @property
    def scale(self) -> float:
        """The default scale ``2^params.scale_bits`` (fresh ciphertexts carry it)."""

    def prime(self, level: int) -> float:
        """The prime a rescale at ``level`` drops (``q_{level-1}``), as a float (scale arithmetic)."""

    # --- queries ----------------------------------------------------------------------------------
    def level(self, ct: Ciphertext) -> int:
        """Data primes left in ``ct``."""

    def scale_of(self, ct: Ciphertext) -> float:
        """The scale ``ct`` carries."""

    def size(self, ct: Ciphertext) -> int:
        """Polynomials in ``ct`` (2, or 3 after a product before relinearization)."""

    def nbytes(self, ct: Ciphertext) -> int:
        """In-memory bytes of ``ct`` (cache accounting; not the serialized size)."""

    def set_scale(self, ct: Ciphertext, scale: float) -> None:
        """Relabel ``ct``'s scale in place (the message becomes message * old / new)."""

    # --- encoding -----------------------------------------------------------------------------------
    def encode(self, values: np.ndarray, level: int, scale: float) -> Plaintext:
        """Real vector (<= S values, zero-padded) -> plaintext at ``level`` and ``scale``, NTT form.

        ``round(values * scale)`` must fit the level's modulus; a product with a ciphertext that is
        rescaled right after is encoded at ``scale = prime(level)`` so the ciphertext's scale comes back.
        """

    # --- arithmetic (levels must match; results at the operands' level) ------------------------------
    def add(self, a: Ciphertext, b: Ciphertext) -> Ciphertext:
        """a + b (same level, equal scales, any sizes); new ciphertext."""

    def add_inplace(self, a: Ciphertext, b: Ciphertext) -> None:
        """a += b."""

    def add_many(self, cts: Sequence[Ciphertext]) -> Ciphertext:
        """Sum of one or more ciphertexts (same level and scale); new ciphertext."""

    def add_plain(self, ct: Ciphertext, pt: Plaintext) -> Ciphertext:
        """ct + pt (pt encoded at ct's level and scale); new ciphertext."""

    def add_plain_inplace(self, ct: Ciphertext, pt: Plaintext) -> None:
        """ct += pt."""

    def mul_plain(self, ct: Ciphertext, pt: Plaintext) -> Ciphertext:
        """ct * pt slot-wise (same level); scale = ct.scale * pt.scale; new ciphertext, same size.

        An all-zero plaintext is refused by SEAL (transparent result): callers skip zero diagonals.
        """

    def dot_plain(self, pairs: Sequence[tuple[Ciphertext, Plaintext]]) -> Ciphertext:
        """sum_i ct_i * pt_i (equal product scales), accumulated without a ciphertext per term."""

    def mul(self, a: Ciphertext, b: Ciphertext) -> Ciphertext:
        """a * b slot-wise (same level, size 2 each) -> size 3, scale a.scale * b.scale."""

    def square(self, ct: Ciphertext) -> Ciphertext:
        """ct * ct -> size 3 (cheaper than :meth:`mul`)."""

    def relinearize(self, ct: Ciphertext, keys: EvalKeys) -> Ciphertext:
        """Size 3 -> size 2 with the relinearization key (level and scale unchanged)."""

    def rescale(self, ct: Ciphertext) -> Ciphertext:
        """Divide by ``prime(level(ct))``: level - 1, scale / that prime; new ciphertext."""

    def rescale_inplace(self, ct: Ciphertext) -> None:
        """In-place :meth:`rescale`."""

    def mod_switch(self, ct: Ciphertext, level: int) -> Ciphertext:
        """Drop primes down to ``level`` without dividing (message and scale unchanged).

        Returns ``ct`` itself when it is already there; LevelError if ``level`` is above ct's.
        """

    # --- key switching ------------------------------------------------------------------------------
    def rotate(self, ct: Ciphertext, step: int, keys: EvalKeys) -> Ciphertext:
        """Left rotation by ``step`` slots (size 2; Galois key of ``step mod S`` needed).

        Step 0 (mod S) returns ``ct`` itself.
        """

    def rotate_many(self, ct: Ciphertext, steps: Iterable[int], keys: EvalKeys) -> dict[int, Ciphertext]:
        """``{step: rotate(ct, step)}`` for several steps of the same input.

        A backend with hoisting decomposes ``ct`` once and key-switches each step from the shared
        decomposition; :class:`LoopRotations` gives the plain loop for one without it.
        """

    # --- serialization ---------------------------------------------------------------------------------
    def serialize(self, ct: Ciphertext) -> bytes:
        """SEAL's serialized form of ``ct`` (compressed), whatever the backend's internal layout."""

    def deserialize(self, data: bytes) -> Ciphertext:
        """Parse an untrusted serialized ciphertext for this parameter set (WireError if it does not)."""

    def load_keys(self, blobs: Mapping[str, bytes], rotation_steps: Iterable[int]) -> EvalKeys:
        """Parse untrusted public key blobs (``public_key``, ``relin_keys``, ``galois_keys``: SEAL's
        serialized form, without the wire envelope) into this backend's :class:`EvalKeys`;
        KeyMismatchError if a Galois key of ``rotation_steps`` is missing."""


@runtime_checkable
class KeyHolder(Protocol):
    """The client half of a backend: holds the secret key, encrypts inputs and decrypts results."""

    params: CKKSParams
    fingerprint: str

    def encrypt(self, values: np.ndarray) -> Ciphertext:
        """A real vector of <= S values -> a fresh ciphertext (top level, default scale, size 2)."""

    def decrypt(self, ct: Ciphertext) -> np.ndarray:
        """A ciphertext -> its [S] real slot values (divided by its scale)."""


class ParamsQueries:
    """Mixin: :attr:`Evaluator.slots`, :attr:`Evaluator.top` and :attr:`Evaluator.scale` from ``self.params``."""

    params: CKKSParams

    @property
    def slots(self) -> int:
        return self.params.slots

    @property
    def top(self) -> int:
        return self.params.depth + 1

    @property
    def scale(self) -> float:
        return 2.0 ** self.params.scale_bits


class LoopRotations:
    """Mixin: :meth:`Evaluator.rotate_many` as a loop over :meth:`Evaluator.rotate` (no hoisting)."""

    def rotate_many(self, ct: Ciphertext, steps: Iterable[int], keys: EvalKeys) -> dict[int, Ciphertext]:
        return {int(s): self.rotate(ct, int(s), keys) for s in steps}  # type: ignore[attr-defined]


def relin_rescale(ev: Evaluator, ct: Ciphertext, keys: EvalKeys) -> Ciphertext:
    """Relinearize (if size 3) and rescale: the end of every ciphertext product."""
    if ev.size(ct) > 2:
        ct = ev.relinearize(ct, keys)
        ev.rescale_inplace(ct)
        return ct
    return ev.rescale(ct)


def add_plain_values(ev: Evaluator, ct: Ciphertext, values: np.ndarray) -> Ciphertext:
    """ct + values, encoded at ct's own level and scale."""
    return ev.add_plain(ct, ev.encode(values, ev.level(ct), ev.scale_of(ct)))


def encode_many(ev: Evaluator, values: Sequence[np.ndarray], level: int, scale: float) -> list:
    """``ev.encode`` of each vector at one level and scale; in one batch where the backend has one (the
    gpu backend's ``encode_many``: same plaintexts, one launch sequence), else one by one."""
    batched = getattr(ev, "encode_many", None)
    if batched is not None:
        return batched(values, level, scale)
    return [ev.encode(v, level, scale) for v in values]


#: rows of one batched encode (:func:`encode_groups`): [rows, 2N] complex128 on the device, 256 kB a row at N = 8192
ENCODE_BATCH = 512


def encode_groups(ev: Evaluator, groups: dict, level: int, scale: float) -> dict:
    """A plan's diagonals, ``{key: [(*tag, values), ...]}``, encoded -> ``{key: [(*tag, plaintext), ...]}``
    (same keys, tags and order). Where the backend encodes in batches (the gpu backend's on-device encoder)
    every group's vectors go through :func:`encode_many` together, :data:`ENCODE_BATCH` at a time: a
    28-layer offload plan's ~235k diagonals took ~8 min of worker start one by one through SEAL's encoder
    (issue 17); elsewhere ``ev.encode`` one by one, as before (SEAL: bit for bit the same plaintexts)."""
    flat = [(key, i, item) for key, grp in groups.items() for i, item in enumerate(grp)]
    encoded: list = []
    for lo in range(0, len(flat), ENCODE_BATCH):
        encoded += encode_many(ev, [item[-1] for _, _, item in flat[lo:lo + ENCODE_BATCH]], level, scale)
    out: dict = {key: [None] * len(grp) for key, grp in groups.items()}
    for (key, i, item), pt in zip(flat, encoded, strict=True):
        out[key][i] = (*item[:-1], pt)
    return out


def check_fresh(ev: Evaluator, keys: EvalKeys, ct: Ciphertext) -> None:
    """A client input must be fresh: size 2, top level, default scale (LevelError otherwise), and the
    keys must be this evaluator's (backend and parameters)."""
    if keys.backend != ev.name or keys.params != ev.params:
        raise BackendMismatchError(f"keys loaded by {keys.backend!r} for other parameters than this "
                                   f"{ev.name!r} evaluator's")
    if ev.size(ct) != 2 or ev.level(ct) != ev.top:
        raise LevelError(f"input ciphertext must be fresh (size 2, level {ev.top}), got "
                         f"size {ev.size(ct)} level {ev.level(ct)}")
    if abs(ev.scale_of(ct) / ev.scale - 1) > 1e-9:
        raise LevelError(f"input scale {ev.scale_of(ct)} != 2^{ev.params.scale_bits}")


__all__ = ["Ciphertext", "EvalKeys", "Evaluator", "KeyHolder", "LoopRotations", "Plaintext",
           "add_plain_values", "check_fresh", "encode_groups", "relin_rescale"]
