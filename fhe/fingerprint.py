"""SHA-256 fingerprints of public key material and of CKKS parameter sets.

A key fingerprint is ``sha256(canonical params JSON || for each blob in a fixed order: name, length,
bytes)`` over the exact serialized bytes the client uploads, so the server, the client and the audit
log name the same material with the same 64 hex characters. A parameter hash names a context.
"""

from __future__ import annotations

import hashlib
import re
import struct
from collections.abc import Mapping

import rfc8785

from fhe.params import CKKSParams

#: Blob order inside a key fingerprint (the secret key never takes part).
PUBLIC_BLOBS = ("public_key", "relin_keys", "galois_keys")
#: Kinds that come per level in a level-aware upload (``relin_keys@10``, ``galois_keys@12``...).
LEVELED_BLOBS = ("relin_keys", "galois_keys")
_LEVELED = re.compile(r"^(relin_keys|galois_keys)@([1-9][0-9]{0,2})$")


def level_blob_name(kind: str, level: int) -> str:
    """The upload name of a ``kind`` key made at ``level`` (see :class:`fhe.params.KeyLevels`)."""
    return f"{kind}@{int(level)}"


def split_blob_name(name: str) -> tuple[str, int | None] | None:
    """``name`` -> (kind, level or None); None if it is no public blob name at all."""
    if name in PUBLIC_BLOBS:
        return name, None
    m = _LEVELED.match(name) if isinstance(name, str) else None
    return (m.group(1), int(m.group(2))) if m else None


def blob_order(names) -> list[str]:
    """Public blob names in fingerprint/upload order: by kind as in :data:`PUBLIC_BLOBS`, a kind's
    unleveled blob first, then its levels highest first. Other names are left out."""
    parsed = {n: split_blob_name(n) for n in names}
    keep = [n for n, p in parsed.items() if p is not None]
    return sorted(keep, key=lambda n: (PUBLIC_BLOBS.index(parsed[n][0]), parsed[n][1] is not None,
                                       -(parsed[n][1] or 0)))


def params_hash(params: CKKSParams) -> str:
    """SHA-256 hex of the canonical JSON (RFC 8785) of the parameter set."""
    return hashlib.sha256(rfc8785.dumps(params.to_dict())).hexdigest()


def key_fingerprint(params: CKKSParams, blobs: Mapping[str, bytes]) -> str:
    """SHA-256 hex over the parameter set and the public blobs present, in :func:`blob_order` (for an
    upload without levels: :data:`PUBLIC_BLOBS` order, as before level-aware keys)."""
    h = hashlib.sha256(b"cipherlm-key-v1\0" + params_hash(params).encode())
    for name in blob_order(blobs):
        data = blobs[name]
        h.update(name.encode() + b"\0" + struct.pack("<Q", len(data)) + data)
    return h.hexdigest()
