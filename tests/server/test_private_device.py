"""``[private] device``: the setting's validation, the device key budget, and a worker on the gpu backend —
its torch-CPU reference in CI (slow), CUDA on the GPU machine (marked gpu) — against the SEAL worker on
the same client ciphertexts (the tiny model and 2Quad plan of :mod:`tests.server.private_app`)."""

from __future__ import annotations

import json

import pytest
import torch
from pydantic import ValidationError

from server.private.config import PrivateSettings
from server.private.feature import with_device_key_cap
from tests.server.app_helpers import tiny_model_dir  # noqa: F401
from tests.server.private_app import LAYER, TinyClient, tiny_plan


@pytest.mark.parametrize("device", ["cpu", "cuda", "cuda:1", "cuda:12", "cpu-reference"])
def test_known_devices_are_accepted(device):
    cfg = PrivateSettings(device=device)
    assert cfg.device == device and cfg.gpu_backend == (device != "cpu")


@pytest.mark.parametrize("device", ["gpu", "cuda:", "cuda:x", "", "CUDA", "cpu ", "cuda:123", "rocm"])
def test_other_devices_are_refused(device):
    with pytest.raises(ValidationError, match="device must be"):
        PrivateSettings(device=device)


def test_device_key_bytes_must_be_positive():
    with pytest.raises(ValidationError):
        PrivateSettings(device="cuda", device_key_bytes=0)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir, tmp_path_factory):  # noqa: F811
    from engine.loader import load_model

    model = load_model(tiny_model_dir)
    plan_path = tiny_plan(model, tmp_path_factory.mktemp("plan"))
    return tiny_model_dir, model, plan_path


def test_the_device_budget_caps_key_sets_per_worker(tiny):
    from fhe.backends.gpu.keys import key_nbytes, key_set_nbytes
    from fhe.params import CKKSParams
    from fhe.plan import Plan
    from fhe.weight_maps import required_key_levels

    model_dir, model, plan_path = tiny
    plan, config = Plan.load(plan_path), json.loads((model_dir / "config.json").read_text())
    params = CKKSParams.from_dict(plan.ckks)
    levels = required_key_levels(model.config, params, "2quad", 6)
    one = key_set_nbytes(params, levels)
    full = (len(levels.galois) + 1) * key_nbytes(params.poly_modulus_degree, params.depth + 1)
    assert 0 < one < full                                          # level-aware keys are smaller on the device
    cap = lambda **kw: with_device_key_cap(PrivateSettings(max_keys_per_worker=4, **kw), config, plan)  # noqa: E731
    assert cap(device="cuda", device_key_bytes=2 * one + 1).max_keys_per_worker == 2
    assert cap(device="cuda", device_key_bytes=100 * one).max_keys_per_worker == 4
    assert cap(device="cuda").max_keys_per_worker == 4              # no byte cap
    assert cap(device="cpu", device_key_bytes=1).max_keys_per_worker == 4   # SEAL workers: not device bytes
    with pytest.raises(ValueError, match="holds no key set"):
        cap(device="cuda:0", device_key_bytes=one - 1)


def _worker_against_seal(tiny, device: str) -> None:
    """One prefill step (2 real tokens) through a worker on ``device`` and through the SEAL worker: the
    decrypted outputs agree to 1e-6 of their range (the gpu worker's encoder is not SEAL's bit for bit). The
    SEAL worker gets the seeded uploads, the gpu one the same ciphertexts as full uploads (what the SDK sends
    when the manifest asks, ``upload = "full"``: read without SEAL's load), and its results go out in the gpu
    backend's own serialization, which the client's SEAL loads."""
    from fhe.backends.seal import hazmat as seal
    from fhe.backends.seal import wire
    from server.private.compute import PrivateCompute

    model_dir, model, plan_path = tiny
    client = TinyClient(model, plan_path)
    x = client.layer_input([3, 14])
    seeded = [wire.encrypt_to_wire(client.ckks, client.block.layout_input(row)) for row in x]
    full = [wire.pack_ciphertext(seal.to_bytes(wire.load_ciphertext(b, client.ckks.kit, client.ckks.fingerprint)),
                                 client.ckks.params, client.ckks.fingerprint) for b in seeded]
    outs = {}
    for dev, blobs in (("cpu", seeded), (device, full)):
        worker = PrivateCompute(str(model_dir), str(plan_path), 16, dev)
        worker.load_key(client.fingerprint, client.upload)
        worker.open_session("s", client.fingerprint)
        res, cache_bytes = worker.step("s", client.fingerprint, LAYER, 0, blobs)
        assert cache_bytes > 0 and len(res) == len(blobs)
        assert set(worker.take_stages()) == {"worker_parse", "worker_compute", "worker_serialize"}
        cts = [wire.load_ciphertext(b, client.ckks.kit, client.ckks.fingerprint) for b in res]
        outs[dev] = client.block.finish(*client.block.decrypt_output(cts))
        assert worker.drop_key(client.fingerprint) == 1 and not worker.device_keys
    want, got = outs["cpu"], outs[device]
    assert (got - want).abs().max() <= 1e-6 * (want.max() - want.min())


@pytest.mark.heavy   # the block on the CPU reference is checked bit for bit in CI (test_gpu_backend_block.py)
def test_a_cpu_reference_worker_answers_like_the_seal_worker(tiny):
    _worker_against_seal(tiny, "cpu-reference")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_worker_answers_like_the_seal_worker(tiny):
    _worker_against_seal(tiny, "cuda")


def test_kept_packed_plaintexts_reach_gpu_workers_only(tmp_path, monkeypatch):
    """``[private] packed_plain_cache_gb``: the worker factory's trailing argument (in bytes) on a gpu backend with
    attention blocks, absent otherwise (so four-argument factories keep working), and a worker process's
    ``fhe.packed.PLAIN_CACHE_BYTES`` from it on the gpu backend only."""
    from fhe import packed
    from server.private.compute import keep_packed_plaintexts, make_state
    from server.private.feature import _worker_args

    plan = tmp_path / "plan.json"
    gb = 1.5
    args = _worker_args(PrivateSettings(device="cuda", packed_plain_cache_gb=gb), tmp_path, plan)
    assert args[-1] == int(gb * (1 << 30)) and len(args) == 9
    assert make_state.__code__.co_varnames[8] == "packed_kept_bytes"      # where that argument lands
    assert len(_worker_args(PrivateSettings(device="cuda"), tmp_path, plan)) == 4
    assert len(_worker_args(PrivateSettings(device="cpu", packed_plain_cache_gb=gb), tmp_path, plan)) == 4
    monkeypatch.setattr(packed, "PLAIN_CACHE_BYTES", 0)
    keep_packed_plaintexts(None, 5)                                       # SEAL: never kept
    assert packed.PLAIN_CACHE_BYTES == 0
    keep_packed_plaintexts(object(), 5)
    assert packed.PLAIN_CACHE_BYTES == 5
