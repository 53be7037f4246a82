"""The whole encrypted attention block on the gpu backend (its torch-CPU reference here; the same code on
CUDA) against the SEAL backend, on the same client ciphertexts and keys: every output ciphertext is
residue-for-residue SEAL's, so both decrypt to the same values (tiny GQA model with biases, 2Quad,
N = 16384). Heavy (~2 min on the CPU reference): the default run checks every operation the block uses
bit for bit (tests/fhe/test_gpu_backend.py) and whole offload steps on this backend
(tests/fhe/test_gpu_backend_mlp.py); this composes them over a whole block."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fhe.attention import BlockClient, EncryptedAttentionLayer, required_rotation_steps
from fhe.backends import evaluator_for
from fhe.backends.seal import hazmat as seal
from fhe.backends.seal.keys import CKKSClient
from fhe.params import ckks_params_for
from tests.fhe.test_attention import calibrated_plan, layer_input, tiny_model


@pytest.mark.heavy
def test_block_on_the_gpu_backend_is_seals_bit_for_bit():
    model = tiny_model(bias=True)
    cfg = model.config
    x = layer_input(model, 1, torch.tensor([3, 14]))            # two tokens: every stage, ~half the time
    plan = calibrated_plan(model, 1, x, "2quad")
    params = ckks_params_for("2quad", plan.approx.squarings)
    steps = required_rotation_steps(cfg, params, "2quad", plan.approx.squarings)
    client = CKKSClient(params, steps)
    bc = BlockClient.for_model(client, cfg, "2quad", plan.approx.squarings)
    inputs = bc.encrypt_input(x)

    cpu = EncryptedAttentionLayer(model.layers[1], model.rotary, plan, cfg, params, max_tokens=64)
    want = cpu.prefill(cpu.new_cache(), inputs, 0, client.server_keys())

    ev = evaluator_for(params, "gpu")
    keys = ev.load_keys(dict(client.public_blobs), steps)
    gpu = EncryptedAttentionLayer(model.layers[1], model.rotary, plan, cfg, params, max_tokens=64, evaluator=ev)
    got = gpu.prefill(gpu.new_cache(), [ev.deserialize(seal.to_bytes(c)) for c in inputs], 0, keys)

    assert len(got) == len(want)
    for ours, theirs in zip(got, want, strict=True):
        assert ev.serialize(ours) == ev.serialize(ev.deserialize(seal.to_bytes(theirs)))
    back = [seal.from_bytes("ciphertext", client.kit, ev.serialize(c)) for c in got]
    y, z = bc.decrypt_output(back)
    y0, z0 = bc.decrypt_output(want)
    assert np.array_equal(y.numpy(), y0.numpy()) and np.array_equal(z.numpy(), z0.numpy())
