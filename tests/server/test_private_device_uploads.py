"""Attention steps on a gpu-backend worker read full (unseeded, session 21) and seeded (session 22: c1 expanded
on the device from the seed) uploads directly (issue 16): the device ciphertexts are those SEAL's load gave, bit
for bit; every malformed full or seeded upload is still ``bad_ciphertext`` (the direct parse refuses it, then SEAL
or the freshness check does), with nothing cached. The manifest asks for seeded uploads wherever the worker
expands them (a CUDA server: once a card has checked the expansion). The tiny model and 2Quad plan of
:mod:`tests.server.private_app`, the worker on the gpu backend's torch-CPU reference (the step's evaluation
itself: ``test_private_device.py``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from server.private.codes import TaskFailure, WorkerCode
from tests.server.app_helpers import tiny_model_dir  # noqa: F401 - fixture
from tests.server.private_app import LAYER, TinyClient, tiny_plan
from tests.server.upload_mutations import full_upload_mutations, seeded_upload_mutations


@pytest.fixture(scope="module")
def setup(tiny_model_dir, tmp_path_factory):  # noqa: F811
    from engine.loader import load_model
    from server.private.compute import PrivateCompute

    model = load_model(tiny_model_dir)
    plan_path = tiny_plan(model, tmp_path_factory.mktemp("plan"))
    client = TinyClient(model, plan_path)
    worker = PrivateCompute(str(tiny_model_dir), str(plan_path), 16, "cpu-reference")
    worker.load_key(client.fingerprint, client.upload)
    return client, worker


def _seeded_and_full(client) -> tuple[bytes, bytes]:
    """One encryption as the seeded upload and as the full one (SEAL's load of the seeded bytes, saved)."""
    from fhe.backends.seal import hazmat as seal
    from fhe.backends.seal import wire

    values = np.random.default_rng(0).normal(size=client.ckks.params.slots)
    seeded = wire.encrypt_to_wire(client.ckks, values)
    ct = wire.load_ciphertext(seeded, client.ckks.kit, client.ckks.fingerprint)
    return seeded, wire.pack_ciphertext(seal.to_bytes(ct), client.ckks.params, client.ckks.fingerprint)


def test_full_and_seeded_uploads_are_read_without_seal_into_the_ciphertext_seal_loads(setup, monkeypatch):
    from fhe.backends.seal import wire
    from server.private import compute

    client, worker = setup
    keys, top = worker.keys[client.fingerprint], worker.gpu.top
    seeded, full = _seeded_and_full(client)
    calls, real = [], wire.load_ciphertext
    monkeypatch.setattr(compute.wire, "load_ciphertext", lambda *a, **k: calls.append(1) or real(*a, **k))
    got = compute.device_inputs(worker.gpu, [full, seeded, full], keys, top)
    assert not calls                                             # the seeded one expanded on the device
    for g in got:
        assert g.data.shape == (2, top, client.ckks.params.poly_modulus_degree)
        assert torch.equal(g.data, got[1].data) and g.scale == got[1].scale


def test_malformed_full_and_seeded_uploads_to_an_attention_step_are_bad_ciphertext(setup):
    client, worker = setup
    seeded, full = _seeded_and_full(client)
    worker.open_session("s", client.fingerprint)
    bad_ones = (full_upload_mutations(worker.gpu, client.ckks.fingerprint, full)
                | {f"seeded: {k}": v for k, v in seeded_upload_mutations(worker.gpu, client.ckks.fingerprint,
                                                                        seeded).items()})
    for name, bad in bad_ones.items():
        for blobs in ([bad], [full, bad]):
            with pytest.raises(TaskFailure) as err:
                worker.step("s", client.fingerprint, LAYER, 0, blobs)
            assert err.value.code is WorkerCode.BAD_CIPHERTEXT, name
            assert worker.sessions["s"][1][LAYER].length == 0, name     # nothing cached
    worker.close_session("s")


@pytest.mark.parametrize("device", ["cpu", "cpu-reference", "cuda"])
def test_the_manifest_asks_for_seeded_uploads_on_every_worker_device(setup, device):
    from fhe.plan import Plan
    from server.private.config import PrivateSettings
    from server.private.feature import build_manifest

    client, _ = setup
    bundle = {"sha256": "ab" * 32, "size": 1, "withheld": []}
    man = build_manifest("tiny", client.plan, bundle, PrivateSettings(device=device), 2)
    assert "upload" not in man                                        # SEAL's seeded form (docs/protocol.md)
    assert isinstance(client.plan, Plan)
