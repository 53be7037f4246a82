"""The private runtime keeps its CKKS key set in the encrypted key store and restores the same keys."""

from __future__ import annotations

import numpy as np
import pytest

from client_sdk import Client, InvalidKeyStoreAccess, KeyStore
from client_sdk._private import PrivateRuntime
from fhe.ckks import CKKSClient
from fhe.params import CKKSParams

PARAMS = CKKSParams(8192, (60, 40, 60), 40)
STEPS = (1, 2)


def runtime(store) -> PrivateRuntime:
    return PrivateRuntime(Client(api_key="clm-unused", base_url="http://127.0.0.1:9"), key_id="k1",
                          key_store=store)


def test_restore_is_the_same_key_set():
    a = CKKSClient(PARAMS, STEPS)
    b = CKKSClient.restore(PARAMS, STEPS, a.unsafe_export_secret(), a.public_blobs)
    assert b.fingerprint == a.fingerprint
    x = np.linspace(-1, 1, 64)
    assert np.abs(a.decrypt(b.encrypt(x))[:64] - x).max() < 1e-3
    assert np.abs(b.decrypt(a.encrypt(x))[:64] - x).max() < 1e-3
    other = CKKSClient(PARAMS, STEPS)
    assert np.abs(other.decrypt(a.encrypt(x))[:64] - x).max() > 1e-1  # another key cannot read it


def test_key_store_round_trip_across_runtimes(tmp_path):
    store = KeyStore.create(tmp_path / "ks", "correct horse")
    first, upload1 = runtime(store)._key_set(PARAMS, STEPS)
    reopened = KeyStore.open(tmp_path / "ks", "correct horse")
    second, upload2 = runtime(reopened)._key_set(PARAMS, STEPS)
    assert upload1 == upload2 and second.fingerprint == first.fingerprint
    x = np.linspace(0, 1, 32)
    assert np.abs(first.decrypt(second.encrypt(x))[:32] - x).max() < 1e-3
    secret = first.unsafe_export_secret()
    stored = b"".join(p.read_bytes() for p in (tmp_path / "ks").rglob("*") if p.is_file())
    assert secret[100:132] not in stored  # encrypted at rest
    with pytest.raises(InvalidKeyStoreAccess):
        KeyStore.open(tmp_path / "ks", "wrong")


def test_without_store_each_runtime_generates():
    a, _ = runtime(None)._key_set(PARAMS, STEPS)
    b, _ = runtime(None)._key_set(PARAMS, STEPS)
    assert a.fingerprint != b.fingerprint
