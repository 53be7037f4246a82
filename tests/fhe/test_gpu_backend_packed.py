"""Packed prefill (fhe/packed.py) on the gpu backend on CUDA against the SEAL backend, on the same client
ciphertexts and keys (tiny GQA model with biases, 2Quad, N = 16384): with SEAL's encoder every output
ciphertext is SEAL's residue for residue; with the on-device encoder (the projections' diagonals through
the batched ``encode_many``, what the GPU worker runs) the decrypted outputs agree within CKKS noise.

Marked ``gpu`` (CI has no CUDA); the same code runs on the torch-CPU reference, which the block test
(tests/fhe/test_gpu_backend_block.py) already covers for the token path.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pytest
import torch

from fhe.attention import BlockClient, EncryptedAttentionLayer
from fhe.backends.gpu import GpuEvaluator
from fhe.backends.gpu.evaluator import GpuCiphertext
from fhe.backends.seal import hazmat as seal
from fhe.backends.seal.keys import CKKSClient
from fhe.params import ckks_params_for
from fhe.simulator import finish
from tests.fhe.test_attention import calibrated_plan, layer_input, tiny_model

pytestmark = pytest.mark.gpu


class PackedCase(NamedTuple):
    """A packed prefill (5 tokens unless asked; 3 on the CPU reference) of the tiny GQA model (biases, 2Quad,
    N = 16384) on the SEAL backend: what the gpu backend's runs are compared with (here on CUDA, in
    test_gpu_backend_packed_cpu.py on the CPU reference)."""

    model: object
    plan: object
    params: object
    x: torch.Tensor
    client: CKKSClient
    bc: BlockClient
    chunks: list
    want: list


def packed_case(tokens: tuple[int, ...] = (3, 14, 15, 9, 26)) -> PackedCase:
    model = tiny_model(bias=True)
    x = layer_input(model, 1, torch.tensor(tokens))
    plan = calibrated_plan(model, 1, x, "2quad")
    params = ckks_params_for("2quad", 6)
    cpu = EncryptedAttentionLayer(model.layers[1], model.rotary, plan, model.config, params, max_tokens=64)
    client = CKKSClient(params, sorted(cpu.rotation_steps))
    bc = BlockClient.for_model(client, model.config, "2quad", 6)
    chunks = bc.encrypt_packed(x)
    return PackedCase(model, plan, params, x, client, bc, chunks,
                      cpu.prefill_packed(cpu.new_cache(), chunks, 0, len(x), client.server_keys()))


def test_packed_prefill_on_cuda_is_seals():
    model, plan, params, x, client, bc, chunks, want = packed_case()
    cfg = model.config
    y0, z0 = bc.decrypt_output(want)
    ref = finish(y0, z0)
    for encoder in ("seal", "fft"):
        ev = GpuEvaluator(params, device="cuda", encoder=encoder)
        keys = ev.keys_from_server(client.server_keys())
        gpu = EncryptedAttentionLayer(model.layers[1], model.rotary, plan, cfg, params, max_tokens=64, evaluator=ev)
        got = gpu.prefill_packed(gpu.new_cache(), [ev.deserialize(seal.to_bytes(c)) for c in chunks], 0,
                                 len(x), keys)
        assert len(got) == len(want) == len(x)
        if encoder == "seal":
            for ours, theirs in zip(got, want, strict=True):
                assert ev.serialize(ours) == ev.serialize(ev.deserialize(seal.to_bytes(theirs)))
        y, z = bc.decrypt_output([seal.from_bytes("ciphertext", client.kit, ev.serialize(c)) for c in got])
        span = float(ref.max() - ref.min())
        assert float((finish(y, z) - ref).abs().max()) <= (0 if encoder == "seal" else 1e-5) * span


def test_encode_many_on_cuda_is_encode():
    """The batched on-device encoder gives each plaintext ``encode``'s residues on CUDA too (cuFFT batches)."""
    params = ckks_params_for("sqexp", 6)
    ev = GpuEvaluator(params, device="cuda", encoder="fft")
    rng = np.random.default_rng(3)
    values = [rng.uniform(-2, 2, params.slots) for _ in range(17)]
    for g, v in zip(ev.encode_many(values, ev.top, ev.scale), values, strict=True):
        assert torch.equal(g.data, ev.encode(v, ev.top, ev.scale).data)


def test_kept_diagonals_on_cuda_are_the_encoded_ones(monkeypatch):
    """``fhe.packed.PLAIN_CACHE_BYTES`` on CUDA with the on-device encoder (the GPU worker's): a second chunk of
    the same shape takes the first one's kept diagonals and gives the ciphertexts of a run without the cache,
    residue for residue; a chunk of other rows does not take them (tests/fhe/test_gpu_backend_packed_cpu.py
    checks the same against SEAL on the CPU reference)."""
    from fhe import packed

    model, plan, params, x, client, bc, chunks, _ = packed_case()
    ev = GpuEvaluator(params, device="cuda", encoder="fft")
    keys = ev.keys_from_server(client.server_keys())
    gpu = EncryptedAttentionLayer(model.layers[1], model.rotary, plan, model.config, params, max_tokens=64,
                                  evaluator=ev)
    shorter = bc.encrypt_packed(x[:3])

    def run(cts, count):
        return gpu.prefill_packed(gpu.new_cache(), [ev.deserialize(seal.to_bytes(c)) for c in cts], 0, count, keys)

    monkeypatch.setattr(packed, "PLAIN_CACHE_BYTES", 0)
    plain, plain_short = run(chunks, len(x)), run(shorter, 3)
    monkeypatch.setattr(packed, "PLAIN_CACHE_BYTES", 1 << 34)
    for _ in range(2):                                          # fills, then takes
        for got, want in ((run(chunks, len(x)), plain), (run(shorter, 3), plain_short)):
            assert all(torch.equal(a.data, b.data) for a, b in zip(got, want, strict=True))
    store = gpu.packed_plaintexts
    assert (len(store), store.hits, store.misses) == (6, 6, 6)


def test_dot_with_on_cuda_is_dot_plain():
    """``GpuEvaluator.dot_with`` (the packed maps' babies stacked once, ``fhe.packed.STACK_BABIES``) = ``dot_plain``
    residue for residue on CUDA, with plaintexts read in place (one ``encode_many`` block) and stacked (apart)."""
    params = ckks_params_for("sqexp", 6)
    ev = GpuEvaluator(params, device="cuda", encoder="fft")
    gen = torch.Generator(device="cuda").manual_seed(5)
    q = ev.ctx.q.view(-1)[: ev.top].view(-1, 1)
    n = params.poly_modulus_degree
    cts = [GpuCiphertext(torch.randint(0, 2**62, (2, ev.top, n), device="cuda", generator=gen) % q, ev.scale)
           for _ in range(6)]
    rng = np.random.default_rng(4)
    block = ev.encode_many([rng.uniform(-1, 1, params.slots) for _ in range(6)], ev.top, ev.scale)
    apart = [ev.encode(rng.uniform(-1, 1, params.slots), ev.top, ev.scale) for _ in range(6)]
    dot = ev.dot_with(cts)
    for pts in (block, apart, block):
        want = ev.dot_plain(list(zip(cts, pts, strict=True)))
        got = dot(pts)
        assert torch.equal(got.data, want.data) and got.scale == want.scale
