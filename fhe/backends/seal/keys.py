"""CKKS key holders: the client (secret key) and the server (public evaluation material only).

The client generates every key; the server receives the public key, the relinearization key and the
Galois keys of exactly the rotation steps the plan's blocks use, never the secret key. With
:class:`fhe.params.KeyLevels` (what the block states, ``EncryptedAttentionLayer.key_levels``) each key
is made at the level where it is used: ``galois_keys@L`` holds the steps of level L, ``relin_keys@L``
the relinearization key; without, one ``galois_keys``/``relin_keys`` pair at the top (tests, tools). Both sides build
the same SEAL context from :class:`fhe.params.CKKSParams`; material made under another context or key
is refused (``KeyMismatchError``) through the parameter hash and the key fingerprint the wire format
carries (:mod:`fhe.backends.seal.wire`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import ClassVar

import numpy as np

from fhe.backends.seal import hazmat as seal
from fhe.errors import KeyMismatchError, LevelError, ShapeError
from fhe.fingerprint import key_fingerprint, level_blob_name
from fhe.params import CKKSParams, KeyLevels


@dataclass
class ServerKeys:
    """Public evaluation material as the server holds it (no secret key, by construction); the SEAL
    backend's :class:`fhe.evaluator.EvalKeys`.

    ``galois_levels`` maps a key level to the Galois keys made there and ``levels`` says which step's key
    is at which level (all at the top for an upload without level-aware keys); a key switches ciphertexts
    at its level or below, through the evaluator of its chain (:meth:`fhe.backends.seal.hazmat.Kit.key_context`).
    """

    backend: ClassVar[str] = "seal"
    kit: seal.Kit
    public: seal.sa.PublicKey
    relin: seal.sa.RelinKeys
    galois_levels: Mapping[int, seal.sa.GaloisKeys]
    levels: KeyLevels
    fingerprint: str
    #: True when the keys came as a level-aware upload (``galois_keys@L`` names), even if all at the top.
    leveled: bool = False

    @property
    def params(self) -> CKKSParams:
        return self.kit.params

    @property
    def rotation_steps(self) -> tuple[int, ...]:
        return self.levels.steps

    @property
    def galois(self) -> seal.sa.GaloisKeys:
        """The one top-level GaloisKeys of a key set without levels (what readers of SEAL's full keys, such
        as the GPU backend's loader, take); LevelError for a level-aware set: use :attr:`galois_levels`."""
        if self.leveled or set(self.galois_levels) != {self.kit.top}:
            raise LevelError("level-aware keys hold one GaloisKeys per level: use galois_levels")
        return self.galois_levels[self.kit.top]

    def rotation_key(self, step: int, level: int) -> tuple[seal.sa.Evaluator, seal.sa.GaloisKeys]:
        """(evaluator of the key's chain, Galois keys) for rotating a ciphertext at ``level`` by ``step``.

        Raises:
            KeyMismatchError: no key for ``step``. LevelError: its key was made below ``level`` (the plan's
            level map and the block disagree).
        """
        key_level = self.levels.level_of(step % self.kit.slots)
        if key_level is None:
            raise KeyMismatchError(f"no Galois key for step {step}")
        if level > key_level:
            raise LevelError(f"rotation by {step} at level {level}: its key serves levels <= {key_level}")
        return self.kit.key_context(key_level).evaluator, self.galois_levels[key_level]

    def relin_key(self, level: int) -> tuple[seal.sa.Evaluator, seal.sa.RelinKeys]:
        """(evaluator of the key's chain, relinearization keys) for a ciphertext at ``level``."""
        if level > self.levels.relin:
            raise LevelError(f"relinearization at level {level}: the key serves levels <= {self.levels.relin}")
        return self.kit.key_context(self.levels.relin).evaluator, self.relin

    def check_input(self, ct: seal.Ciphertext) -> None:
        """A client input must be fresh: top level, size 2, default scale (LevelError otherwise), in NTT form
        (ShapeError: SEAL's load takes a CKKS ciphertext that is not, and its evaluator then fails mid-step)."""
        if not ct.is_ntt_form():
            raise ShapeError("input ciphertext is not in NTT form")
        if ct.size() != 2 or ct.coeff_modulus_size() != self.kit.top:
            raise LevelError(f"input ciphertext must be fresh (size 2, level {self.kit.top}), got "
                             f"size {ct.size()} level {ct.coeff_modulus_size()}")
        if abs(ct.scale / self.kit.scale - 1) > 1e-9:
            raise LevelError(f"input scale {ct.scale} != 2^{self.kit.params.scale_bits}")


@dataclass
class CKKSClient:
    """The client's key pair and encrypt/decrypt helpers (holds the secret key: never send it)."""

    params: CKKSParams
    rotation_steps: tuple[int, ...]
    #: Level-aware keys (each at the level where the plan uses it); None: every key at the top level.
    levels: KeyLevels | None = None
    kit: seal.Kit = field(init=False)
    keys: seal.SecretKeys = field(init=False, repr=False)
    public_blobs: Mapping[str, bytes] = field(init=False, repr=False)
    #: SHA-256 fingerprint of the public material (what the server and the audit log name). Computed once:
    #: it hashes every public blob (829 MB at the shipped N = 32768), and every ciphertext sent or received names it.
    fingerprint: str = field(init=False)

    def __post_init__(self) -> None:
        self.rotation_steps = tuple(sorted({int(s) % self.params.slots for s in self.rotation_steps} - {0}))
        if self.levels is not None and set(self.levels.steps) != set(self.rotation_steps):
            raise ShapeError("key levels name other rotation steps than rotation_steps")
        self.kit = seal.Kit(self.params)
        if self.levels is None:
            self.keys = seal.generate_keys(self.kit, self.rotation_steps)
        else:  # the evaluation keys exist only as blobs here: the server loads them
            self.keys = seal.generate_secret(self.kit)
            self.keys.blobs.update(_level_blobs(self.kit, self.keys.secret, self.levels))
        self._set_public(self.keys.blobs)

    def _set_public(self, blobs: Mapping[str, bytes]) -> None:
        self.public_blobs = MappingProxyType(dict(blobs))   # read-only: the fingerprint names these bytes
        self.fingerprint = key_fingerprint(self.params, self.public_blobs)

    @classmethod
    def restore(cls, params: CKKSParams, rotation_steps: Iterable[int], secret: bytes,
                public_blobs: dict[str, bytes], levels: KeyLevels | None = None) -> CKKSClient:
        """The same key set again, from stored material (the SDK's key store); nothing is regenerated.

        A restored client encrypts and decrypts; it does not load its own relin/Galois keys (only the
        server evaluates), so :meth:`server_keys` is not available on it.
        """
        self = object.__new__(cls)
        self.params = params
        self.rotation_steps = tuple(sorted({int(s) % params.slots for s in rotation_steps} - {0}))
        self.levels = levels
        self.kit = seal.Kit(params)
        self.keys = seal.SecretKeys(seal.from_bytes("secret_key", self.kit, secret),
                                    seal.from_bytes("public_key", self.kit, public_blobs["public_key"]),
                                    None, None, dict(public_blobs))
        self._set_public(public_blobs)
        return self

    def unsafe_export_secret(self) -> bytes:
        """The serialized secret key, for the SDK's encrypted key store only. Never send it anywhere."""
        return seal.to_bytes(self.keys.secret)

    def server_keys(self) -> ServerKeys:
        """The public material as a server would load it (in-process, for tests and benchmarks)."""
        if self.levels is not None:
            from fhe.backends.seal.wire import keys_from_payloads  # the server's own loader and allow-list

            return keys_from_payloads(self.public_blobs, self.kit, self.levels, fingerprint=self.fingerprint)
        return ServerKeys(self.kit, self.keys.public, self.keys.relin, {self.kit.top: self.keys.galois},
                          KeyLevels.full(self.params, self.rotation_steps), self.fingerprint)

    def _check(self, values: np.ndarray) -> np.ndarray:
        values = np.asarray(values, np.float64)
        if values.ndim != 1 or len(values) > self.kit.slots:
            raise ShapeError(f"need a vector of <= {self.kit.slots} values, got shape {values.shape}")
        if not np.all(np.isfinite(values)):
            raise ShapeError("cannot encrypt NaN/inf")
        return values

    def encrypt(self, values: np.ndarray) -> seal.Ciphertext:
        """Encrypt a real vector of at most ``slots`` values at the fresh level.

        Secret-key (symmetric) encryption: the client holds the key, and its fresh noise is ~2^10 times
        smaller than public-key encryption's, which the block's precision needs (docs/fhe.md).
        """
        return seal.encrypt_symmetric(self.kit, self.keys.secret, self._check(values))

    def encrypt_zero(self) -> seal.Ciphertext:
        """A fresh encryption of zero (secret key, top level) for :meth:`encrypt_onto`: an encryption's
        randomness and noise drawn ahead of its message (off a step's critical path). Each serves one message."""
        return seal.encrypt_zero_symmetric(self.kit, self.keys.secret)

    def encrypt_onto(self, values: np.ndarray, zero: seal.Ciphertext) -> seal.Ciphertext:
        """:meth:`encrypt` with the randomness of ``zero`` (an unused :meth:`encrypt_zero` of this key set; it
        becomes the result): SEAL's symmetric encryption is an encryption of zero with the encoded message added
        to c0, so the ciphertext is distributed exactly as :meth:`encrypt`'s. ValueError for a used ``zero``."""
        return seal.add_message(self.kit, zero, self._check(values))

    def encrypt_zero_seeded(self):
        """:meth:`encrypt_zero` in SEAL's seeded form (c0 and the seed of c1, parsed), for
        :meth:`encrypt_onto_seeded`. Each serves one message."""
        return seal.encrypt_zero_symmetric_seeded(self.kit, self.keys.secret)

    def encrypt_onto_seeded(self, values: np.ndarray, zero) -> bytes:
        """:meth:`encrypt_bytes` with the randomness of ``zero`` (an unused :meth:`encrypt_zero_seeded` of this key
        set; consumed): the same seeded bytes SEAL's seeded encryption writes for that zero. ValueError for a used
        ``zero``."""
        return seal.add_message_seeded(self.kit, zero, self._check(values))

    def encrypt_bytes(self, values: np.ndarray) -> bytes:
        """Like :meth:`encrypt`, serialized in SEAL's seeded form (half the upload)."""
        return seal.encrypt_symmetric_seeded(self.kit, self.keys.secret, self._check(values))

    def decrypt(self, ct: seal.Ciphertext) -> np.ndarray:
        """Decrypt to the [slots] real vector (one SEAL decryptor per key set, made on first use)."""
        decryptor = self.__dict__.get("_decryptor")
        if decryptor is None:
            decryptor = self.__dict__["_decryptor"] = seal.sa.Decryptor(self.kit.context, self.keys.secret)
        return seal.decrypt(self.kit, self.keys.secret, ct, decryptor)

    def decrypt_many(self, cts: Iterable[seal.Ciphertext]) -> list[np.ndarray]:
        return [self.decrypt(c) for c in cts]


def _level_blobs(kit: seal.Kit, sk: seal.sa.SecretKey, levels: KeyLevels) -> dict[str, bytes]:
    """The relin/Galois blobs of a level-aware key set, by upload name (``galois_keys@L``...)."""
    made = seal.generate_level_keys(kit, sk, {lv: levels.steps_at(lv) for lv in levels.levels()}, levels.relin)
    blobs = {}
    for level, (rk, gk) in made.items():
        if rk is not None:
            blobs[level_blob_name("relin_keys", level)] = rk
        if gk is not None:
            blobs[level_blob_name("galois_keys", level)] = gk
    return blobs
