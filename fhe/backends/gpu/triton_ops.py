"""Triton kernels for the CUDA path: NTT/INTT stages, row-wise mulmod, the key-switching inner product.

Each kernel has a typed launcher below that checks dtypes, shapes and contiguity and picks the grid;
the torch functions of :mod:`fhe.backends.gpu.ntt`, :mod:`fhe.backends.gpu.modarith` and
:mod:`fhe.backends.gpu.keyswitch` are the references (and dispatch here for CUDA tensors).

Layout: data ``[..., P, N]`` int64 contiguous, seen as ``rows = numel / N`` rows; row r is reduced
modulo prime ``q[r % P]``. The modular product is the torch reference's (float64 quotient estimate on
30-bit halves, exact after one correction each way), in registers: no 128-bit constants needed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024
#: Two NTT stages per launch (:func:`_ntt_stage2`); False: one per launch (the first version).
RADIX4 = False
#: All stages of a row's (I)NTT in one launch (:func:`_ntt_row`) for N <= FUSED_MAX_N (issue 17: at the
#: offload plan's N = 8192 a key switch was ~85 launches of a few microseconds, 52 of them NTT stages).
FUSED = True
FUSED_MAX_N = 8192
FUSED_WARPS = 8


@triton.jit
def _mulmod_small(a, s, q, qinv):
    est = tl.floor(a.to(tl.float64) * s.to(tl.float64) * qinv).to(tl.int64)
    r = a * s - est * q
    r = tl.where(r < 0, r + q, r)
    return tl.where(r >= q, r - q, r)


@triton.jit
def _mulmod(a, b, q, qinv):
    hi = _mulmod_small(a, b >> 30, q, qinv)
    hi = _mulmod_small(hi, tl.full(hi.shape, 1 << 30, tl.int64), q, qinv)
    lo = _mulmod_small(a, b & ((1 << 30) - 1), q, qinv)
    s = hi + lo
    return tl.where(s >= q, s - q, s)


@triton.jit
def _ntt_stage(x_ptr, w_ptr, q_ptr, P, N, m, gap, INVERSE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(1)
    p = row % P
    q = tl.load(q_ptr + p)
    qinv = 1.0 / q.to(tl.float64)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)          # butterfly index in [0, N/2)
    mask = offs < N // 2
    i = offs // gap
    idx = i * 2 * gap + offs % gap
    base = x_ptr + row.to(tl.int64) * N
    u = tl.load(base + idx, mask=mask)
    v = tl.load(base + idx + gap, mask=mask)
    w = tl.load(w_ptr + p.to(tl.int64) * N + m + i, mask=mask)
    if INVERSE:                                                      # Gentleman-Sande
        s = u + v
        s = tl.where(s >= q, s - q, s)
        d = u - v
        d = tl.where(d < 0, d + q, d)
        d = _mulmod(d, w, q, qinv)
    else:                                                            # Cooley-Tukey (Harvey's order)
        t = _mulmod(v, w, q, qinv)
        s = u + t
        s = tl.where(s >= q, s - q, s)
        d = u - t
        d = tl.where(d < 0, d + q, d)
    tl.store(base + idx, s, mask=mask)
    tl.store(base + idx + gap, d, mask=mask)


@triton.jit
def _ct(u, v, w, q, qinv):
    """Cooley-Tukey butterfly (u + w v, u - w v)."""
    t = _mulmod(v, w, q, qinv)
    s = u + t
    d = u - t
    return tl.where(s >= q, s - q, s), tl.where(d < 0, d + q, d)


@triton.jit
def _gs(u, v, w, q, qinv):
    """Gentleman-Sande butterfly (u + v, (u - v) w)."""
    s = u + v
    d = u - v
    d = tl.where(d < 0, d + q, d)
    return tl.where(s >= q, s - q, s), _mulmod(d, w, q, qinv)


@triton.jit
def _ntt_stage2(x_ptr, w_ptr, q_ptr, P, N, m, gap, INVERSE: tl.constexpr, BLOCK: tl.constexpr):
    """Two radix-2 stages in one pass (half the launches and the memory traffic of :func:`_ntt_stage`).

    Forward: stage (m, gap) then (2m, gap/2); inverse: stage (m, gap) then (m/2, 2 gap). Each program
    element owns the 4 values both stages touch together.
    """
    row = tl.program_id(1)
    p = row % P
    q = tl.load(q_ptr + p)
    qinv = 1.0 / q.to(tl.float64)
    g = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)            # group index in [0, N/4)
    mask = g < N // 4
    base_ptr = x_ptr + row.to(tl.int64) * N
    wrow = w_ptr + p.to(tl.int64) * N
    if INVERSE:
        i2 = g // gap
        base = i2 * 4 * gap + g % gap
        h = gap
        a0 = tl.load(base_ptr + base, mask=mask)
        a1 = tl.load(base_ptr + base + h, mask=mask)
        a2 = tl.load(base_ptr + base + 2 * h, mask=mask)
        a3 = tl.load(base_ptr + base + 3 * h, mask=mask)
        a0, a1 = _gs(a0, a1, tl.load(wrow + m + 2 * i2, mask=mask), q, qinv)
        a2, a3 = _gs(a2, a3, tl.load(wrow + m + 2 * i2 + 1, mask=mask), q, qinv)
        w2 = tl.load(wrow + m // 2 + i2, mask=mask)
        a0, a2 = _gs(a0, a2, w2, q, qinv)
        a1, a3 = _gs(a1, a3, w2, q, qinv)
    else:
        half = gap // 2
        i = g // half
        base = i * 2 * gap + g % half
        h = half
        a0 = tl.load(base_ptr + base, mask=mask)
        a1 = tl.load(base_ptr + base + h, mask=mask)
        a2 = tl.load(base_ptr + base + 2 * h, mask=mask)
        a3 = tl.load(base_ptr + base + 3 * h, mask=mask)
        w1 = tl.load(wrow + m + i, mask=mask)
        a0, a2 = _ct(a0, a2, w1, q, qinv)
        a1, a3 = _ct(a1, a3, w1, q, qinv)
        a0, a1 = _ct(a0, a1, tl.load(wrow + 2 * m + 2 * i, mask=mask), q, qinv)
        a2, a3 = _ct(a2, a3, tl.load(wrow + 2 * m + 2 * i + 1, mask=mask), q, qinv)
    tl.store(base_ptr + base, a0, mask=mask)
    tl.store(base_ptr + base + h, a1, mask=mask)
    tl.store(base_ptr + base + 2 * h, a2, mask=mask)
    tl.store(base_ptr + base + 3 * h, a3, mask=mask)


@triton.jit
def _ntt_row(x_ptr, w_ptr, q_ptr, ninv_ptr, P, LOGN: tl.constexpr, INVERSE: tl.constexpr,
             SCALE: tl.constexpr, HALF: tl.constexpr):
    """Every stage of one row's transform in one program (N = 2 HALF <= :data:`FUSED_MAX_N`): the stages of
    :func:`_ntt_stage` in order, the row staying in the cache between them, a CTA barrier after each
    (each stage's butterflies touch disjoint pairs, so one barrier orders it before the next). The
    inverse with SCALE multiplies by N^-1 at the end (what :func:`mulmod_rows` does after the staged one)."""
    row = tl.program_id(0)
    p = row % P
    q = tl.load(q_ptr + p)
    qinv = 1.0 / q.to(tl.float64)
    offs = tl.arange(0, HALF)                                        # butterfly index in [0, N/2)
    base = x_ptr + row.to(tl.int64) * (2 * HALF)
    wrow = w_ptr + p.to(tl.int64) * (2 * HALF)
    for t in range(LOGN):
        if INVERSE:                                                  # stages (m, gap) from m = N/2 down
            s = LOGN - 1 - t
        else:
            s = t
        sh = LOGN - 1 - s                                            # gap = N >> (s + 1) = 2^sh
        i = offs >> sh
        idx = (i << (sh + 1)) + (offs & ((1 << sh) - 1))
        u = tl.load(base + idx)
        v = tl.load(base + idx + (1 << sh))
        w = tl.load(wrow + (1 << s) + i)
        if INVERSE:
            a, b = _gs(u, v, w, q, qinv)
        else:
            a, b = _ct(u, v, w, q, qinv)
        tl.store(base + idx, a)
        tl.store(base + idx + (1 << sh), b)
        tl.debug_barrier()
    if SCALE:
        ninv = tl.load(ninv_ptr + p)
        lo = tl.load(base + offs)
        hi = tl.load(base + HALF + offs)
        tl.store(base + offs, _mulmod(lo, tl.full(lo.shape, 0, tl.int64) + ninv, q, qinv))
        tl.store(base + HALF + offs, _mulmod(hi, tl.full(hi.shape, 0, tl.int64) + ninv, q, qinv))


@triton.jit
def _mulmod_rows(a_ptr, b_ptr, out_ptr, q_ptr, P, N, B_SCALAR: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(1)
    p = row % P
    q = tl.load(q_ptr + p)
    qinv = 1.0 / q.to(tl.float64)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    a = tl.load(a_ptr + row.to(tl.int64) * N + offs, mask=mask)
    if B_SCALAR:
        b = tl.load(b_ptr + p)
    else:
        b = tl.load(b_ptr + row.to(tl.int64) * N + offs, mask=mask)
    tl.store(out_ptr + row.to(tl.int64) * N + offs, _mulmod(a, b, q, qinv), mask=mask)


@triton.jit
def _inner_product(d_ptr, perm_ptr, key_ptr, q_ptr, out_ptr, L, R, K1, N, D_STRIDE, KEY_STRIDE,
                   PERMUTE: tl.constexpr, BLOCK: tl.constexpr):
    """out[b, c, r] = sum_J D[b, J, r, perm] * key[b, J, c, krow(r)] mod q_r; krow = r, or K (special) for
    r = L. Program axis 2 = b * 2 + c: row b of a batch (its digits at ``D_STRIDE``, its key at
    ``KEY_STRIDE``, 0 when the rows share one key); one row is the batch of one. The same products and
    reductions in the same order for every row, so a row's result does not depend on the batch."""
    r = tl.program_id(1)
    b = tl.program_id(2) // 2
    c = tl.program_id(2) % 2
    q = tl.load(q_ptr + r)
    qinv = 1.0 / q.to(tl.float64)
    krow = tl.where(r == L, K1 - 1, r)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    if PERMUTE:
        src = tl.load(perm_ptr + offs, mask=mask)
    else:
        src = offs
    d_base = d_ptr + b.to(tl.int64) * D_STRIDE
    k_base = key_ptr + b.to(tl.int64) * KEY_STRIDE
    acc = tl.zeros((BLOCK,), tl.int64)
    for j in range(L):
        d = tl.load(d_base + (j * R + r).to(tl.int64) * N + src, mask=mask)
        k = tl.load(k_base + ((j * 2 + c) * K1 + krow).to(tl.int64) * N + offs, mask=mask)
        acc += _mulmod(d, k, q, qinv)
        acc = tl.where(acc >= q, acc - q, acc)
    tl.store(out_ptr + ((b * 2 + c) * R + r).to(tl.int64) * N + offs, acc, mask=mask)


@triton.jit
def _dot_rows(c_ptr, p_ptr, q_ptr, out_ptr, K, R, L, N, MUL: tl.constexpr, BLOCK: tl.constexpr):
    """out[r] = sum_j c[j, r] (* p[j, r % L] if MUL) mod q_(r % L): a dot product (or sum) of K operands
    in one pass, instead of K products and K-1 additions each a launch of its own."""
    r = tl.program_id(1)
    i = r % L
    q = tl.load(q_ptr + i)
    qinv = 1.0 / q.to(tl.float64)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    acc = tl.zeros((BLOCK,), tl.int64)
    for j in range(K):
        a = tl.load(c_ptr + (j * R + r).to(tl.int64) * N + offs, mask=mask)
        if MUL:
            a = _mulmod(a, tl.load(p_ptr + (j * L + i).to(tl.int64) * N + offs, mask=mask), q, qinv)
        acc += a
        acc = tl.where(acc >= q, acc - q, acc)
    tl.store(out_ptr + r.to(tl.int64) * N + offs, acc, mask=mask)


def dot_rows(c: torch.Tensor, p: torch.Tensor | None, primes: torch.Tensor) -> torch.Tensor:
    """``c [K, S, L, N]``, ``p [K, L, N]`` or None -> ``sum_j c[j] * p[j]`` (or ``sum_j c[j]``) ``[S, L, N]``."""
    _check(c, "operands")
    k, size, lev, n = c.shape
    assert primes.numel() >= lev, (c.shape, primes.shape)
    if p is not None:
        _check(p, "plaintexts")
        assert p.shape == (k, lev, n), (c.shape, p.shape)
    out = torch.empty((size, lev, n), dtype=torch.int64, device=c.device)
    _dot_rows[(triton.cdiv(n, BLOCK), size * lev)](c, c if p is None else p, primes, out, k, size * lev, lev, n,
                                                   MUL=p is not None, BLOCK=BLOCK)
    return out


def _check(x: torch.Tensor, what: str) -> None:
    assert x.is_cuda and x.dtype == torch.int64 and x.is_contiguous(), f"{what}: need contiguous CUDA int64"


def ntt_(x: torch.Tensor, roots: torch.Tensor, primes: torch.Tensor, inverse: bool,
         n_inv: torch.Tensor | None = None) -> torch.Tensor:
    """In-place (I)NTT butterflies of ``x [..., P, N]``; ``roots [P, N]`` (inverse roots if ``inverse``).

    ``n_inv [P]`` (inverse only): also multiply by N^-1 (else the caller does, :func:`mulmod_rows`). Rows of
    N <= :data:`FUSED_MAX_N` take one launch for all stages (:func:`_ntt_row`) when :data:`FUSED`.
    """
    _check(x, "ntt")
    p, n = roots.shape
    assert x.shape[-2:] == (p, n) and primes.numel() == p, (x.shape, roots.shape)
    assert n_inv is None or (inverse and n_inv.numel() == p and n_inv.is_contiguous()), "n_inv"
    rows = x.numel() // n
    if FUSED and n <= FUSED_MAX_N:
        scale = n_inv is not None
        _ntt_row[(rows,)](x, roots, primes, n_inv if scale else primes, p, LOGN=n.bit_length() - 1,
                          INVERSE=inverse, SCALE=scale, HALF=n // 2, num_warps=FUSED_WARPS)
        return x
    _ntt_staged(x, roots, primes, inverse, p, n, rows)
    return x if n_inv is None else mulmod_rows(x, n_inv, primes)


def _ntt_staged(x, roots, primes, inverse, p, n, rows) -> None:
    grid = (triton.cdiv(n // 2, BLOCK), rows)
    stages = [(1 << s, n >> (s + 1)) for s in range(n.bit_length() - 1)]
    order = list(reversed(stages)) if inverse else stages
    if RADIX4:
        grid4 = (triton.cdiv(n // 4, BLOCK), rows)
        while len(order) >= 2:                                       # two stages per pass
            m, gap = order[0]
            _ntt_stage2[grid4](x, roots, primes, p, n, m, gap, INVERSE=inverse, BLOCK=BLOCK)
            order = order[2:]
    for m, gap in order:
        _ntt_stage[grid](x, roots, primes, p, n, m, gap, INVERSE=inverse, BLOCK=BLOCK)


def mulmod_rows(a: torch.Tensor, b: torch.Tensor, primes: torch.Tensor) -> torch.Tensor:
    """a * b mod q_row for ``a [..., P, N]`` and ``b`` of a's shape, or ``b [P]`` (one scalar per prime)."""
    _check(a, "mulmod a")
    _check(b, "mulmod b")
    p, n = a.shape[-2], a.shape[-1]
    scalar = b.shape != a.shape
    assert (not scalar or b.numel() == p) and primes.numel() == p, (a.shape, b.shape, primes.shape)
    out = torch.empty_like(a)
    _mulmod_rows[(triton.cdiv(n, BLOCK), a.numel() // n)](a, b, out, primes, p, n, B_SCALAR=scalar, BLOCK=BLOCK)
    return out


def inner_product(D: torch.Tensor, key: torch.Tensor, primes: torch.Tensor,
                  perm: torch.Tensor | None = None) -> torch.Tensor:
    """``D [L, L+1, N]`` (digits in every ext prime), ``key [K, 2, K+1, N]`` -> ``[2, L+1, N]``; or a batch:
    ``D [B, L, L+1, N]``, ``key [B, K, 2, K+1, N]`` (row b's key for row b's digits; a batch axis of stride
    0, ``key.expand(B, ...)``, shares one key) -> ``[B, 2, L+1, N]``. ``perm [N]``: read the digits
    through this slot permutation (a hoisted rotation)."""
    batched = D.dim() == 4
    Db, kb = (D, key) if batched else (D[None], key[None])
    _check(Db, "digits")
    assert key.dtype == torch.int64 and key.is_cuda and key[(0,) * (key.dim() - 4)].is_contiguous(), "key"
    b, lev, r, n = Db.shape
    assert r == lev + 1 and kb.shape[0] == b and kb.shape[1] >= lev and kb.shape[2] == 2, (D.shape, key.shape)
    assert kb.shape[4] == n and primes.numel() == r, (D.shape, key.shape, primes.shape)
    out = torch.empty((b, 2, r, n), dtype=torch.int64, device=D.device)
    src = perm if perm is not None else Db
    _inner_product[(triton.cdiv(n, BLOCK), r, 2 * b)](Db, src, kb, primes, out, lev, r, kb.shape[3], n,
                                                      lev * r * n, kb.stride(0), PERMUTE=perm is not None,
                                                      BLOCK=BLOCK)
    return out if batched else out[0]


__all__ = ["dot_rows", "inner_product", "mulmod_rows", "ntt_"]
