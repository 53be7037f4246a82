"""The client's CKKS work of a multi-ciphertext offload step over a forked process pool
(``client_sdk._crypto_pool``, issue 17 session 13): the same decryptions as the serial path, bit for bit;
encryptions that decrypt to their values (seeded or full); the secret key never in a task or a result;
the setting's default; and the manifest's ``offload.mlp.upload`` as the SDK reads it."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from client_sdk._crypto_pool import CryptoPool, default_processes


@pytest.fixture(scope="module")
def ckks():
    from fhe.backends.seal.keys import CKKSClient
    from fhe.mlp import MLP_PARAMS

    return CKKSClient(MLP_PARAMS, (1,))


def _serial_decrypt(ckks, blobs):
    from fhe import wire

    return [ckks.decrypt(wire.load_ciphertext(b, ckks.kit, ckks.fingerprint)) for b in blobs]


@pytest.mark.parametrize("seeded", [True, False])
def test_pooled_decryption_is_the_serial_one_bit_for_bit_and_encryption_decrypts_to_its_values(ckks, seeded):
    from fhe import wire

    rng = np.random.default_rng(0)
    rows = [rng.normal(size=ckks.params.slots) for _ in range(7)]
    serial_blobs = [wire.encrypt_to_wire(ckks, r, seeded=seeded) for r in rows]
    pool = CryptoPool(ckks, 2, seeded=seeded)
    try:
        pooled = pool.decrypt(serial_blobs)
        serial = _serial_decrypt(ckks, serial_blobs)
        assert len(pooled) == len(rows)
        assert all(np.array_equal(p, s) and p.dtype == s.dtype for p, s in zip(pooled, serial, strict=True))
        blobs = pool.encrypt(rows)
        for got, want in zip(_serial_decrypt(ckks, blobs), rows, strict=True):
            assert np.abs(got - want).max() < 1e-5
        with pytest.raises(Exception) as err:       # an answer that does not parse: the FHE error, in this process
            pool.decrypt([serial_blobs[0], b"CLMC" + b"\0" * 90])
        from fhe.errors import FHEError

        assert isinstance(err.value, FHEError)
    finally:
        pool.close()
    assert pool._pool._state != "RUN"                 # children ended


def test_the_secret_key_is_in_no_task_or_result(ckks, monkeypatch):
    """What crosses the pool's pipes (tasks and results) is pickled: none of it holds the secret key's bytes
    or a SEAL object; the key holder itself is not even picklable."""
    from fhe.backends.seal import hazmat as seal

    secret = seal.to_bytes(ckks.keys.secret)
    sent = []
    real = pickle.dumps

    import multiprocessing.reduction as red

    monkeypatch.setattr(red.ForkingPickler, "dumps",
                        classmethod(lambda cls, obj, protocol=None: sent.append(real(obj)) or real(obj)))
    pool = CryptoPool(ckks, 2)
    try:
        rows = [np.zeros(ckks.params.slots) + i for i in range(4)]
        pool.decrypt(pool.encrypt(rows))
    finally:
        pool.close()
    assert sent                                        # the tasks went through the patched pickler
    body = secret[16:]
    assert not any(body[:64] in blob for blob in sent)
    with pytest.raises((TypeError, pickle.PicklingError)):
        pickle.dumps(ckks.keys.secret)


def test_default_processes(monkeypatch):
    monkeypatch.delenv("CIPHERLM_CRYPTO_PROCESSES", raising=False)
    assert 1 <= default_processes() <= 8
    monkeypatch.setenv("CIPHERLM_CRYPTO_PROCESSES", "3")
    assert default_processes() == 3
    monkeypatch.setenv("CIPHERLM_CRYPTO_PROCESSES", "0")
    assert default_processes() == 1
    monkeypatch.setenv("CIPHERLM_CRYPTO_PROCESSES", "many")
    with pytest.raises(ValueError):
        default_processes()
    with pytest.raises(ValueError):
        CryptoPool(object(), 1)


def test_the_manifest_asks_for_full_uploads_only_from_gpu_workers():
    from pathlib import Path

    import fhe
    from client_sdk._exceptions import PrivateModeError
    from client_sdk._offload import OffloadInfo
    from fhe.offload import OffloadPlan
    from server.private.offload import OffloadSteps

    plan = OffloadPlan.load(str(Path(fhe.__file__).parent / "data" / "smollm2-135m-instruct.offload.json"))
    seal_man = OffloadSteps.of(plan).manifest(plan.model_config)
    gpu_man = OffloadSteps.of(plan, full_uploads=True).manifest(plan.model_config)
    assert "upload" not in seal_man["mlp"] and gpu_man["mlp"]["upload"] == "full"
    assert OffloadInfo.from_manifest({"offload": seal_man}).upload == "seeded"
    assert OffloadInfo.from_manifest({"offload": gpu_man}).upload == "full"
    with pytest.raises(PrivateModeError):
        OffloadInfo.from_manifest({"offload": {**gpu_man, "mlp": {**gpu_man["mlp"], "upload": "zip"}}})
