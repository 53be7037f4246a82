"""Sessions batched through one launch per operation (fhe/backends/gpu/batched.py): each row of a batched
MLP step is the one-session gpu evaluator's result, residue for residue, with every session under its own
key set (CPU reference here at the shipped MLP parameters, N = 8192; CUDA at SmolLM2's shape, ``gpu``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fhe.backends.gpu import GpuEvaluator
from fhe.backends.gpu.batched import BatchedEvaluator, BatchKeys, run_linear
from fhe.backends.seal import hazmat as seal
from fhe.backends.seal.keys import CKKSClient
from fhe.errors import KeyMismatchError, ShapeError
from fhe.mlp import MLP_PARAMS, EncryptedMLP, MLPClient
from tests.fhe.test_mlp import _layer


def _sessions(block: EncryptedMLP, count: int, seed: int):
    """``count`` clients (own secret keys), their device keys and one fresh encrypted input each."""
    ev, rng = block.ev, np.random.default_rng(seed)
    clients = [CKKSClient(MLP_PARAMS, tuple(block.rotation_steps)) for _ in range(count)]
    keys = [ev.keys_from_server(c.server_keys()) for c in clients]
    mlps = [MLPClient(c, block.layout, 1e-5) for c in clients]
    cts = [ev.deserialize(seal.to_bytes(m.encrypt_input(torch.from_numpy(rng.normal(size=block.layout.hidden)))))
           for m in mlps]
    return keys, cts


def _check_rows(block: EncryptedMLP, count: int, seed: int = 0) -> None:
    ev = block.ev
    keys, cts = _sessions(block, count, seed)
    bev, bkeys = BatchedEvaluator(ev), BatchKeys.of(keys)
    for enc in [*block._enc_up, block._enc_down]:
        want = [ev.mod_switch(enc(ev, c, k), 1) for c, k in zip(cts, keys, strict=True)]
        got = bev.unstack(run_linear(bev, enc, bev.stack(cts), bkeys))
        assert [ev.serialize(c) for c in got] == [ev.serialize(c) for c in want]
        assert len({ev.serialize(c) for c in got}) == count      # rows are not one session repeated


def test_batched_mlp_steps_are_the_one_session_results_on_the_cpu_reference():
    block = EncryptedMLP(_layer(32, 48), MLP_PARAMS, evaluator=GpuEvaluator(MLP_PARAMS, "cpu"))
    _check_rows(block, 3)


def test_batch_refuses_mismatched_rows_and_keys():
    ev = GpuEvaluator(MLP_PARAMS, "cpu")
    block = EncryptedMLP(_layer(32, 48), MLP_PARAMS, evaluator=ev)
    keys, cts = _sessions(block, 2, 1)
    bev = BatchedEvaluator(ev)
    with pytest.raises(ShapeError):
        bev.stack([cts[0], ev.mod_switch(cts[1], 1)])
    with pytest.raises(ShapeError):                                 # 2 rows, 1 key set
        bev.rotate(bev.stack(cts), 1, BatchKeys.of(keys[:1]))
    missing = next(s for s in range(1, ev.slots) if s not in block.rotation_steps)
    with pytest.raises(KeyMismatchError):
        bev.rotate(bev.stack(cts), missing, BatchKeys.of(keys))    # no key for that step
    with pytest.raises(ShapeError):
        BatchKeys.of([])


@pytest.mark.gpu
def test_batched_smollm2_shaped_mlp_steps_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    block = EncryptedMLP(_layer(576, 1536), MLP_PARAMS, evaluator=GpuEvaluator(MLP_PARAMS, "cuda"))
    _check_rows(block, 4)
