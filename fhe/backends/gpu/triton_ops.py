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
#: The stages of a transform local to blocks of LOCAL values in one launch (:func:`_ntt_local`), the
#: others staged (issue 17: at the offload plan's N = 8192 a key switch was ~85 launches of a few
#: microseconds, 52 of them NTT stages; now 3 + 1 per transform). False: every stage its own launch.
FUSED = True
LOCAL = 1024
#: warps per program of :func:`_ntt_local` and :func:`_ntt_strided` (issue 16, session 20: 4 -> 8 took the decode step
#: at context 128 from 49.3 to 47.0 ms on an H100, interleaved in one run, the same outputs; docs/benchmarks.md)
LOCAL_WARPS = 8
#: NTT twiddle products by Shoup's method (the tables' precomputed floor(w 2^64 / q): one 64-bit high product
#: and two wrapping ones) instead of :func:`_mulmod`'s three float64-estimated 30-bit partial products (issue
#: 16). Both give the canonical residue, so the transforms are the same bit for bit. Measured on an H100: 6-14 %
#: off the NTT kernels' device time (they are bound by memory and latency more than by this arithmetic), a
#: rotation 10 % faster. False: the first version.
SHOUP = True
#: Fewer passes per transform (issue 16): an INTT's N^-1 is multiplied in its last butterfly stage instead of a
#: kernel of its own, and :func:`fhe.backends.gpu.ntt.ntt` of a temporary (the key switch's expanded digits,
#: the rounding's tail) transforms it in place instead of copying it first. The same residues. False: as before.
FEWER = True
#: The staged stages of a transform (those whose butterflies span more than a :data:`LOCAL` block: 5 at N = 32768,
#: 3 at N = 8192) in one launch instead of one each (issue 16, session 18: a decode step was ~9,500 kernels,
#: 5 staged launches per transform, 4 transforms per key switch): :func:`_ntt_strided`. Their butterflies only
#: pair values whose index differs by a multiple of ``N / 2^S0 = LOCAL``, so the ``2^S0`` values of one column
#: ``j`` of the ``[2^S0, LOCAL]`` view stay inside one program through all of them. The same butterflies on the
#: same values, so the same residues. False: one launch per stage (:func:`_ntt_staged`).
STRIDED = True
#: butterflies per program of :func:`_ntt_strided` (columns per program = this / 2^(S0-1))
STRIDED_BUTTERFLIES = 512
#: Harvey's lazy butterflies in :func:`_ntt_local` and :func:`_ntt_strided` (with :data:`SHOUP` and :data:`STRIDED`):
#: values stay in [0, 4q) forward and [0, 2q) inverse between stages (Shoup's product without its correction, one
#: compare-and-subtract per butterfly instead of three) and are made canonical in the transform's last stage.
#: Canonical outputs, so the same residues (interpreter-checked in CI; on an H100 every operation = SEAL with it on).
#: Measured in session 20 (H100, three variants in turn): the decode step 52.47 -> 52.21 ms at context 128, 39.94 ->
#: 38.66 at 16, 100.17 -> 100.44 at 512, all inside the run's spread; kernels 41.96 -> 41.75 ms (the strided stages
#: -4 %, the local ones +1 %): the compare-and-selects were not what the NTT kernels wait on either. On: never slower
#: where it counts, and every other figure of that call was measured with it on.
LAZY = True
#: Key switching's expanded digits (issue 16, session 20): the rows ``[J, J]`` (digit J in its own prime) are the
#: input polynomial's row J as it is, NTT_J(INTT_J(t_J)) = t_J, which SEAL's ``switch_key_inplace`` uses instead of
#: transforming (CKKS, ``I == J``); so :func:`expand_digits` copies them and :func:`ntt_` (``skip_diag``) transforms
#: the other L of each digit's L + 1 rows: 144 instead of 156 row transforms per decomposition at the top level
#: (12 primes). The reduction into the ext primes moves from torch's int64 remainder into the same launch (a float64
#: quotient estimate). The same residues. False: reduce and transform all rows (before session 20). With
#: :data:`FUSED_FINISH` (H100, session 20): the decode step at context 128 58.45 -> 52.47 ms, 5,354 -> 4,792 kernels,
#: 47.16 -> 41.96 ms of kernels, the same outputs.
SKIP_DIAG = True
#: The finish of a key switch and a rescale (``rns.drop_last_rounded``) in two launches instead of four (issue 16,
#: session 20): the strided NTT kernel reads the last prime's coefficients through :func:`_round_tail`'s rounding as
#: its first stage's inputs, and the local kernel's last stage subtracts from x and multiplies by q_last^-1
#: (:func:`_sub_scale`) before it stores: :func:`rounded_ntt_sub_scale`. ~280 such finishes in a decode step at
#: context 128 (measured: 562 kernels fewer, exactly two per finish). The same residues. False: round_tail, the NTT,
#: sub_scale (before session 20).
FUSED_FINISH = True


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
def _mulmod_shoup(a, w, ws, q):
    """a w mod q for a < 2^63, w < q < 2^62 and ws = floor(w 2^64 / q) (uint64 bits in an int64): the
    quotient estimate umulhi(a, ws) is floor(a w / q) or one less, so a w - est q (wrapping) is in [0, 2q)."""
    r = a * w - tl.umulhi(a, ws) * q
    return tl.where(r >= q, r - q, r)


@triton.jit
def _twiddle(v, w, ws, q, qinv, SHOUP: tl.constexpr):
    """v w mod q: Shoup's product with the table's companion ``ws``, or :func:`_mulmod`."""
    if SHOUP:
        return _mulmod_shoup(v, w, ws, q)
    return _mulmod(v, w, q, qinv)


@triton.jit
def _ntt_stage(x_ptr, w_ptr, ws_ptr, ninv_ptr, q_ptr, P, N, m, gap, INVERSE: tl.constexpr, SHOUP: tl.constexpr,
               SCALE: tl.constexpr, BLOCK: tl.constexpr):
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
    ws = w
    if SHOUP:
        ws = tl.load(ws_ptr + p.to(tl.int64) * N + m + i, mask=mask)
    if INVERSE:                                                      # Gentleman-Sande
        s = u + v
        s = tl.where(s >= q, s - q, s)
        d = u - v
        d = tl.where(d < 0, d + q, d)
        d = _twiddle(d, w, ws, q, qinv, SHOUP)
        if SCALE:                                                    # the INTT's last stage: times N^-1 too
            ni = tl.load(ninv_ptr + p) + tl.zeros((BLOCK,), tl.int64)
            s = _mulmod(s, ni, q, qinv)
            d = _mulmod(d, ni, q, qinv)
    else:                                                            # Cooley-Tukey (Harvey's order)
        t = _twiddle(v, w, ws, q, qinv, SHOUP)
        s = u + t
        s = tl.where(s >= q, s - q, s)
        d = u - t
        d = tl.where(d < 0, d + q, d)
    tl.store(base + idx, s, mask=mask)
    tl.store(base + idx + gap, d, mask=mask)


@triton.jit
def _ct(u, v, w, q, qinv, ws, SHOUP: tl.constexpr):
    """Cooley-Tukey butterfly (u + w v, u - w v)."""
    t = _twiddle(v, w, ws, q, qinv, SHOUP)
    s = u + t
    d = u - t
    return tl.where(s >= q, s - q, s), tl.where(d < 0, d + q, d)


@triton.jit
def _gs(u, v, w, q, qinv, ws, SHOUP: tl.constexpr):
    """Gentleman-Sande butterfly (u + v, (u - v) w)."""
    s = u + v
    d = u - v
    d = tl.where(d < 0, d + q, d)
    return tl.where(s >= q, s - q, s), _twiddle(d, w, ws, q, qinv, SHOUP)


@triton.jit
def _shoup_lazy(a, w, ws, q):
    """:func:`_mulmod_shoup` without its last correction: a w mod q in [0, 2q), for any a < 2^63."""
    return a * w - tl.umulhi(a, ws) * q


@triton.jit
def _ct_lazy(u, v, w, ws, q):
    """Harvey's Cooley-Tukey butterfly: u, v in [0, 4q) -> (u + w v, u - w v) in [0, 4q)."""
    u = tl.where(u >= 2 * q, u - 2 * q, u)
    t = _shoup_lazy(v, w, ws, q)
    return u + t, u - t + 2 * q


@triton.jit
def _gs_lazy(u, v, w, ws, q):
    """Harvey's Gentleman-Sande butterfly: u, v in [0, 2q) -> (u + v, (u - v) w) in [0, 2q)."""
    s = u + v
    return tl.where(s >= 2 * q, s - 2 * q, s), _shoup_lazy(u - v + 2 * q, w, ws, q)


@triton.jit
def _canon(x, q):
    """[0, 4q) -> the canonical residue in [0, q)."""
    x = tl.where(x >= 2 * q, x - 2 * q, x)
    return tl.where(x >= q, x - q, x)


@triton.jit
def _butterfly(u, v, w, ws, q, qinv, last, INVERSE: tl.constexpr, SHOUP: tl.constexpr, LAZY: tl.constexpr,
               FINAL: tl.constexpr):
    """One butterfly of :func:`_ntt_local` / :func:`_ntt_strided`: Gentleman-Sande (``INVERSE``) or Cooley-Tukey;
    with ``LAZY`` Harvey's (:func:`_gs_lazy`, :func:`_ct_lazy`), made canonical where ``FINAL`` and ``last`` (the
    transform's last stage)."""
    if LAZY:
        if INVERSE:
            a, b = _gs_lazy(u, v, w, ws, q)
        else:
            a, b = _ct_lazy(u, v, w, ws, q)
        if FINAL:
            if last:
                a = _canon(a, q)
                b = _canon(b, q)
    elif INVERSE:
        a, b = _gs(u, v, w, q, qinv, ws, SHOUP)
    else:
        a, b = _ct(u, v, w, q, qinv, ws, SHOUP)
    return a, b


@triton.jit
def _reduce_est(x, q):
    """x mod q for 0 <= x < 2^61 and q >= 2^20: the quotient by a float64 estimate (off by at most one), then one
    correction each way; exact, so torch's ``remainder``'s residue."""
    est = tl.floor(x.to(tl.float64) * (1.0 / q.to(tl.float64))).to(tl.int64)
    r = x - est * q
    r = tl.where(r < 0, r + q, r)
    return tl.where(r >= q, r - q, r)


@triton.jit
def _rounded(t, q, ql, half_q):
    """:func:`_round_tail`'s value: ((t + ql//2 mod ql) mod q - (ql//2 mod q)) mod q, ``half_q`` = (ql//2) mod q."""
    t = t + (ql >> 1)
    t = _reduce_est(tl.where(t >= ql, t - ql, t), q)
    d = t - half_q
    return tl.where(d < 0, d + q, d)


@triton.jit
def _row_of(k, P, SKIP_DIAG: tl.constexpr):
    """Program ``k``'s (row, prime index) in a ``[..., P, N]`` tensor; ``SKIP_DIAG``: of ``[B, P - 1, P, N]`` expanded
    digits, the rows (b, J, i) with i != J only (:func:`expand_digits` wrote those already in NTT form)."""
    if SKIP_DIAG:
        blk = k // (P - 1)                                           # b * L + J
        i0 = k % (P - 1)
        p = i0 + (i0 >= blk % (P - 1)).to(i0.dtype)
        row = blk * P + p
    else:
        row = k
        p = k % P
    return row, p


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
        a0, a1 = _gs(a0, a1, tl.load(wrow + m + 2 * i2, mask=mask), q, qinv, q, False)
        a2, a3 = _gs(a2, a3, tl.load(wrow + m + 2 * i2 + 1, mask=mask), q, qinv, q, False)
        w2 = tl.load(wrow + m // 2 + i2, mask=mask)
        a0, a2 = _gs(a0, a2, w2, q, qinv, q, False)
        a1, a3 = _gs(a1, a3, w2, q, qinv, q, False)
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
        a0, a2 = _ct(a0, a2, w1, q, qinv, q, False)
        a1, a3 = _ct(a1, a3, w1, q, qinv, q, False)
        a0, a1 = _ct(a0, a1, tl.load(wrow + 2 * m + 2 * i, mask=mask), q, qinv, q, False)
        a2, a3 = _ct(a2, a3, tl.load(wrow + 2 * m + 2 * i + 1, mask=mask), q, qinv, q, False)
    tl.store(base_ptr + base, a0, mask=mask)
    tl.store(base_ptr + base + h, a1, mask=mask)
    tl.store(base_ptr + base + 2 * h, a2, mask=mask)
    tl.store(base_ptr + base + 3 * h, a3, mask=mask)


@triton.jit
def _sub_times(x, y, sc, q, qinv):
    """(x - y) * sc mod q: :func:`_sub_scale`'s arithmetic, and the fused finish's (``SUB_SCALE``)."""
    d = x - y
    d = tl.where(d < 0, d + q, d)
    return _mulmod(d, sc + tl.zeros(d.shape, tl.int64), q, qinv)


@triton.jit
def _ntt_local(x_ptr, w_ptr, ws_ptr, q_ptr, aux_ptr, sc_ptr, P, N, S0, LOGN: tl.constexpr, INVERSE: tl.constexpr,
               SHOUP: tl.constexpr, HALF: tl.constexpr, LAZY: tl.constexpr = False, FINAL: tl.constexpr = True,
               SKIP_DIAG: tl.constexpr = False, SUB_SCALE: tl.constexpr = False):
    """The stages of :func:`_ntt_stage` whose butterflies stay inside blocks of 2 HALF values (gap <= HALF:
    stages S0..LOGN-1), all in one program per block: the block stays in the cache between stages, a CTA
    barrier after each (a stage's butterflies touch disjoint pairs, so one barrier orders it before the
    next). Forward they are the last stages, inverse the first; the rest stay staged launches. ``LAZY``
    (:data:`LAZY`): Harvey's butterflies, canonical outputs in the last stage where ``FINAL``. ``SKIP_DIAG``:
    :func:`_row_of`'s. ``SUB_SCALE`` (forward, :data:`FUSED_FINISH`): the last stage stores
    ``(aux[m, p] - y) * sc[p] mod q`` instead of y (:func:`_sub_scale`; ``aux`` has P + 1 rows per m, row = m P + p)."""
    row, p = _row_of(tl.program_id(0), P, SKIP_DIAG)
    q = tl.load(q_ptr + p)
    qinv = 1.0 / q.to(tl.float64)
    g = tl.program_id(1) * HALF + tl.arange(0, HALF)                 # global butterfly index in [0, N/2)
    base = x_ptr + row.to(tl.int64) * N
    wrow = w_ptr + p.to(tl.int64) * N
    for t in range(LOGN - S0):
        if INVERSE:                                                  # stages (m, gap) from gap = 1 up
            s = LOGN - 1 - t
        else:
            s = S0 + t
        sh = LOGN - 1 - s                                            # gap = N >> (s + 1) = 2^sh
        i = g >> sh
        idx = (i << (sh + 1)) + (g & ((1 << sh) - 1))
        u = tl.load(base + idx)
        v = tl.load(base + idx + (1 << sh))
        w = tl.load(wrow + (1 << s) + i)
        ws = w
        if SHOUP:
            ws = tl.load(ws_ptr + p.to(tl.int64) * N + (1 << s) + i)
        last = t == LOGN - S0 - 1
        a, b = _butterfly(u, v, w, ws, q, qinv, last, INVERSE, SHOUP, LAZY, FINAL)
        if SUB_SCALE:
            if last:                                                 # the finish: (x - y) * scale, in place
                xb = aux_ptr + ((row // P) * (P + 1) + p).to(tl.int64) * N
                sc = tl.load(sc_ptr + p)
                a = _sub_times(tl.load(xb + idx), a, sc, q, qinv)
                b = _sub_times(tl.load(xb + idx + (1 << sh)), b, sc, q, qinv)
        tl.store(base + idx, a)
        tl.store(base + idx + (1 << sh), b)
        tl.debug_barrier()


def _local(x, roots, ws, primes, p, n, s0, logn, local, inverse, shoup, lazy=False, final=True, rows=None,
           skip_diag=False, sub_scale=None) -> None:
    """The local stages by :func:`_ntt_local` (``lazy``: its Harvey butterflies, canonical at the end where
    ``final``; ``rows``: programs on axis 0, ``skip_diag``: :func:`_row_of`'s; ``sub_scale``: (x, scale) of its
    ``SUB_SCALE`` epilogue)."""
    rows = x.numel() // n if rows is None else rows
    extra = {"LAZY": True, "FINAL": final} if lazy else {}
    if skip_diag:
        extra["SKIP_DIAG"] = True
    aux, sc = (x, primes) if sub_scale is None else sub_scale
    if sub_scale is not None:
        extra["SUB_SCALE"] = True
    _ntt_local[(rows, n // local)](x, roots, ws, primes, aux, sc, p, n, s0, LOGN=logn, INVERSE=inverse, SHOUP=shoup,
                                   HALF=local // 2, num_warps=LOCAL_WARPS, **extra)


@triton.jit
def _ntt_strided(x_ptr, w_ptr, ws_ptr, ninv_ptr, q_ptr, aux_ptr, P, N, QL, LOGN: tl.constexpr, S0: tl.constexpr,
                 INVERSE: tl.constexpr, SHOUP: tl.constexpr, SCALE: tl.constexpr, COLS: tl.constexpr,
                 LAZY: tl.constexpr = False, FINAL: tl.constexpr = True, SKIP_DIAG: tl.constexpr = False,
                 ROUND: tl.constexpr = False):
    """Stages 0..S0-1 of :func:`_ntt_stage` (gap = 2^sh >= C = N >> S0) in one launch, in the transform's
    order (forward 0 up, inverse S0-1 down; ``SCALE``: the inverse's last one times N^-1 too, as
    :func:`_ntt_stage`'s). View a row as ``[2^S0, C]`` (value ``k*C + j``): these stages only pair values of one
    column j, so a program owns ``COLS`` columns and all their ``2^S0`` values, with a CTA barrier after each
    stage (as :func:`_ntt_local`). Butterfly ``t`` of a stage: column ``j0 + t % COLS``, ``kk = t // COLS``;
    its lower value has ``k`` = kk with a 0 bit inserted at bit ``sh - log2 C`` and twiddle index
    ``2^s + (kk >> (sh - log2 C))`` (= :func:`_ntt_stage`'s ``m + i``). ``LAZY``, ``FINAL``, ``SKIP_DIAG``: as
    :func:`_ntt_local`'s. ``ROUND`` (forward, :data:`FUSED_FINISH`): the first stage reads its inputs from
    ``aux [M, 1, N]`` (the last prime's coefficients, row = m P + p) through :func:`_rounded` (``QL`` the last
    prime) instead of from x: :func:`_round_tail` in the same pass."""
    LOGC: tl.constexpr = LOGN - S0
    row, p = _row_of(tl.program_id(0), P, SKIP_DIAG)
    q = tl.load(q_ptr + p)
    qinv = 1.0 / q.to(tl.float64)
    t = tl.arange(0, (1 << (S0 - 1)) * COLS)
    j = tl.program_id(1) * COLS + (t % COLS)
    kk = t // COLS
    base = x_ptr + row.to(tl.int64) * N
    wrow = w_ptr + p.to(tl.int64) * N
    wsrow = ws_ptr + p.to(tl.int64) * N
    for tt in tl.static_range(S0):                                   # unrolled: every shift a constant
        if INVERSE:
            s = S0 - 1 - tt
        else:
            s = tt
        pb = LOGN - 1 - s - LOGC                                     # gap = C << pb
        i = kk >> pb
        idx = (((i << (pb + 1)) | (kk & ((1 << pb) - 1))) << LOGC) + j
        gap = 1 << (LOGN - 1 - s)
        if ROUND and tt == 0:                                        # the rounded tail, reduced into q_p
            tb = aux_ptr + (row // P).to(tl.int64) * N
            hq = (QL >> 1) % q
            u = _rounded(tl.load(tb + idx), q, QL, hq)
            v = _rounded(tl.load(tb + idx + gap), q, QL, hq)
        else:
            u = tl.load(base + idx)
            v = tl.load(base + idx + gap)
        w = tl.load(wrow + (1 << s) + i)
        ws = w
        if SHOUP:
            ws = tl.load(wsrow + (1 << s) + i)
        a, b = _butterfly(u, v, w, ws, q, qinv, tt == S0 - 1, INVERSE, SHOUP, LAZY, FINAL)
        if INVERSE and SCALE:
            if s == 0:                                               # the inverse's last stage: times N^-1 too
                ni = tl.load(ninv_ptr + p) + tl.zeros(a.shape, tl.int64)
                a = _mulmod(a, ni, q, qinv)
                b = _mulmod(b, ni, q, qinv)
        tl.store(base + idx, a)
        tl.store(base + idx + gap, b)
        tl.debug_barrier()


@triton.jit
def _addsub_rows(a_ptr, b_ptr, out_ptr, q_ptr, P, N, A_B, B_B, O_B, SUB: tl.constexpr, BLOCK: tl.constexpr):
    """out = a +- b mod q_row over ``[B, P, N]`` views (rows contiguous, batch strides A_B/B_B/O_B)."""
    row = tl.program_id(1)
    bb = row // P
    p = row % P
    q = tl.load(q_ptr + p)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    a = tl.load(a_ptr + bb.to(tl.int64) * A_B + p * N + offs, mask=mask)
    b = tl.load(b_ptr + bb.to(tl.int64) * B_B + p * N + offs, mask=mask)
    if SUB:
        r = a - b
        r = tl.where(r < 0, r + q, r)
    else:
        r = a + b
        r = tl.where(r >= q, r - q, r)
    tl.store(out_ptr + bb.to(tl.int64) * O_B + p * N + offs, r, mask=mask)


@triton.jit
def _round_tail(t_ptr, out_ptr, q_ptr, ql, R, N, BLOCK: tl.constexpr):
    """``drop_last_rounded``'s middle: out[m, r] = ((t[m] + ql//2 mod ql) mod q_r - ql//2 mod q_r) mod q_r."""
    row = tl.program_id(1)
    m = row // R
    r = row % R
    q = tl.load(q_ptr + r)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    half = ql >> 1
    t = tl.load(t_ptr + m.to(tl.int64) * N + offs, mask=mask) + half
    t = tl.where(t >= ql, t - ql, t) % q
    d = t - half % q
    tl.store(out_ptr + row.to(tl.int64) * N + offs, tl.where(d < 0, d + q, d), mask=mask)


@triton.jit
def _sub_scale(x_ptr, t_ptr, s_ptr, q_ptr, out_ptr, R, N, BLOCK: tl.constexpr):
    """``drop_last_rounded``'s end: out[m, r] = (x[m, r] - t[m, r]) * s_r mod q_r (x has R + 1 rows per m)."""
    row = tl.program_id(1)
    m = row // R
    r = row % R
    q = tl.load(q_ptr + r)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + (m * (R + 1) + r).to(tl.int64) * N + offs, mask=mask)
    t = tl.load(t_ptr + row.to(tl.int64) * N + offs, mask=mask)
    out = _sub_times(x, t, tl.load(s_ptr + r), q, 1.0 / q.to(tl.float64))
    tl.store(out_ptr + row.to(tl.int64) * N + offs, out, mask=mask)


def _rows3(x: torch.Tensor) -> torch.Tensor | None:
    """``x [..., P, N]`` as a ``[B, P, N]`` view whose rows are contiguous (one batch stride), or None."""
    if x.is_contiguous():
        return x.view(-1, *x.shape[-2:])
    if x.dim() == 3 and x.stride(-1) == 1 and x.stride(-2) == x.shape[-1]:
        return x
    return None


def addsub_rows(a: torch.Tensor, b: torch.Tensor, primes: torch.Tensor, sub: bool = False,
                out: torch.Tensor | None = None) -> torch.Tensor | None:
    """a +- b mod q_row for ``a``, ``b`` of one shape ``[..., P, N]`` (``primes [P]``); ``out`` may be ``a``.
    None when a layout does not fit one launch (the caller falls back to torch)."""
    if a.shape != b.shape or a.dtype != torch.int64 or b.dtype != torch.int64 or primes.numel() != a.shape[-2]:
        return None
    out = torch.empty_like(a, memory_format=torch.contiguous_format) if out is None else out
    a3, b3, o3 = _rows3(a), _rows3(b), _rows3(out)
    if a3 is None or b3 is None or o3 is None or not primes.is_contiguous():
        return None
    bsz, p, n = a3.shape
    _addsub_rows[(triton.cdiv(n, BLOCK), bsz * p)](a3, b3, o3, primes, p, n, a3.stride(0), b3.stride(0),
                                                   o3.stride(0), SUB=sub, BLOCK=BLOCK)
    return out


def round_tail(tail: torch.Tensor, primes: torch.Tensor, q_last: int) -> torch.Tensor:
    """``tail [..., 1, N]`` (the last prime's coefficients) -> ``[..., R, N]`` (see :func:`_round_tail`)."""
    _check(tail, "tail")
    r, n = primes.numel(), tail.shape[-1]
    out = torch.empty((*tail.shape[:-2], r, n), dtype=torch.int64, device=tail.device)
    _round_tail[(triton.cdiv(n, BLOCK), out.numel() // n)](tail, out, primes, q_last, r, n, BLOCK=BLOCK)
    return out


def sub_scale(x: torch.Tensor, t: torch.Tensor, scale: torch.Tensor, primes: torch.Tensor) -> torch.Tensor:
    """``x [..., R+1, N]``, ``t [..., R, N]`` -> ``(x[..., :R, :] - t) * scale_r mod q_r``."""
    _check(x, "x")
    _check(t, "t")
    r, n = primes.numel(), x.shape[-1]
    assert t.shape[-2] == r and x.shape[-2] == r + 1 and scale.numel() == r, (x.shape, t.shape)
    out = torch.empty_like(t)
    _sub_scale[(triton.cdiv(n, BLOCK), t.numel() // n)](x, t, scale, primes, out, r, n, BLOCK=BLOCK)
    return out


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
def _inner_product(d_ptr, perm_ptr, key_ptr, q_ptr, out_ptr, add_ptr, L, R, K1, N, D_STRIDE, KEY_STRIDE,
                   PERMUTE: tl.constexpr, ADD: tl.constexpr, BLOCK: tl.constexpr):
    """out[b, c, r] = sum_J D[b, J, r, perm] * key[b, J, c, krow(r)] mod q_r; krow = r, or K (special) for
    r = L. Program axis 2 = b * 2 + c: row b of a batch (its digits at ``D_STRIDE``, its key at
    ``KEY_STRIDE``, 0 when the rows share one key); one row is the batch of one. The same products and
    reductions in the same order for every row, so a row's result does not depend on the batch. ``ADD``: the
    sum starts from ``add[b, c, r]`` (canonical residues, out's layout) instead of 0: the residue of the same
    sum as adding it after (a hoisted rotation's correction), one pass less."""
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
    o = ((b * 2 + c) * R + r).to(tl.int64) * N + offs
    if ADD:
        acc = tl.load(add_ptr + o, mask=mask, other=0)
    else:
        acc = tl.zeros((BLOCK,), tl.int64)
    for j in range(L):
        d = tl.load(d_base + (j * R + r).to(tl.int64) * N + src, mask=mask)
        k = tl.load(k_base + ((j * 2 + c) * K1 + krow).to(tl.int64) * N + offs, mask=mask)
        acc += _mulmod(d, k, q, qinv)
        acc = tl.where(acc >= q, acc - q, acc)
    tl.store(out_ptr + o, acc, mask=mask)


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
         n_inv: torch.Tensor | None = None, roots_shoup: torch.Tensor | None = None,
         skip_diag: bool = False) -> torch.Tensor:
    """In-place (I)NTT butterflies of ``x [..., P, N]``; ``roots [P, N]`` (inverse roots if ``inverse``).

    ``n_inv [P]`` (inverse only): also multiply by N^-1 (else the caller does, :func:`mulmod_rows`). With
    :data:`FUSED` the stages within blocks of :data:`LOCAL` values take one launch (:func:`_ntt_local`).
    ``roots_shoup [P, N]``: the roots' Shoup companions (:func:`fhe.backends.gpu.ntt.shoup`); with
    :data:`SHOUP` the butterflies multiply with them. ``skip_diag`` (forward, ``x [..., P - 1, P, N]``, only where
    :func:`skips_diag`): rows ``[..., J, J, :]`` are left as they are (:func:`expand_digits`).
    """
    _check(x, "ntt")
    p, n = roots.shape
    assert x.shape[-2:] == (p, n) and primes.numel() == p, (x.shape, roots.shape)
    assert n_inv is None or (inverse and n_inv.numel() == p and n_inv.is_contiguous()), "n_inv"
    shoup = SHOUP and roots_shoup is not None
    assert not shoup or (roots_shoup.shape == roots.shape and roots_shoup.is_contiguous()), "roots_shoup"
    ws = roots_shoup if shoup else roots
    rows = x.numel() // n
    logn = n.bit_length() - 1
    local = min(n, LOCAL) if FUSED else 1                          # values per block of the local kernel
    s0 = logn - (local.bit_length() - 1)                             # first stage local to such a block
    strided = STRIDED and not RADIX4 and local > 1 and s0 > 0
    # lazy values cross from one kernel to the other only between these two (the staged launches expect canonical)
    lazy = LAZY and shoup and local > 1 and (strided or s0 == 0)
    if skip_diag:
        assert not inverse and strided and x.dim() >= 3 and x.shape[-3] == p - 1, ("skip_diag", x.shape)
        rows -= rows // p                                            # the programs of the rows i != J
    if inverse and local > 1:
        _local(x, roots, ws, primes, p, n, s0, logn, local, True, shoup, lazy, final=s0 == 0)
    if strided:                                                      # the staged stages in one launch
        cols = max(1, STRIDED_BUTTERFLIES >> (s0 - 1))
        cols = min(cols, n >> s0)
        scale = inverse and FEWER and n_inv is not None
        extra = {"LAZY": True, "FINAL": inverse} if lazy else {}
        if skip_diag:
            extra["SKIP_DIAG"] = True
        _ntt_strided[(rows, (n >> s0) // cols)](x, roots, ws, n_inv if scale else primes, primes, x, p, n, 0,
                                                 LOGN=logn, S0=s0, INVERSE=inverse, SHOUP=shoup, SCALE=scale,
                                                 COLS=cols, num_warps=LOCAL_WARPS, **extra)
        folded = scale
    else:
        folded = _ntt_staged(x, roots, ws, primes, inverse, shoup, p, n, rows, s0 if local > 1 else logn,
                             n_inv if FEWER else None)
    if not inverse and local > 1:
        _local(x, roots, ws, primes, p, n, s0, logn, local, False, shoup, lazy, final=True, rows=rows,
               skip_diag=skip_diag)
    return x if n_inv is None or folded else mulmod_rows(x, n_inv, primes)


def _ntt_staged(x, roots, ws, primes, inverse, shoup, p, n, rows, upto, n_inv=None) -> bool:
    """Stages 0..upto-1 one launch each (two with :data:`RADIX4`), in the transform's order. ``n_inv``
    (inverse only): multiplied in by the last launch where that is a one-stage one; returns whether it was."""
    grid = (triton.cdiv(n // 2, BLOCK), rows)
    stages = [(1 << s, n >> (s + 1)) for s in range(upto)]
    order = list(reversed(stages)) if inverse else stages
    if RADIX4:
        grid4 = (triton.cdiv(n // 4, BLOCK), rows)
        while len(order) >= 2:                                       # two stages per pass
            m, gap = order[0]
            _ntt_stage2[grid4](x, roots, primes, p, n, m, gap, INVERSE=inverse, BLOCK=BLOCK)
            order = order[2:]
    for i, (m, gap) in enumerate(order):
        scale = inverse and n_inv is not None and i == len(order) - 1
        _ntt_stage[grid](x, roots, ws, n_inv if scale else primes, primes, p, n, m, gap, INVERSE=inverse,
                         SHOUP=shoup, SCALE=scale, BLOCK=BLOCK)
    return bool(order) and inverse and n_inv is not None


def fuses_finish(n: int) -> bool:
    """Whether :func:`rounded_ntt_sub_scale` runs at size ``n`` (:data:`FUSED_FINISH` and the strided and local
    kernels, which carry its prologue and epilogue)."""
    return FUSED_FINISH and _strided_and_local(n)


def rounded_ntt_sub_scale(x: torch.Tensor, tail: torch.Tensor, roots: torch.Tensor, roots_shoup: torch.Tensor,
                          primes: torch.Tensor, scale: torch.Tensor, q_last: int) -> torch.Tensor:
    """``drop_last_rounded``'s device part in two launches (where :func:`fuses_finish`): ``x [..., R+1, N]``
    (NTT form), ``tail [..., 1, N]`` (its last row's coefficients) -> ``(x[..., :R, :] - NTT(round_tail(tail)))
    * scale mod q``, the strided kernel reading the tail through the rounding (``ROUND``) and the local kernel
    subtracting and scaling in its last stage (``SUB_SCALE``): :func:`round_tail`, :func:`ntt_` and
    :func:`sub_scale`'s residues without their two launches and two passes over ``[..., R, N]``."""
    _check(x, "x")
    _check(tail, "tail")
    r, n = primes.numel(), x.shape[-1]
    assert roots.shape == (r, n) and x.shape[-2] == r + 1 and tail.shape == (*x.shape[:-2], 1, n), (x.shape, tail.shape)
    assert scale.numel() == r and scale.is_contiguous() and fuses_finish(n), (scale.shape, n)
    out = torch.empty((*x.shape[:-2], r, n), dtype=torch.int64, device=x.device)
    shoup = SHOUP and roots_shoup is not None
    ws = roots_shoup if shoup else roots
    rows, logn = out.numel() // n, n.bit_length() - 1
    local = min(n, LOCAL)
    s0 = logn - (local.bit_length() - 1)
    lazy = LAZY and shoup
    cols = min(max(1, STRIDED_BUTTERFLIES >> (s0 - 1)), n >> s0)
    extra = {"LAZY": True, "FINAL": False} if lazy else {}
    _ntt_strided[(rows, (n >> s0) // cols)](out, roots, ws, primes, primes, tail, r, n, q_last, LOGN=logn, S0=s0,
                                            INVERSE=False, SHOUP=shoup, SCALE=False, COLS=cols, ROUND=True,
                                            num_warps=LOCAL_WARPS, **extra)
    _local(out, roots, ws, primes, r, n, s0, logn, local, False, shoup, lazy, final=True, sub_scale=(x, scale))
    return out


def skips_diag(n: int) -> bool:
    """Whether :func:`ntt_` can leave the expanded digits' rows ``[J, J]`` alone at size ``n`` (:data:`SKIP_DIAG`,
    the strided and local kernels: the path that has the row map)."""
    return SKIP_DIAG and _strided_and_local(n)


def _strided_and_local(n: int) -> bool:
    """Whether :func:`ntt_` runs at size ``n`` as the strided kernel then the local one (the two kernels that carry
    :data:`SKIP_DIAG`'s row map and :data:`FUSED_FINISH`'s prologue and epilogue)."""
    local = min(n, LOCAL) if FUSED else 1
    return STRIDED and not RADIX4 and 1 < local < n


@triton.jit
def _expand_digits(d_ptr, t_ptr, q_ptr, out_ptr, L, N, BLOCK: tl.constexpr):
    """out[b, J, i] = t[b, J] where i == J (that row's NTT, which :func:`ntt_` then skips), else d[b, J] mod q_i
    (:func:`_reduce_est`: d < 2^61, q >= 2^20)."""
    row = tl.program_id(1)                                           # (b * L + J) * (L + 1) + i
    i = row % (L + 1)
    bj = row // (L + 1)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    out = out_ptr + row.to(tl.int64) * N + offs
    if i == bj % L:
        tl.store(out, tl.load(t_ptr + bj.to(tl.int64) * N + offs, mask=mask), mask=mask)
    else:
        d = tl.load(d_ptr + bj.to(tl.int64) * N + offs, mask=mask)
        tl.store(out, _reduce_est(d, tl.load(q_ptr + i)), mask=mask)


def expand_digits(d: torch.Tensor, t: torch.Tensor, primes: torch.Tensor) -> torch.Tensor:
    """Key switching's digits ``d [..., L, N]`` (coefficients, d_J < q_J < 2^61) reduced into the ``L + 1`` ext
    ``primes`` -> ``[..., L, L + 1, N]``, except rows ``[J, J]``, which get ``t [..., L, N]`` (the NTT-form input the
    digits came from: NTT_J(d_J mod q_J) = t_J exactly, SEAL's ``switch_key_inplace`` uses it as is). Then
    :func:`ntt_` with ``skip_diag`` transforms the other rows: the same residues as reducing and transforming all."""
    _check(d, "digits")
    _check(t, "input")
    *lead, lev, n = d.shape
    assert t.shape == d.shape and primes.numel() == lev + 1 and primes.is_contiguous(), (d.shape, t.shape)
    out = torch.empty((*lead, lev, lev + 1, n), dtype=torch.int64, device=d.device)
    _expand_digits[(triton.cdiv(n, BLOCK), out.numel() // n)](d, t, primes, out, lev, n, BLOCK=BLOCK)
    return out


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
                  perm: torch.Tensor | None = None, add: torch.Tensor | None = None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """``D [L, L+1, N]`` (digits in every ext prime), ``key [K, 2, K+1, N]`` -> ``[2, L+1, N]``; or a batch:
    ``D [B, L, L+1, N]``, ``key [B, K, 2, K+1, N]`` (row b's key for row b's digits; a batch axis of stride
    0, ``key.expand(B, ...)``, shares one key) -> ``[B, 2, L+1, N]``. ``perm [N]``: read the digits
    through this slot permutation (a hoisted rotation). ``add`` (the result's shape, canonical): added to the
    sum mod q in the same pass. ``out`` (the result's shape, contiguous): written there (a batch's row)."""
    batched = D.dim() == 4
    Db, kb = (D, key) if batched else (D[None], key[None])
    _check(Db, "digits")
    assert key.dtype == torch.int64 and key.device == D.device and key[(0,) * (key.dim() - 4)].is_contiguous(), "key"
    b, lev, r, n = Db.shape
    assert r == lev + 1 and kb.shape[0] == b and kb.shape[1] >= lev and kb.shape[2] == 2, (D.shape, key.shape)
    assert kb.shape[4] == n and primes.numel() == r, (D.shape, key.shape, primes.shape)
    shape = (b, 2, r, n) if batched else (2, r, n)
    if out is None:
        out = torch.empty(shape, dtype=torch.int64, device=D.device)
    _check(out, "out")
    assert out.shape == shape, (out.shape, shape)
    if add is not None:
        _check(add, "add")
        assert add.shape == shape, (add.shape, shape)
    src = perm if perm is not None else Db
    _inner_product[(triton.cdiv(n, BLOCK), r, 2 * b)](Db, src, kb, primes, out, out if add is None else add, lev, r,
                                                      kb.shape[3], n, lev * r * n, kb.stride(0),
                                                      PERMUTE=perm is not None, ADD=add is not None, BLOCK=BLOCK)
    return out


__all__ = ["addsub_rows", "dot_rows", "expand_digits", "fuses_finish", "inner_product", "mulmod_rows", "ntt_",
           "round_tail", "rounded_ntt_sub_scale", "skips_diag", "sub_scale"]
