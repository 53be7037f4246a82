"""How the SDK uploads an attention step's ciphertexts: the manifest's ``upload`` ("full" from a server whose
workers run the gpu backend, which reads them without SEAL's load; absent or "seeded": SEAL's seeded form)."""

from __future__ import annotations

import pytest
import torch

from client_sdk import PrivateModeError
from client_sdk import _protocol as proto
from client_sdk._runtime import PrivateRuntime, StepStats
from tests.client_sdk.test_protocol import N16K, manifest_json


def manifest(upload: str | None) -> proto.Manifest:
    d = manifest_json(N16K)
    if upload is not None:
        d["upload"] = upload
    return proto.Manifest.from_json(d)


def test_the_manifest_names_the_upload_form_and_an_older_server_takes_seeded():
    assert manifest("full").upload == "full"
    assert manifest("seeded").upload == "seeded"
    assert manifest(None).upload == "seeded"
    with pytest.raises(PrivateModeError, match="update the SDK"):
        manifest("compressed-differently")


class _Sent(Exception):
    pass


class _Runtime:
    """``PrivateRuntime.encrypted_attention`` on a bare object: its encryptions are recorded, its call stops
    before any I/O."""

    encrypted_attention = PrivateRuntime.encrypted_attention
    _packs = PrivateRuntime._packs
    _chunk = PrivateRuntime._chunk
    _zeros = PrivateRuntime._zeros

    class _Block:
        def layout_input(self, row):
            return row.numpy()

    class _Session:
        def step_call(self, *args, **kwargs):
            return None

    def __init__(self, man: proto.Manifest, ckks: object = None, zeros_ahead: bool = False) -> None:
        self.manifest, self.verifying, self.ckks = man, False, ckks or object()
        self.blocks, self.session = {2: self._Block()}, self._Session()
        self.offload, self.zeros_ahead, self._zeros_ahead = None, zeros_ahead, None

    def exchange(self, call):
        raise _Sent


@pytest.mark.parametrize(("upload", "seeded"), [("full", False), ("seeded", True), (None, True)])
def test_attention_steps_are_encrypted_in_the_form_the_manifest_asks(monkeypatch, upload, seeded):
    from fhe import wire

    sent = []
    monkeypatch.setattr(wire, "encrypt_to_wire", lambda ckks, vec, *, seeded=True: sent.append(seeded) or b"x")
    with pytest.raises(_Sent):
        _Runtime(manifest(upload)).encrypted_attention(2, 5, torch.zeros(1, 8), StepStats())
    assert sent == [seeded]


SMALL = None


def _small_client():
    """A CKKS key set at N = 8192 (fast), no rotation keys."""
    global SMALL
    if SMALL is None:
        from fhe.backends.seal.keys import CKKSClient
        from fhe.params import CKKSParams

        SMALL = CKKSClient(CKKSParams(8192, (60, 40, 40, 60), 40), ())
    return SMALL


def test_a_ciphertext_on_a_zero_made_ahead_is_a_fresh_encryption_of_the_values():
    import numpy as np

    from client_sdk._zeros import ZerosAhead
    from fhe.backends.seal import wire

    ckks = _small_client()
    values = np.random.default_rng(0).normal(size=ckks.params.slots)
    zeros = ZerosAhead(ckks)
    try:
        zeros.prefetch(2)
        blobs = [zeros.encrypt_to_wire(values) for _ in range(3)]    # two made ahead, one inline
        assert (zeros.taken, zeros.inline) == (2, 1)
    finally:
        zeros.close()
    server = ckks.server_keys()
    cts = [wire.load_ciphertext(b, ckks.kit, ckks.fingerprint, level=ckks.kit.top) for b in blobs]
    c1 = set()
    for ct in cts:
        server.check_input(ct)                                       # fresh: top level, size 2, default scale, NTT
        assert np.abs(ckks.decrypt(ct) - values).max() < 1e-6
        c1.add(ct.data(1))                                           # (the first residue of c1)
    assert len(c1) == 3                                              # each its own randomness
    from fhe.backends.gpu import GpuEvaluator

    gpu = GpuEvaluator(ckks.params, "cpu")                           # a GPU worker's direct parse takes them
    assert all(gpu.deserialize_fresh(wire.ciphertext_payload(b, ckks.params, ckks.fingerprint)) is not None
               for b in blobs)


def test_a_zero_serves_one_message():
    import numpy as np

    ckks = _small_client()
    zero = ckks.encrypt_zero()
    ckks.encrypt_onto(np.ones(4), zero)
    with pytest.raises(ValueError, match="unused encryption of zero"):
        ckks.encrypt_onto(np.ones(4), zero)


def test_the_runtime_makes_zeros_ahead_only_for_full_uploads_without_an_offload_plan():
    import numpy as np

    ckks = _small_client()
    assert _Runtime(manifest("seeded"), ckks, zeros_ahead=True)._zeros() is None
    assert _Runtime(manifest("full"), ckks, zeros_ahead=False)._zeros() is None
    rt = _Runtime(manifest("full"), ckks, zeros_ahead=True)
    rt.offload = object()
    assert rt._zeros() is None
    rt.offload = None
    zeros = rt._zeros()
    try:
        assert zeros is rt._zeros() and zeros.ckks is ckks
        rt.blocks = {2: type("B", (), {"layout_input": staticmethod(lambda row: np.resize(row.numpy(), 8))})()}
        with pytest.raises(_Sent):
            rt.encrypted_attention(2, 5, torch.zeros(1, 8), StepStats())
        assert (zeros.inline, len(zeros._ready)) == (1, 1)          # this step's zero inline, the next one queued
        rt.ckks = type(ckks).__new__(type(ckks))                     # a new key set: its own zeros
        assert rt._zeros() is not zeros and zeros._pool._shutdown
    finally:
        zeros.close()
