"""How the SDK uploads an attention step's ciphertexts: the manifest's ``upload`` (absent or "seeded": SEAL's
seeded form, what every backend asks for since session 22, the gpu workers expanding c1 themselves; "full": c1
written out, what session 21's gpu servers asked for), on encryptions of zero made ahead in either form."""

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


@pytest.mark.parametrize("seeded", [True, False], ids=["seeded", "full"])
def test_a_ciphertext_on_a_zero_made_ahead_is_a_fresh_encryption_of_the_values(seeded):
    import numpy as np

    from client_sdk._zeros import ZerosAhead
    from fhe.backends.seal import wire

    ckks = _small_client()
    values = np.random.default_rng(0).normal(size=ckks.params.slots)
    zeros = ZerosAhead(ckks, seeded)
    try:
        zeros.prefetch(2)
        blobs = [zeros.encrypt_to_wire(values) for _ in range(3)]    # two made ahead, one inline
        assert (zeros.taken, zeros.inline) == (2, 1)
    finally:
        zeros.close()
    full_bytes = len(wire.encrypt_to_wire(ckks, values, seeded=False))
    assert all((len(b) < 0.6 * full_bytes) == seeded for b in blobs)   # seeded: about half the bytes
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
    for blob, ct in zip(blobs, cts, strict=True):
        got = gpu.deserialize_fresh(wire.ciphertext_payload(blob, ckks.params, ckks.fingerprint))
        assert got is not None and torch.equal(got.data, gpu.deserialize(seal_bytes(ct)).data)


def seal_bytes(ct) -> bytes:
    from fhe.backends.seal import hazmat as seal

    return seal.to_bytes(ct)


def test_a_seeded_zero_made_ahead_gives_the_bytes_seals_seeded_encryption_writes():
    """SEAL's seeded encryption = its seeded zero + the encoded message in c0: with the randomness fixed (the same
    seeded zero), ours and SEAL's serializations agree once decompressed (here: SEAL's c0 + m, rebuilt)."""
    import numpy as np

    from fhe import sealio
    from fhe.backends.seal import hazmat as seal

    ckks = _small_client()
    values = np.random.default_rng(1).normal(size=ckks.params.slots)
    zero = ckks.encrypt_zero_seeded()
    c0, seed = zero.c0.copy(), zero.seed
    ours = sealio.read_fresh_ct_members(sealio.open_object(ckks.encrypt_onto_seeded(values, zero), 1 << 30),
                                        ckks.params.poly_modulus_degree)
    pt = ckks.kit.encode(values, ckks.kit.top, ckks.kit.scale)
    m = sealio.read_plaintext(seal.to_bytes(pt), ckks.params.poly_modulus_degree)[2]
    q = np.asarray(ckks.kit.primes, dtype=object).reshape(-1, 1)
    assert np.array_equal(ours.c0.astype(object), (c0.astype(object) + m.astype(object)) % q)
    assert ours.seed == seed and ours.scale == pt.scale and ours.prng_type == sealio.PRNG_BLAKE2XB


def test_a_zero_serves_one_message():
    import numpy as np

    ckks = _small_client()
    zero = ckks.encrypt_zero()
    ckks.encrypt_onto(np.ones(4), zero)
    with pytest.raises(ValueError, match="unused encryption of zero"):
        ckks.encrypt_onto(np.ones(4), zero)
    seeded = ckks.encrypt_zero_seeded()
    ckks.encrypt_onto_seeded(np.ones(4), seeded)
    with pytest.raises(ValueError, match="unused seeded encryption of zero"):
        ckks.encrypt_onto_seeded(np.ones(4), seeded)


def test_the_runtime_makes_zeros_ahead_in_the_manifests_form_without_an_offload_plan():
    import numpy as np

    ckks = _small_client()
    assert _Runtime(manifest("full"), ckks, zeros_ahead=False)._zeros() is None
    seeded = _Runtime(manifest(None), ckks, zeros_ahead=True)
    try:
        assert seeded._zeros().seeded
    finally:
        seeded._zeros().close()
    rt = _Runtime(manifest("full"), ckks, zeros_ahead=True)
    rt.offload = object()
    assert rt._zeros() is None
    rt.offload = None
    zeros = rt._zeros()
    try:
        assert zeros is rt._zeros() and zeros.ckks is ckks and not zeros.seeded
        rt.blocks = {2: type("B", (), {"layout_input": staticmethod(lambda row: np.resize(row.numpy(), 8))})()}
        with pytest.raises(_Sent):
            rt.encrypted_attention(2, 5, torch.zeros(1, 8), StepStats())
        assert (zeros.inline, len(zeros._ready)) == (1, 1)          # this step's zero inline, the next one queued
        rt.ckks = type(ckks).__new__(type(ckks))                     # a new key set: its own zeros
        assert rt._zeros() is not zeros and zeros._pool._shutdown
    finally:
        zeros.close()
