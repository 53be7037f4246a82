"""Whole offload steps through :class:`fhe.backends.gpu.step.StepGraphs`: every output the one-session
evaluator's, residue for residue, with one key set for all rows or one per row (CPU reference here: the
eager batched path; on CUDA the captured graphs, the one-launch NTT and the merged inner product)."""

from __future__ import annotations

import pytest
import torch

from fhe.backends.gpu import GpuEvaluator
from fhe.backends.gpu.step import StepGraphs, bucket
from fhe.errors import KeyMismatchError, ShapeError
from fhe.mlp import MLP_PARAMS, EncryptedMLP
from tests.fhe.test_gpu_backend_batched import _sessions
from tests.fhe.test_mlp import _layer

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _fns(block: EncryptedMLP):
    def up(ev, x, k):
        return [ev.mod_switch(m(ev, x, k), 1) for m in block._enc_up]

    def down(ev, x, k):
        return ev.mod_switch(block._enc_down(ev, x, k), 1)

    return {"up": up, "down": down}


def _check(block: EncryptedMLP, sg: StepGraphs, count: int, seed: int) -> None:
    ev = block.ev
    keys, cts = _sessions(block, count, seed)
    for name, fn in _fns(block).items():
        for rows in (keys[0], keys):                                 # one key set (positions), one per row
            got = sg.run(name, fn, cts, rows)
            row_keys = [rows] * count if rows is keys[0] else keys
            want = [fn(ev, c, k) for c, k in zip(cts, row_keys, strict=True)]
            want = [w if isinstance(w, list) else [w] for w in want]
            assert [[ev.serialize(c) for c in g] for g in got] == [[ev.serialize(c) for c in w] for w in want]
            assert len({ev.serialize(g[0]) for g in got}) == count   # rows are not one input repeated


def test_steps_on_the_cpu_reference_are_the_one_session_results():
    block = EncryptedMLP(_layer(32, 48), MLP_PARAMS, evaluator=GpuEvaluator(MLP_PARAMS, "cpu"))
    sg = StepGraphs(block.ev)
    _check(block, sg, 2, 0)
    assert sg.replays == 0 and len(sg) == 0                          # no graphs off CUDA


def test_bucket_and_bad_batches():
    assert [bucket(n) for n in (1, 2, 3, 5, 8, 9, 32)] == [1, 2, 4, 8, 8, 16, 32]
    ev = GpuEvaluator(MLP_PARAMS, "cpu")
    block = EncryptedMLP(_layer(32, 48), MLP_PARAMS, evaluator=ev)
    keys, cts = _sessions(block, 2, 1)
    sg, fn = StepGraphs(ev), _fns(block)["down"]
    with pytest.raises(ShapeError):
        sg.run("down", fn, [], keys[0])
    with pytest.raises(ShapeError):
        sg.run("down", fn, cts, keys[:1])                            # 2 rows, 1 key set (as a list)


@cuda
def test_captured_steps_on_cuda_are_the_one_session_results():
    block = EncryptedMLP(_layer(576, 1536), MLP_PARAMS, evaluator=GpuEvaluator(MLP_PARAMS, "cuda"))
    sg = StepGraphs(block.ev)
    _check(block, sg, 3, 0)                                          # 3 rows: a padded batch of 4
    _check(block, sg, 3, 1)                                          # other sessions: the static keys refill
    _check(block, sg, 1, 2)
    assert sg.captures == len(sg) == 4 and sg.replays == 12           # (up, down) x (4, 1); shared/rows: one graph


@cuda
def test_mismatched_key_sets_are_refused_on_cuda():
    ev = GpuEvaluator(MLP_PARAMS, "cuda")
    block = EncryptedMLP(_layer(32, 48), MLP_PARAMS, evaluator=ev)
    keys, cts = _sessions(block, 2, 3)
    keys[1].galois.pop(next(iter(keys[1].galois)))
    with pytest.raises(KeyMismatchError):
        StepGraphs(ev).run("down", _fns(block)["down"], cts, keys)


@cuda
@pytest.mark.parametrize("fused", [False, True])
def test_fused_kernels_match_the_torch_reference(fused, monkeypatch):
    """The NTT's local stages in one launch, rescale's rounding in two, modular add/sub in one."""
    from fhe.backends.gpu import triton_ops
    from fhe.backends.gpu.ntt import intt, ntt

    monkeypatch.setattr(triton_ops, "FUSED", fused)
    cpu, gpu = GpuEvaluator(MLP_PARAMS, "cpu"), GpuEvaluator(MLP_PARAMS, "cuda")
    q = cpu.ctx.tables.primes
    x = torch.remainder(torch.randint(0, 1 << 62, (5, q.shape[0], MLP_PARAMS.poly_modulus_degree)), q)
    want = ntt(x, cpu.ctx.tables)
    assert torch.equal(ntt(x.cuda(), gpu.ctx.tables).cpu(), want)
    assert torch.equal(intt(want.cuda(), gpu.ctx.tables).cpu(), x)
    from fhe.backends.gpu.modarith import addmod, submod
    from fhe.backends.gpu.rns import drop_last_rounded

    lc, lg = cpu.ctx.level(2), gpu.ctx.level(2)                      # rescale's / key switching's rounding
    y = torch.remainder(torch.randint(0, 1 << 62, (4, 2, 3, x.shape[-1])), lc.ext.primes)
    args = lambda lt: (lt.data, lt.special, lt.inv_p, lt.q_ext_ints[-1])  # noqa: E731
    assert torch.equal(drop_last_rounded(y.cuda(), *args(lg)).cpu(), drop_last_rounded(y, *args(lc)))
    a, b = y[:, :, :2], y.flip(0)[:, :, :2].contiguous()
    for op in (addmod, submod):                                      # a strided view and a contiguous one
        assert torch.equal(op(a.cuda(), b.cuda(), lg.data.primes).cpu(), op(a, b, lc.data.primes))


@cuda
def test_inner_product_batch_axis_shared_key_and_permutation():
    """One kernel: a row alone, a batch (own keys or one key at stride 0), permuted digits: the torch sums."""
    from fhe.backends.gpu import keyswitch as ks
    from fhe.backends.gpu import triton_ops

    ev = GpuEvaluator(MLP_PARAMS, "cpu")
    lev = ev.top
    lt, n = ev.ctx.level(lev), MLP_PARAMS.poly_modulus_degree
    q = lt.ext.primes
    g = torch.Generator().manual_seed(5)
    D = torch.remainder(torch.randint(0, 1 << 62, (3, lev, lev + 1, n), generator=g), q)
    key = torch.remainder(torch.randint(0, 1 << 62, (3, lev, 2, lev + 1, n), generator=g), q)
    perm = torch.randperm(n, generator=g)
    want = [ks.inner_product(D[b], key[b], lt) for b in range(3)]
    qs = q.view(-1).contiguous().cuda()
    got = triton_ops.inner_product(D.cuda(), key.cuda(), qs).cpu()
    assert all(torch.equal(got[b], want[b]) for b in range(3))
    assert torch.equal(triton_ops.inner_product(D[1].cuda(), key[1].cuda(), qs).cpu(), want[1])
    shared = triton_ops.inner_product(D.cuda(), key[2].cuda().expand(3, *key.shape[1:]), qs).cpu()
    assert all(torch.equal(shared[b], ks.inner_product(D[b], key[2], lt)) for b in range(3))
    permuted = triton_ops.inner_product(D[0].cuda(), key[0].cuda(), qs, perm.cuda()).cpu()
    assert torch.equal(permuted, ks.inner_product(D[0][..., perm], key[0], lt))
