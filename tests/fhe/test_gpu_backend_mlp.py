"""The offload plan's MLP steps on the gpu backend against SEAL, bit for bit (issue 16 item 1 of this
session): the worker's MLP half with ``[private] device = "cpu-reference"`` (the gpu backend's torch-CPU
code, what CI runs) answers the same bytes as the SEAL worker on the same client ciphertexts and keys, at
:data:`fhe.mlp.MLP_PARAMS` (N = 8192, the shipped MLP parameters); the CUDA test does the same at
SmolLM2's MLP shape on the GPU machine."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fhe.backends.seal import hazmat as seal
from fhe.backends.seal.keys import CKKSClient
from fhe.mlp import MLP_PARAMS, MLPClient
from fhe.offload import offload_plan
from server.private.compute import _OffloadLinear
from tests.fhe.test_attention import tiny_model
from tests.fhe.test_mlp import _layer


def _workers(model, tmp_path, device: str):
    path = offload_plan(model.config, "tiny", client_layers=1, softmax="client").save(tmp_path / "tiny.offload.json")
    return _OffloadLinear(model, str(path), "cpu"), _OffloadLinear(model, str(path), device)


def _both_halves(seal_side: _OffloadLinear, ours: _OffloadLinear, layer: int, rng: np.random.Generator):
    """One token through both workers' mlp_up, then (the client's exact SiLU in between) mlp_down; the
    SEAL ciphertexts each answered, as bytes, and the client that decrypts them."""
    block = seal_side.blocks[layer]
    client = CKKSClient(MLP_PARAMS, seal_side.steps)
    for w in (seal_side, ours):
        w.load_key("fp", client.server_keys())
    mlp = MLPClient(client, block.layout, 1e-5)
    x = mlp.encrypt_input(torch.from_numpy(rng.normal(size=block.layout.hidden)))
    up = [w.run("fp", layer, "mlp_up", [x]) for w in (seal_side, ours)]
    a = mlp.encrypt_activation(mlp.activation(up[0]))
    down = [w.run("fp", layer, "mlp_down", [a]) for w in (seal_side, ours)]
    return up, down, mlp


def test_worker_mlp_steps_on_the_gpu_reference_are_seals_bytes(tmp_path):
    model = tiny_model(bias=False)
    seal_side, ours = _workers(model, tmp_path, "cpu-reference")
    assert ours.gpu is not None and ours.gpu.device.type == "cpu" and seal_side.gpu is None
    up, down, mlp = _both_halves(seal_side, ours, 1, np.random.default_rng(0))
    for theirs, got in (up, down):
        assert len(got) == len(theirs) >= 1
        assert [seal.to_bytes(c) for c in got] == [seal.to_bytes(c) for c in theirs]
    assert np.array_equal(mlp.output(down[1][0]).numpy(), mlp.output(down[0][0]).numpy())
    sizes = ours.device_nbytes()      # the plan's diagonals and the key set live on the evaluator's device
    assert sizes["weights"] == sizes["per_layer"] > 0 and sizes["key_set"] > 0
    ours.drop_key("fp")
    assert "fp" not in ours.device_keys and ours.device_nbytes()["key_set"] == 0


def test_worker_attention_linear_steps_on_the_gpu_reference_are_seals_bytes(tmp_path):
    """attn_qkv (with the projections' bias: an add_plain on the device) and attn_o, same bytes as SEAL's."""
    from fhe.linalg import replicate_input

    model = tiny_model(bias=True)
    seal_side, ours = _workers(model, tmp_path, "cpu-reference")
    lay = seal_side.attention[1].layout
    client = CKKSClient(MLP_PARAMS, seal_side.steps)
    for w in (seal_side, ours):
        w.load_key("fp", client.server_keys())
    rng = np.random.default_rng(2)
    for part, n, period in (("attn_qkv", lay.hidden, lay.qkv_period), ("attn_o", lay.q_dim, lay.o_period)):
        cts = [client.encrypt(replicate_input(rng.normal(size=n), lay.slots, period)) for _ in range(2)]
        theirs, got = (w.run("fp", 1, part, cts) for w in (seal_side, ours))   # a step of two positions: a batch
        assert len(got) == 2 and [seal.to_bytes(c) for c in got] == [seal.to_bytes(c) for c in theirs], part


@pytest.mark.gpu
def test_smollm2_shaped_mlp_steps_on_cuda_are_seals_bytes():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from fhe.backends.gpu import GpuEvaluator
    from fhe.mlp import EncryptedMLP

    layer = _layer(576, 1536)
    theirs = EncryptedMLP(layer, MLP_PARAMS)
    ev = GpuEvaluator(MLP_PARAMS, "cuda")            # SEAL's encoder: the diagonals are SEAL's residues
    ours = EncryptedMLP(layer, MLP_PARAMS, evaluator=ev)
    client = CKKSClient(MLP_PARAMS, tuple(theirs.rotation_steps))
    keys = ev.keys_from_server(client.server_keys())
    mlp = MLPClient(client, theirs.layout, 1e-5)
    x = mlp.encrypt_input(torch.from_numpy(np.random.default_rng(1).normal(size=576)))
    want = theirs.gate_up(x, client.server_keys())
    got = ours.gate_up(ev.deserialize(seal.to_bytes(x)), keys)
    assert [ev.serialize(c) for c in got] == [ev.serialize(ev.deserialize(seal.to_bytes(c))) for c in want]
    a = mlp.encrypt_activation(mlp.activation(want))
    want_d = theirs.down(a, client.server_keys())
    got_d = ours.down(ev.deserialize(seal.to_bytes(a)), keys)
    assert ev.serialize(got_d) == ev.serialize(ev.deserialize(seal.to_bytes(want_d)))
