"""The SEAL implementation of :class:`fhe.evaluator.Evaluator` (through ``tenseal.sealapi``).

A thin layer over :class:`fhe.backends.seal.hazmat.Kit` (context, encoder, SEAL evaluator, level table): every
operation is SEAL's own, with the protocol's ownership rules (out-of-place unless ``_inplace``). SEAL has
no hoisted rotations through sealapi, so :meth:`rotate_many` loops (:class:`fhe.evaluator.LoopRotations`).
Keys are :class:`fhe.backends.seal.keys.ServerKeys` (relinearization and Galois keys as SEAL objects).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from fhe.backends.seal import hazmat as seal
from fhe.backends.seal import wire
from fhe.backends.seal.hazmat import Ciphertext, Kit, Plaintext
from fhe.backends.seal.keys import ServerKeys
from fhe.errors import ShapeError
from fhe.evaluator import LoopRotations
from fhe.params import CKKSParams, KeyLevels

sa = seal.sa


class SealEvaluator(LoopRotations):
    """CKKS evaluation on SEAL for one parameter set (see :mod:`fhe.evaluator` for each contract)."""

    name = "seal"

    def __init__(self, params: CKKSParams, kit: Kit | None = None) -> None:
        self.params = params
        self.kit = kit if kit is not None else Kit(params)
        self._ev = self.kit.evaluator

    # --- parameters and queries ---------------------------------------------------------------
    @property
    def slots(self) -> int:
        return self.kit.slots

    @property
    def top(self) -> int:
        return self.kit.top

    @property
    def scale(self) -> float:
        return self.kit.scale

    def prime(self, level: int) -> float:
        return self.kit.prime(level)

    def level(self, ct: Ciphertext) -> int:
        return ct.coeff_modulus_size()

    def scale_of(self, ct: Ciphertext) -> float:
        return ct.scale

    def size(self, ct: Ciphertext) -> int:
        return ct.size()

    def nbytes(self, ct: Ciphertext) -> int:
        return ct.size() * ct.coeff_modulus_size() * ct.poly_modulus_degree() * 8

    def set_scale(self, ct: Ciphertext, scale: float) -> None:
        ct.scale = scale

    def encode(self, values: np.ndarray, level: int, scale: float) -> Plaintext:
        return self.kit.encode(values, level, scale)

    # --- arithmetic -------------------------------------------------------------------------------
    def add(self, a: Ciphertext, b: Ciphertext) -> Ciphertext:
        return self.kit.add(a, b)

    def add_inplace(self, a: Ciphertext, b: Ciphertext) -> None:
        self._ev.add_inplace(a, b)

    def add_many(self, cts: Sequence[Ciphertext]) -> Ciphertext:
        return self.kit.add_many(cts)

    def add_plain(self, ct: Ciphertext, pt: Plaintext) -> Ciphertext:
        out = sa.Ciphertext()
        self._ev.add_plain(ct, pt, out)
        return out

    def add_plain_inplace(self, ct: Ciphertext, pt: Plaintext) -> None:
        self._ev.add_plain_inplace(ct, pt)

    def mul_plain(self, ct: Ciphertext, pt: Plaintext) -> Ciphertext:
        return self.kit.mul_plain(ct, pt)

    def dot_plain(self, pairs: Sequence[tuple[Ciphertext, Plaintext]]) -> Ciphertext:
        return self.kit.dot_plain(pairs)

    def mul(self, a: Ciphertext, b: Ciphertext) -> Ciphertext:
        return self.kit.mul(a, b)

    def square(self, ct: Ciphertext) -> Ciphertext:
        out = sa.Ciphertext()
        self._ev.square(ct, out)
        return out

    def relinearize(self, ct: Ciphertext, keys: ServerKeys) -> Ciphertext:
        ev, rk = keys.relin_key(ct.coeff_modulus_size())   # the key's own chain: it may stop below the top
        out = sa.Ciphertext()
        ev.relinearize(ct, rk, out)
        return out

    def rescale(self, ct: Ciphertext) -> Ciphertext:
        out = sa.Ciphertext()
        self._ev.rescale_to_next(ct, out)
        return out

    def rescale_inplace(self, ct: Ciphertext) -> None:
        self._ev.rescale_to_next_inplace(ct)

    def mod_switch(self, ct: Ciphertext, level: int) -> Ciphertext:
        return self.kit.drop_to(ct, level)

    def rotate(self, ct: Ciphertext, step: int, keys: ServerKeys) -> Ciphertext:
        if step % self.slots == 0:
            return ct
        ev, gk = keys.rotation_key(step, ct.coeff_modulus_size())   # the key of the step's level
        out = sa.Ciphertext()
        ev.rotate_vector(ct, step % self.slots, gk, out)
        return out

    # --- serialization --------------------------------------------------------------------------------
    def serialize(self, ct: Ciphertext) -> bytes:
        return seal.to_bytes(ct)

    def deserialize(self, data: bytes) -> Ciphertext:
        ct = seal.from_bytes("ciphertext", self.kit, data)
        if ct.size() != 2:
            raise ShapeError(f"ciphertext of size {ct.size()} (expected 2)")
        return ct

    def load_keys(self, blobs: Mapping[str, bytes], rotation_steps: Iterable[int] | KeyLevels) -> ServerKeys:
        """SEAL payloads by name -> ServerKeys through the upload allow-list (:mod:`fhe.backends.seal.wire`);
        the keys share this evaluator's context (and its key-level chains). ``rotation_steps`` may be the
        plan's :class:`fhe.params.KeyLevels` (level-aware keys)."""
        return wire.keys_from_payloads(blobs, self.kit, rotation_steps)


def make_evaluator(params: CKKSParams) -> SealEvaluator:
    """The backend factory :func:`fhe.backends.evaluator_for` calls."""
    return SealEvaluator(params)


__all__ = ["SealEvaluator", "make_evaluator"]
