"""The SEAL implementation of :class:`fhe.evaluator.Evaluator` (through ``tenseal.sealapi``).

A thin layer over :class:`fhe.hazmat.seal.Kit` (context, encoder, SEAL evaluator, level table): every
operation is SEAL's own, with the protocol's ownership rules (out-of-place unless ``_inplace``). SEAL has
no hoisted rotations through sealapi, so :meth:`rotate_many` loops (:class:`fhe.evaluator.LoopRotations`).
Keys are :class:`fhe.ckks.ServerKeys` (relinearization and Galois keys as SEAL objects).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from fhe.ckks import ServerKeys
from fhe.errors import KeyMismatchError, ShapeError, WireError
from fhe.evaluator import LoopRotations
from fhe.fingerprint import key_fingerprint
from fhe.hazmat import seal
from fhe.hazmat.seal import Ciphertext, Kit, Plaintext
from fhe.params import CKKSParams

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
        out = sa.Ciphertext()
        self._ev.relinearize(ct, keys.relin, out)
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
        return self.kit.rotate(ct, step, keys.galois)

    # --- serialization --------------------------------------------------------------------------------
    def serialize(self, ct: Ciphertext) -> bytes:
        return seal.to_bytes(ct)

    def deserialize(self, data: bytes) -> Ciphertext:
        ct = seal.from_bytes("ciphertext", self.kit, data)
        if ct.size() != 2:
            raise ShapeError(f"ciphertext of size {ct.size()} (expected 2)")
        return ct

    def load_keys(self, blobs: Mapping[str, bytes], rotation_steps: Iterable[int]) -> ServerKeys:
        missing = {"public_key", "relin_keys", "galois_keys"} - set(blobs)
        if missing:
            raise WireError(f"key upload lacks {sorted(missing)}")
        objs = {name: seal.from_bytes(name, self.kit, blobs[name])
                for name in ("public_key", "relin_keys", "galois_keys")}
        steps = tuple(sorted({int(s) % self.slots for s in rotation_steps} - {0}))
        for elt in seal.galois_elements(steps, self.slots):
            if not objs["galois_keys"].has_key(elt):
                raise KeyMismatchError(f"Galois key for element {elt} missing")
        return ServerKeys(self.kit, objs["public_key"], objs["relin_keys"], objs["galois_keys"], steps,
                          key_fingerprint(self.params, blobs))


def make_evaluator(params: CKKSParams) -> SealEvaluator:
    """The backend factory :func:`fhe.backends.evaluator_for` calls."""
    return SealEvaluator(params)


__all__ = ["SealEvaluator", "make_evaluator"]
