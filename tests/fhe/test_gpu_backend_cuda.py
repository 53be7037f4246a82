"""The gpu backend on CUDA (Triton kernels) against its torch-CPU reference and against SEAL.

Runs on the GPU machine only (marked ``gpu``; CI has no CUDA): N = 8192 for every operation, and the
shipped parameters (N = 32768, 12 data primes) for the NTT, relinearization and (hoisted) rotations.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fhe import sealio
from fhe.backends.gpu import GpuEvaluator
from fhe.backends.gpu.ntt import intt, ntt
from fhe.backends.seal import hazmat as seal
from fhe.backends.seal.keys import CKKSClient
from fhe.params import CKKSParams, ckks_params_for

pytestmark = pytest.mark.gpu


def _check(params: CKKSParams, steps: tuple[int, ...]) -> None:
    client = CKKSClient(params, steps)
    server, kit = client.server_keys(), client.kit
    ev = GpuEvaluator(params, device="cuda")
    keys = ev.load_keys(dict(client.public_blobs), steps)

    def same(ours, theirs) -> bool:
        raw = sealio.read_ciphertext(seal.to_bytes(theirs), params.poly_modulus_degree, ev.top)
        return bool(np.array_equal(ev.to_raw(ours).data, raw.data)) and ours.scale == raw.scale

    rng = np.random.default_rng(1)
    a, b = (client.encrypt(rng.uniform(-1, 1, params.slots)) for _ in range(2))
    A, B = ev.deserialize(seal.to_bytes(a)), ev.deserialize(seal.to_bytes(b))
    top = ev.top
    pt, PT = kit.encode(np.ones(params.slots) * 0.5, top, kit.prime(top)), ev.encode(
        np.ones(params.slots) * 0.5, top, kit.prime(top))
    m = kit.mul_plain(a, pt)
    assert same(ev.add(A, B), kit.add(a, b)) and same(ev.mul_plain(A, PT), m)
    assert same(ev.rescale(ev.mul_plain(A, PT)), kit.relin_rescale(m, None))
    # the one-kernel dot product and sum (triton_ops.dot_rows) against SEAL's loop of ops
    assert same(ev.dot_plain([(A, PT), (B, PT), (A, PT)]), kit.dot_plain([(a, pt), (b, pt), (a, pt)]))
    assert same(ev.add_many([A, B, B, A]), kit.add(kit.add(a, b), kit.add(b, a)))
    c = kit.mul(a, b)
    assert same(ev.mul(A, B), c)
    assert same(ev.relinearize(ev.mul(A, B), keys), _relin(kit, c, server))
    many = ev.rotate_many(A, steps, keys)
    each = ev.rotate_each([A, B] * len(steps), [s for s in steps for _ in (0, 1)], keys)
    for i, s in enumerate(steps):
        want = kit.rotate(a, s, server.galois)
        assert same(ev.rotate(A, s, keys), want) and same(many[s], want)
        assert same(each[2 * i], want) and same(each[2 * i + 1], kit.rotate(b, s, server.galois))


def _relin(kit, c, server):
    out = seal.sa.Ciphertext()
    kit.evaluator.relinearize(c, server.relin, out)
    return out


@pytest.mark.parametrize("shoup,strided,lazy", [(False, False, False), (True, False, False), (True, True, False),
                                               (True, True, True)])
def test_triton_ntt_matches_the_torch_reference(shoup, strided, lazy, monkeypatch):
    from fhe.backends.gpu import triton_ops

    monkeypatch.setattr(triton_ops, "LAZY", lazy)                    # Harvey's butterflies
    monkeypatch.setattr(triton_ops, "STRIDED", strided)              # the staged stages in one launch, or one each
    monkeypatch.setattr(triton_ops, "SHOUP", shoup)                  # Shoup's twiddle products or _mulmod's
    monkeypatch.setattr(triton_ops, "FEWER", shoup)                  # N^-1 in the INTT's last stage, or a kernel
    params = ckks_params_for("sqexp", 6)
    cpu, gpu = GpuEvaluator(params, device="cpu"), GpuEvaluator(params, device="cuda")
    q = cpu.ctx.tables.primes
    x = torch.remainder(torch.randint(0, 1 << 62, (2, q.shape[0], params.poly_modulus_degree)), q)
    want = ntt(x, cpu.ctx.tables)
    assert torch.equal(ntt(x.cuda(), gpu.ctx.tables).cpu(), want)
    assert torch.equal(intt(want.cuda(), gpu.ctx.tables).cpu(), x)


@pytest.mark.parametrize("shoup,batch", [(False, False), (True, False), (True, True)])
def test_every_operation_at_n8192(shoup, batch, monkeypatch):
    from fhe.backends.gpu import evaluator, keyswitch, triton_ops

    monkeypatch.setattr(triton_ops, "LAZY", batch)
    monkeypatch.setattr(triton_ops, "SKIP_DIAG", shoup)              # the expanded digits' rows [J, J] not transformed
    monkeypatch.setattr(keyswitch, "FUSED_CORRECTION", shoup)        # the hoisted correction inside the inner product
    monkeypatch.setattr(triton_ops, "FUSED_FINISH", shoup)           # rounding, NTT, subtract-scale in 2 launches
    monkeypatch.setattr(evaluator, "BATCH_SWITCHES", batch)          # rotate_many/rotate_each finished as batches
    monkeypatch.setattr(triton_ops, "STRIDED", shoup)
    monkeypatch.setattr(triton_ops, "SHOUP", shoup)
    monkeypatch.setattr(triton_ops, "FEWER", shoup)
    _check(CKKSParams(8192, (60, 40, 40, 60), 40), (1, 5, 4093))


@pytest.mark.parametrize("shoup,batch", [(False, False), (True, False), (True, True)])
def test_key_switching_at_the_shipped_parameters(shoup, batch, monkeypatch):
    from fhe.backends.gpu import evaluator, keyswitch, triton_ops

    monkeypatch.setattr(triton_ops, "LAZY", batch)
    monkeypatch.setattr(triton_ops, "SKIP_DIAG", shoup)              # the expanded digits' rows [J, J] not transformed
    monkeypatch.setattr(keyswitch, "FUSED_CORRECTION", shoup)        # the hoisted correction inside the inner product
    monkeypatch.setattr(triton_ops, "FUSED_FINISH", shoup)           # rounding, NTT, subtract-scale in 2 launches
    monkeypatch.setattr(evaluator, "BATCH_SWITCHES", batch)
    monkeypatch.setattr(triton_ops, "STRIDED", shoup)
    monkeypatch.setattr(triton_ops, "SHOUP", shoup)
    monkeypatch.setattr(triton_ops, "FEWER", shoup)
    _check(ckks_params_for("sqexp", 6), (1, 64))


@pytest.mark.parametrize("radix4", [False, True])
def test_two_stage_ntt_matches_the_torch_reference(radix4, monkeypatch):
    from fhe.backends.gpu import triton_ops

    monkeypatch.setattr(triton_ops, "RADIX4", radix4)
    params = ckks_params_for("sqexp", 6)
    cpu, gpu = GpuEvaluator(params, device="cpu"), GpuEvaluator(params, device="cuda")
    q = cpu.ctx.tables.primes
    x = torch.remainder(torch.randint(0, 1 << 62, (3, q.shape[0], params.poly_modulus_degree)), q)
    want = ntt(x, cpu.ctx.tables)
    assert torch.equal(ntt(x.cuda(), gpu.ctx.tables).cpu(), want)
    assert torch.equal(intt(want.cuda(), gpu.ctx.tables).cpu(), x)


def test_graphs_and_level_aware_keys_are_seals():
    """CUDA graphs on and off, level-aware keys: SEAL's residues at every level a key serves."""
    from fhe.backends.gpu.keys import key_set_nbytes
    from fhe.params import KeyLevels

    params = CKKSParams(8192, (60, 40, 40, 60), 40)
    levels = KeyLevels.build(params, {1: 3, 5: 2}, 2)
    client = CKKSClient(params, (1, 5), levels=levels)
    server, kit = client.server_keys(), client.kit
    x = client.encrypt(np.random.default_rng(2).uniform(-1, 1, params.slots))
    for graphs in (True, False):
        ev = GpuEvaluator(params, device="cuda", graphs=graphs)
        keys = ev.keys_from_server(server)
        assert keys.nbytes() == key_set_nbytes(params, levels)
        for level, step in ((3, 1), (2, 1), (2, 5), (1, 5), (2, 5)):            # repeated: a graph replayed
            a = kit.drop_to(x, level)
            sev, gk = server.rotation_key(step, level)
            want = seal.sa.Ciphertext()
            sev.rotate_vector(a, step, gk, want)
            A = ev.deserialize(seal.to_bytes(a))
            got = [ev.rotate(A, step, keys), ev.rotate_many(A, [step, 0], keys)[step]]
            raw = sealio.read_ciphertext(seal.to_bytes(want), params.poly_modulus_degree, ev.top)
            assert all(np.array_equal(ev.to_raw(g).data, raw.data) for g in got)
        c = kit.drop_to(kit.mul(x, x), 2)
        sev, rk = server.relin_key(2)
        want = seal.sa.Ciphertext()
        sev.relinearize(c, rk, want)
        X = ev.deserialize(seal.to_bytes(x))
        raw = sealio.read_ciphertext(seal.to_bytes(want), params.poly_modulus_degree, ev.top)
        assert np.array_equal(ev.to_raw(ev.relinearize(ev.mod_switch(ev.mul(X, X), 2), keys)).data, raw.data)
