"""Packed prefill (fhe/packed.py) on the gpu backend's torch-CPU reference = the SEAL backend, ciphertext for
ciphertext (CI): the device-side path of the projections' diagonals (built in torch, several band shifts per
gather and encode: ``SHIFT_GROUP``, session 19) and the token rows' output maps as one batch (``BATCH_ROWS``,
session 19), with SEAL's encoder, on the same client ciphertexts and keys (tiny GQA model with biases, 2Quad,
N = 16384). Their defaults (off) run on CUDA in tests/fhe/test_gpu_backend_packed.py.

Three tokens (five until session 22, ~2x the torch-CPU reference's time): position 0 and a batch of two rows
(u and z of each), so a group of rows is still stacked; what is compared (every output ciphertext, byte for
byte) does not depend on how many positions there are.
"""

from __future__ import annotations

from fhe import packed
from fhe.attention import EncryptedAttentionLayer
from fhe.backends.gpu import GpuEvaluator
from fhe.backends.gpu.batched import BatchedEvaluator
from fhe.backends.seal import hazmat as seal
from tests.fhe.test_gpu_backend_packed import packed_case


def test_packed_prefill_on_the_cpu_reference_is_seals(monkeypatch):
    monkeypatch.setattr(packed, "SHIFT_GROUP", 3)             # groups that do not divide the head dim
    monkeypatch.setattr(packed, "BATCH_ROWS", True)           # the rows' output maps as one batch
    stacked = []
    stack = BatchedEvaluator.stack
    monkeypatch.setattr(BatchedEvaluator, "stack", lambda self, cts: stacked.append(len(cts)) or stack(self, cts))
    model, plan, params, x, client, _, chunks, want = packed_case((3, 14, 15))
    ev = GpuEvaluator(params, device="cpu", encoder="seal")
    gpu = EncryptedAttentionLayer(model.layers[1], model.rotary, plan, model.config, params, max_tokens=64,
                                  evaluator=ev)
    assert gpu.ev.encode_many is not None                     # the device-side diagonals path
    got = gpu.prefill_packed(gpu.new_cache(), [ev.deserialize(seal.to_bytes(c)) for c in chunks], 0, len(x),
                             ev.keys_from_server(client.server_keys()))
    assert len(got) == len(want) == len(x) and stacked == [len(x) - 1] * 2     # u and z of every row but position 0
    for ours, theirs in zip(got, want, strict=True):
        assert ev.serialize(ours) == ev.serialize(ev.deserialize(seal.to_bytes(theirs)))
