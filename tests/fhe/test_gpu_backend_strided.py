"""The one-launch staged NTT stages (``triton_ops._ntt_strided``, issue 16 session 18) and the lazy butterflies
(session 19) on the CPU (CI).

The Triton kernels themselves run here under Triton's interpreter (``TRITON_INTERPRET=1``, on CPU tensors, in a
subprocess: the variable is read when the kernels are defined), forward and inverse, with Shoup's products and
without, N^-1 folded into the last stage and not, and must give the torch reference's residues
(:func:`fhe.backends.gpu.ntt.ntt` / :func:`~fhe.backends.gpu.ntt.intt`) and the per-stage launches'
(``STRIDED = False``); likewise with Harvey's lazy butterflies (``LAZY``, session 19: non-canonical values
between stages). Small
``LOCAL`` blocks give more strided stages than the shipped N would (4 and 2 here, 5 at N = 32768). The sizes are
small (N = 512 and 256 with LOCAL = 32 and 64; 256 with 32 for the digits): what the kernels do per stage does not
depend on N, only how many stages are strided and local and how many column programs a row takes (2 and 1 here, as
at N = 2048 / LOCAL = 128 with 512 butterflies per program, the sizes these ran at until session 22: 4x the
interpreter's time).
On the GPU: tests/fhe/test_gpu_backend_cuda.py (the shipped size, the CUDA kernels).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

_SCRIPT = textwrap.dedent("""
    import itertools, torch
    from fhe.backends.gpu import triton_ops as T
    from fhe.backends.gpu.ntt import NTTTables, intt, ntt
    T._check = lambda *a, **k: None                       # the launchers assert CUDA tensors
    launches = []
    class Count:
        def __init__(self, kernel):
            self.kernel = kernel
        def __getitem__(self, grid):
            launches.append(grid)
            return self.kernel[grid]
    T._ntt_strided = Count(T._ntt_strided)
    T.STRIDED_BUTTERFLIES = 128                           # 2 column programs per row at n = 512 (as 512 at 2048)
    for n, local in ((512, 32), (256, 64)):
        T.LOCAL = local
        tab = NTTTables.build([1152921504606584833, 1125899906826241, 1125899906629633], n)
        x = torch.remainder(torch.randint(0, 1 << 62, (2, 3, n), generator=torch.Generator().manual_seed(n)),
                            tab.primes)
        want = ntt(x, tab)
        assert torch.equal(intt(want, tab), x)
        combos = [(*sf, True, False) for sf in itertools.product((False, True), repeat=2)]
        combos += [(True, True, False, False)]
        combos += [(True, True, True, True), (True, False, True, True)]     # Harvey's lazy butterflies
        for shoup, fewer, strided, lazy in combos:
            T.SHOUP, T.FEWER, T.STRIDED, T.LAZY = shoup, fewer, strided, lazy
            before = len(launches)
            fwd = T.ntt_(x.clone(), tab.roots, tab.primes.view(-1), inverse=False, roots_shoup=tab.roots_shoup)
            inv = T.ntt_(want.clone(), tab.inv_roots, tab.primes.view(-1), inverse=True,
                         n_inv=tab.n_inv.view(-1).contiguous(), roots_shoup=tab.inv_roots_shoup)
            assert torch.equal(fwd, want), (n, shoup, fewer, strided, lazy)
            assert torch.equal(inv, x), (n, shoup, fewer, strided, lazy)
            assert len(launches) - before == (2 if strided else 0), launches
    T.LOCAL, T.LAZY = 64, True                            # N = LOCAL: the local kernel alone, lazy and canonical
    tab = NTTTables.build([1152921504606584833, 1125899906826241], 64)
    x = torch.remainder(torch.randint(0, 1 << 62, (2, 2, 64), generator=torch.Generator().manual_seed(1)), tab.primes)
    want = ntt(x, tab)
    fwd = T.ntt_(x.clone(), tab.roots, tab.primes.view(-1), inverse=False, roots_shoup=tab.roots_shoup)
    assert torch.equal(fwd, want)
    assert torch.equal(T.ntt_(want.clone(), tab.inv_roots, tab.primes.view(-1), inverse=True,
                              n_inv=tab.n_inv.view(-1).contiguous(), roots_shoup=tab.inv_roots_shoup), x)
    print("ok", len(launches))
""")

_DIAG = textwrap.dedent("""
    import itertools, torch
    from fhe.backends.gpu import triton_ops as T
    from fhe.backends.gpu.ntt import NTTTables, intt, ntt
    T._check = lambda *a, **k: None                       # the launchers assert CUDA tensors
    n = 256
    T.LOCAL = 32                                          # 3 strided stages, as n = 1024 with LOCAL = 128
    primes = [1152921504606584833, 1125899906826241, 1125899906629633, 1152921504606748673]  # 3 data, special
    ext = NTTTables.build(primes[:3] + primes[3:], n)
    data = ext.take(slice(0, 3))
    for lazy, lead in itertools.product((False, True), ((), (2,))):
        T.LAZY = lazy
        g = torch.Generator().manual_seed(len(lead) * 2 + lazy)
        t = torch.remainder(torch.randint(0, 1 << 62, (*lead, 3, n), generator=g), data.primes)   # [.., L, N] NTT form
        d = intt(t, data)
        want = ntt(torch.remainder(d.unsqueeze(-2), ext.primes), ext)                          # [.., L, L+1, N]
        assert T.skips_diag(n)
        got = T.expand_digits(d.contiguous(), t.contiguous(), ext.primes.view(-1).contiguous())
        got = T.ntt_(got, ext.roots, ext.primes.view(-1), inverse=False, roots_shoup=ext.roots_shoup, skip_diag=True)
        assert torch.equal(got, want), (lazy, lead)
    # the inner product with a hoisted rotation's correction as its starting value, written into a batch's row
    from types import SimpleNamespace
    from fhe.backends.gpu import keyswitch as ks
    lt = SimpleNamespace(ext=ext)
    g = torch.Generator().manual_seed(7)
    q = ext.primes
    D = torch.remainder(torch.randint(0, 1 << 62, (3, 4, n), generator=g), q)               # [L, L+1, N]
    key = torch.randint(0, 1 << 62, (3, 2, 4, n), generator=g) % q                           # [K, 2, K+1, N]
    corr = torch.remainder(torch.randint(0, 1 << 62, (2, 4, n), generator=g), q)
    perm = torch.randperm(n, generator=g)
    want = ks.addmod(ks.inner_product(D[..., perm], key, lt), corr, q)
    out = torch.full((2, 2, 4, n), -1, dtype=torch.int64)
    got = T.inner_product(D, key, q.view(-1).contiguous(), perm, add=corr, out=out[1])
    assert torch.equal(got, want) and torch.equal(out[1], want) and bool((out[0] == -1).all())
    assert torch.equal(T.inner_product(D, key, q.view(-1).contiguous()), ks.inner_product(D, key, lt))
    # the finish in two launches: the rounded tail as the strided kernel's input, (x - y) / q_last in the local one
    from fhe.backends.gpu.rns import drop_last_rounded
    keep, last = ext.take(slice(0, 3)), ext.take(slice(3, 4))
    ql = primes[3]
    inv = torch.tensor([pow(ql, -1, qq) for qq in primes[:3]], dtype=torch.int64).view(-1, 1)
    for lazy, shoup, lead in itertools.product((False, True), (False, True), ((), (2,))):
        if lazy and not shoup:
            continue
        T.LAZY, T.SHOUP = lazy, shoup
        g = torch.Generator().manual_seed(11 + len(lead))
        x = torch.remainder(torch.randint(0, 1 << 62, (*lead, 4, n), generator=g), ext.primes)     # [.., R+1, N]
        want = drop_last_rounded(x, keep, last, inv, ql)
        tail = intt(x[..., -1:, :], last)
        assert T.fuses_finish(n)
        got = T.rounded_ntt_sub_scale(x.contiguous(), tail.contiguous(), keep.roots, keep.roots_shoup,
                                      keep.primes.view(-1).contiguous(), inv.view(-1).contiguous(), ql)
        assert torch.equal(got, want), (lazy, shoup, lead)
    print("ok")
""")


def test_strided_stages_kernel_matches_the_torch_reference_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split() == ["ok", "24"]


def test_expanded_digits_skip_their_diagonal_rows_under_the_interpreter():
    """Session 20 (``triton_ops.SKIP_DIAG``): the digits reduced into the ext primes with row [J, J] = the input's
    row J, then the NTT of the other rows, = reducing and transforming every row (the torch reference), one
    decomposition and a batch of two, with the lazy butterflies and without; 60- and 50-bit primes, so the reduction
    of a larger prime's digit into a smaller prime is exercised. And the inner product with a hoisted rotation's
    correction added in the kernel (``keyswitch.FUSED_CORRECTION``), written into a batch's row: = adding after. And
    the rescale's / key switch's finish in the NTT's two launches (``FUSED_FINISH``) = ``drop_last_rounded``'s torch
    reference, a 60-bit last prime over 50- and 60-bit kept ones."""
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-c", _DIAG], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split() == ["ok"]
