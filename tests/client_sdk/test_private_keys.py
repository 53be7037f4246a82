"""The private runtime keeps its CKKS key set in the encrypted key store and restores the same keys."""

from __future__ import annotations

import numpy as np
import pytest

from client_sdk import Client, InvalidKeyStoreAccess, KeyStore
from client_sdk._private import PrivateRuntime
from fhe.ckks import CKKSClient
from fhe.params import CKKSParams, KeyLevels

PARAMS = CKKSParams(8192, (60, 40, 60), 40)
STEPS = (1, 2)
LEVELS = KeyLevels.build(PARAMS, {1: 2, 2: 1}, 2)      # level-aware keys, as the runtime makes them


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
    first, upload1 = runtime(store)._key_set(PARAMS, LEVELS)
    reopened = KeyStore.open(tmp_path / "ks", "correct horse")
    second, upload2 = runtime(reopened)._key_set(PARAMS, LEVELS)
    assert upload1 == upload2 and second.fingerprint == first.fingerprint
    x = np.linspace(0, 1, 32)
    assert np.abs(first.decrypt(second.encrypt(x))[:32] - x).max() < 1e-3
    secret = first.unsafe_export_secret()
    stored = b"".join(p.read_bytes() for p in (tmp_path / "ks").rglob("*") if p.is_file())
    assert secret[100:132] not in stored  # encrypted at rest
    with pytest.raises(InvalidKeyStoreAccess):
        KeyStore.open(tmp_path / "ks", "wrong")


def test_without_store_each_runtime_generates():
    a, _ = runtime(None)._key_set(PARAMS, LEVELS)
    b, _ = runtime(None)._key_set(PARAMS, LEVELS)
    assert a.fingerprint != b.fingerprint


def test_a_stored_key_without_levels_is_reported_not_uploaded(tmp_path):
    """A key set an older SDK stored (one top-level relin/Galois pair) does not fit a level-aware plan."""
    from client_sdk import PrivateModeError
    from client_sdk.keystore import KeyMaterial
    from fhe import wire
    from fhe.envelope import pack_key_upload, parse_key_upload

    store = KeyStore.create(tmp_path / "ks", "correct horse")
    old = CKKSClient(PARAMS, STEPS)
    store.generate(lambda: KeyMaterial(old.unsafe_export_secret(), pack_key_upload(wire.dump_public_keys(old))),
                   key_id="k1")
    with pytest.raises(PrivateModeError, match="level-aware"):
        runtime(store)._key_set(PARAMS, LEVELS)
    client, upload = runtime(None)._key_set(PARAMS, LEVELS)
    assert set(wire.unpack_public_keys(parse_key_upload(upload, 1 << 30), PARAMS)) == set(wire.expected_blobs(LEVELS))
