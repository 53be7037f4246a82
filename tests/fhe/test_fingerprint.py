"""Key fingerprints and parameter hashes are stable and byte-sensitive."""

from fhe.fingerprint import key_fingerprint, params_hash
from fhe.params import CKKSParams

P = CKKSParams(8192, (60, 40, 40, 60), 40)


def test_fingerprint_is_deterministic_and_sensitive():
    blobs = {"public_key": b"a" * 10, "relin_keys": b"b", "galois_keys": b"c"}
    fp = key_fingerprint(P, blobs)
    assert fp == key_fingerprint(P, dict(reversed(list(blobs.items()))))
    assert len(fp) == 64
    assert fp != key_fingerprint(P, {**blobs, "galois_keys": b"d"})
    assert fp != key_fingerprint(CKKSParams(8192, (60, 40, 40, 60), 39), blobs)


def test_params_hash_differs_by_params():
    assert params_hash(P) != params_hash(CKKSParams(16384, (60, 40, 40, 60), 40))
