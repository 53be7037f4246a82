"""SHA-256 fingerprints of public key material and of CKKS parameter sets.

A key fingerprint is ``sha256(canonical params JSON || for each blob in a fixed order: name, length,
bytes)`` over the exact serialized bytes the client uploads, so the server, the client and the audit
log name the same material with the same 64 hex characters. A parameter hash names a context.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Mapping

import rfc8785

from fhe.params import CKKSParams

#: Blob order inside a key fingerprint (the secret key never takes part).
PUBLIC_BLOBS = ("public_key", "relin_keys", "galois_keys")


def params_hash(params: CKKSParams) -> str:
    """SHA-256 hex of the canonical JSON (RFC 8785) of the parameter set."""
    return hashlib.sha256(rfc8785.dumps(params.to_dict())).hexdigest()


def key_fingerprint(params: CKKSParams, blobs: Mapping[str, bytes]) -> str:
    """SHA-256 hex over the parameter set and the public blobs present, in :data:`PUBLIC_BLOBS` order."""
    h = hashlib.sha256(b"cipherlm-key-v1\0" + params_hash(params).encode())
    for name in PUBLIC_BLOBS:
        if name in blobs:
            data = blobs[name]
            h.update(name.encode() + b"\0" + struct.pack("<Q", len(data)) + data)
    return h.hexdigest()
