"""The backend interface for encrypted tensors, and its CKKS implementation.

A backend splits into a *client* half (key generation, encrypt, decrypt: holds the secret key) and a
*server* half (evaluation with public material only). ``CKKSBackend`` (TenSEAL's SEAL through
``tenseal.sealapi``) is the serving backend; ``fhe.concrete_glwe`` (Concrete's GLWE matmul) is only a
benchmark peer and implements the same encrypt/multiply/decrypt shape for one linear layer.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol

import numpy as np

from fhe import wire
from fhe.ckks import CKKSClient, ServerKeys
from fhe.hazmat.seal import Ciphertext
from fhe.linalg import PlainMatrix
from fhe.params import CKKSParams


class ClientBackend(Protocol):
    """Client half: owns the secret key."""

    def encrypt(self, values: np.ndarray) -> Ciphertext: ...

    def decrypt(self, ct: Ciphertext) -> np.ndarray: ...

    def public_upload(self) -> dict[str, bytes]: ...


class ServerBackend(Protocol):
    """Server half: public evaluation material only."""

    def matmul(self, weight: np.ndarray) -> PlainMatrix: ...


class CKKSBackend:
    """CKKS on SEAL: ``client()`` for the key holder, ``server()`` for the evaluator."""

    name = "ckks"

    def __init__(self, params: CKKSParams) -> None:
        self.params = params

    def client(self, rotation_steps: Iterable[int]) -> CKKSClient:
        """A fresh key set with Galois keys for exactly ``rotation_steps``."""
        return CKKSClient(self.params, tuple(rotation_steps))

    def server(self, upload: Mapping[str, bytes], rotation_steps: Iterable[int]) -> ServerKeys:
        """Parse an untrusted key upload (fhe.wire checks; secret keys refused)."""
        return wire.load_server_keys(upload, self.params, rotation_steps)

    @staticmethod
    def public_upload(client: CKKSClient) -> dict[str, bytes]:
        return wire.dump_public_keys(client)
