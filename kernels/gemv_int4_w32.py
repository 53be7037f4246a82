"""Weight-only int4 GEMV for decode in a GPU layout made once at load: y = x @ W^T (+ bias).

Same arithmetic as :mod:`kernels.gemv_int4` (``w[n, k] = scale[n, g] * u[n, k] + offset[n, g]``, ``u`` in
0..15, ``g = k // group``), another layout, built by :func:`repack_int4_w32` from the byte layout:

* ``qweight [N, K/8]`` int32: word ``g * W + w`` of row ``n`` (``W = group / 8`` words per group) holds
  column ``g * group + i * W + w`` in nibble ``i`` (bits ``4i .. 4i + 3``). The nibbles are interleaved so
  that, for one nibble index, a thread's ``W`` contiguous words meet ``W`` contiguous columns of x: one
  16-byte load feeds 32 weights and x is read in vector loads, not one strided scalar per weight.
* ``scale_offset [N, K/group, 2]`` fp16 or bf16: a group's scale and offset side by side (one load).

Why the byte kernel was slow (docs/benchmarks.md, int4 on the GPU): per weight it ran a one-byte load, an
int-to-float conversion (a 16-per-clock-per-SM instruction on Hopper, 1/8 of the FMA rate: at 1.2 G weights
a step that alone is ~0.35 ms, twice the step's byte floor) and two strided x loads. Here a nibble becomes
a float without a conversion: shifted to the top of an fp32 mantissa and OR-ed with the bits of 1.0 it
reads ``f = 1 + u / 16``, so ``sum_k w x = 16 s sum f x + (o - 16 s) sum x`` per group: per weight one
shift, one AND/OR (a single LOP3) and one FMA. A program owns ``BLOCK_N`` rows and walks K in steps of
``GROUPS`` groups; with ``BLOCK_N`` above the warp count a thread holds several rows and reuses each x value
for all of them. Accumulation is fp32; the output is rounded once.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from . import _pdl, _prologue
from ._common import (
    FLOAT_DTYPES,
    HAS_TRITON,
    Backend,
    cdiv,
    check_bias,
    check_same_device,
    check_shape,
    check_tensor,
    tl,
    triton,
    use_triton,
)
from .errors import KernelInputError
from .gemv import check_norm_args
from .rms_norm import rms_norm_reference
from .silu_mul import silu_mul_reference

if HAS_TRITON:
    from ._pdl import pdl_wait
    from ._prologue import prologue_load

__all__ = ["GemvInt4W32Tuning", "dequantize_int4_w32", "gemv_int4_w32", "gemv_int4_w32_reference",
           "gemv_int4_w32_rms_norm", "gemv_int4_w32_silu_mul", "repack_int4_w32", "set_tuning_int4_w32",
           "tuning_int4_w32"]

GROUP_SIZES = (16, 32, 64, 128)  # power-of-two words per group (tl.arange) and at least 2 of them
SCALE_DTYPES = (torch.float16, torch.bfloat16)


@dataclasses.dataclass(frozen=True)
class GemvInt4W32Tuning:
    """Launch parameters: rows per program, groups per K step, warps, pipeline stages."""

    block_n: int = 8
    groups: int = 32
    num_warps: int = 4
    num_stages: int = 2
    # load x in the weight tile's own [BN, G, W] shape (one copy per row, from L1) instead of [G, W]
    # broadcast over the rows: the broadcast costs a shared-memory layout conversion with two barriers per
    # nibble (seen in the SASS of the default). H200, 2026-12-02: best launch of every 1B GEMM, but only
    # 3-9 % faster, and slower on the head at the default shape, hence off by default (docs/benchmarks.md)
    x_per_row: bool = False
    # load the next K step's words and scales before computing this one's (register double-buffering): Triton
    # does not pipeline these loads (no async copies in the TTGIR at any num_stages, checked with Triton 3.9
    # for sm_90), so without it a program's loads and its unpack/FMA never overlap and every tuning waits the
    # same way (docs/benchmarks.md, "PDL and prefetch"); needs groups < K / group to have a next step
    prefetch: bool = False
    # split K over this many programs per row block (a third grid axis; session 23): each writes its fp32 partial
    # rows to a workspace, takes a ticket from a per-row-block counter, and the last to arrive sums the partials,
    # adds the bias, writes y and resets the counter, all in the one launch. More, shorter programs: more weight
    # bytes in flight per SM for the GEMVs whose N / block_n programs do not fill the card (o, qkv, down of a 1B
    # model). Not with the RMSNorm prologues (their norm needs every column); 1 = no split (the default)
    split_k: int = 1
    # read each nibble where it lies in the word, inside an fp32 mantissa (bits 0-19; the top three nibbles from
    # one shifted copy of the word): f = 1 + u * 2^(p - 23), and f - 1 is exact, so per weight one AND/OR, one
    # exact subtract and one FMA against x scaled by 2^(23 - p) (exact), instead of a shift per nibble; the SASS of
    # the default spends ~5 instructions a weight (session 23, compiled here), and the int pipe is half the fp32's.
    # x's magnitude must stay below ~2^104 (the scaled copy's range)
    mantissa_unpack: bool = False


# (N, K, group) -> a launch measured best on this machine (bench/gemv_int4_gpu.py records its sweep here)
_TUNED: dict[tuple[int, int, int], GemvInt4W32Tuning] = {}


def set_tuning_int4_w32(n: int, k: int, group: int, tuning: GemvInt4W32Tuning | None) -> None:
    """Use ``tuning`` for every later launch on an [N, K] weight of this group size (None: the default)."""
    if tuning is None:
        _TUNED.pop((n, k, group), None)
    else:
        _TUNED[(n, k, group)] = tuning


def tuning_int4_w32(n: int, k: int, group: int) -> GemvInt4W32Tuning:
    """The launch for an [N, K] weight: a recorded one (:func:`set_tuning_int4_w32`), else the default.

    The default: few rows (o, qkv of a 1B model: N <= 4096): 4 rows a program so N / 4 programs run; the
    head and the wide MLP GEMMs: 16 rows a program (4 per thread at 4 warps), so each x value feeds 4 rows.
    """
    if (n, k, group) in _TUNED:
        return _TUNED[(n, k, group)]
    groups = min(triton_next_pow2(k // group), max(1, 2048 // group))  # a K step of up to 2048 columns
    return GemvInt4W32Tuning(block_n=4 if n <= 4096 else 16, groups=groups)


def triton_next_pow2(n: int) -> int:
    """The smallest power of two >= n (tl.arange sizes)."""
    return 1 << max(0, (n - 1).bit_length())


def _check_group(k: int, group: int) -> None:
    if group not in GROUP_SIZES or k % group:
        raise KernelInputError(f"the w32 layout needs a group size in {GROUP_SIZES} dividing K={k}, got {group}")


def repack_int4_w32(qweight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> tuple[torch.Tensor,
                                                                                                  torch.Tensor]:
    """The byte layout of :func:`kernels.pack_int4_rows` -> (qweight [N, K/8] int32, scale_offset [N, G, 2]).

    Args:
        qweight: [N, K/2] uint8, column 2j in the low nibble of byte j, 2j + 1 in the high one.
        scale, offset: [N, K/group] fp16 or bf16 (same dtype).

    Returns:
        The interleaved words and the side-by-side scales (module docstring), on qweight's device.
    """
    check_tensor("qweight", qweight, 2, (torch.uint8,))
    check_tensor("scale", scale, 2, SCALE_DTYPES)
    check_tensor("offset", offset, 2, SCALE_DTYPES)
    n, half = qweight.shape
    k, n_groups = 2 * half, scale.shape[1]
    if n_groups == 0 or k % n_groups:
        raise KernelInputError(f"K={k} is not a multiple of the {n_groups} groups of scale")
    group = k // n_groups
    _check_group(k, group)
    check_shape("scale", scale, (n, n_groups))
    check_shape("offset", offset, (n, n_groups))
    if offset.dtype != scale.dtype:
        raise KernelInputError(f"offset dtype {offset.dtype} differs from scale dtype {scale.dtype}")
    words = group // 8
    u = torch.stack([qweight & 15, qweight >> 4], dim=-1).reshape(n, n_groups, 8, words).to(torch.int32)
    # column g * group + i * W + w -> nibble i of word g * W + w
    shifts = (4 * torch.arange(8, device=qweight.device, dtype=torch.int32)).view(1, 1, 8, 1)
    packed = (u << shifts).sum(dim=2, dtype=torch.int64)          # [N, G, W], each < 2^32
    packed = torch.where(packed >= 2**31, packed - 2**32, packed)  # the same 32 bits as a signed int32
    q32 = packed.to(torch.int32).reshape(n, k // 8).contiguous()
    return q32, torch.stack([scale, offset], dim=-1).contiguous()


def dequantize_int4_w32(qweight: torch.Tensor, scale_offset: torch.Tensor) -> torch.Tensor:
    """The fp32 weight [N, K] of the w32 layout (exactly ``scale * u + offset``)."""
    n, kw = qweight.shape
    n_groups = scale_offset.shape[1]
    words = kw // n_groups
    shifts = (4 * torch.arange(8, device=qweight.device, dtype=torch.int32)).view(1, 1, 8, 1)
    u = (qweight.view(n, n_groups, 1, words) >> shifts) & 15        # [N, G, 8, W]: column i * W + w
    u = u.reshape(n, n_groups, 8 * words).float()
    s, o = scale_offset.float().unbind(-1)
    return torch.addcmul(o[..., None], s[..., None], u).reshape(n, kw * 8)


def gemv_int4_w32_reference(x: torch.Tensor, qweight: torch.Tensor, scale_offset: torch.Tensor,
                            bias: torch.Tensor | None = None) -> torch.Tensor:
    """Torch reference of :func:`gemv_int4_w32` (dequantize to fp32, fp32 product, one rounding)."""
    b = None if bias is None else bias.float()
    return F.linear(x.float(), dequantize_int4_w32(qweight, scale_offset), b).to(x.dtype)


if HAS_TRITON:

    @triton.jit
    def _nibble_as_float(words, i: tl.constexpr):
        """Nibble i of each word as 1 + u / 16 (fp32 bits 0x3F800000 | u << 19): no int-to-float convert."""
        if 4 * i <= 19:
            bits = (words << (19 - 4 * i)) & 0x780000
        else:
            bits = (words >> (4 * i - 19)) & 0x780000
        return (bits | 0x3F800000).to(tl.float32, bitcast=True)

    @triton.jit
    def _nibble_in_place(words, hi, i: tl.constexpr):
        """Nibble i as u * 2^(p - 23), p its bit position in words (i < 5) or in hi = words >> 12: one AND/OR
        and an exact subtract (f = 1 + u * 2^(p - 23) has the same exponent as 1.0)."""
        if i < 5:
            bits = (words & (15 << (4 * i))) | 0x3F800000
        else:
            bits = (hi & (15 << (4 * i - 12))) | 0x3F800000
        return bits.to(tl.float32, bitcast=True) - 1.0

    @triton.jit
    def _nibble_x_scale(i: tl.constexpr):
        """2^(23 - p) for nibble i's position p (see _nibble_in_place): x times it, times u * 2^(p - 23), is u x."""
        if i < 5:
            return (1 << (23 - 4 * i)) * 1.0
        else:
            return (1 << (35 - 4 * i)) * 1.0

    @triton.jit
    def _w32_tile(q_ptr, so_ptr, rows, row_ok, s_qn, s_sn, g0, n_groups, GROUP: tl.constexpr,
                  GROUPS: tl.constexpr, EVEN: tl.constexpr):
        """The weight data of one K step: words [BN, G, W] and the groups' scales and offsets [BN, G] (fp32)."""
        W: tl.constexpr = GROUP // 8
        rows64 = rows.to(tl.int64)
        gi = g0 + tl.arange(0, GROUPS)                                    # [G]
        g_ok = gi < n_groups
        widx = gi[:, None] * W + tl.arange(0, W)[None, :]                 # [G, W] word index in the row
        w_ptrs = q_ptr + rows64[:, None, None] * s_qn + widx[None, :, :]
        sc_off = so_ptr + rows64[:, None] * s_sn + gi[None, :] * 2
        if EVEN:  # no mask: a mask stops the 16-byte vector loads (one LDG.128 per 32 weights)
            words = tl.load(w_ptrs, eviction_policy="evict_first")        # [BN, G, W]: each read once
            sc = tl.load(sc_off).to(tl.float32)                           # [BN, G]
            of = tl.load(sc_off + 1).to(tl.float32)
        else:
            words = tl.load(w_ptrs, mask=row_ok[:, None, None] & g_ok[None, :, None], other=0,
                            eviction_policy="evict_first")
            g_mask = row_ok[:, None] & g_ok[None, :]
            sc = tl.load(sc_off, mask=g_mask, other=0.0).to(tl.float32)
            of = tl.load(sc_off + 1, mask=g_mask, other=0.0).to(tl.float32)
        return words, sc, of

    @triton.jit
    def _w32_step(acc, ss, words, sc, of, x_row, r_row, g_ptr, h_row, rows, g0, n_groups, K, first,
                  GROUP: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, EVEN: tl.constexpr,
                  X_PER_ROW: tl.constexpr, PROLOGUE: tl.constexpr, NORM: tl.constexpr, MANT: tl.constexpr):
        """One K step: x's columns (through the prologue) against the step's words, scaled per group."""
        W: tl.constexpr = GROUP // 8
        gi = g0 + tl.arange(0, GROUPS)
        g_ok = gi < n_groups
        w_off = tl.arange(0, W)
        dot = tl.zeros([BLOCK_N, GROUPS, W], dtype=tl.float32)
        col0 = gi[:, None] * GROUP + w_off[None, :]                       # [G, W] column of nibble 0
        hi = words >> 12  # MANT: nibbles 5-7 at bits 8-19 (the sign bits the shift brings in are masked off)
        if X_PER_ROW:  # x in the words' [BN, G, W] layout: no layout conversion, no barrier
            xs3 = tl.zeros([BLOCK_N, GROUPS, W], dtype=tl.float32)
            for i in tl.static_range(8):
                cols3 = (col0 + i * W)[None, :, :] + 0 * rows[:, None, None]
                xi3, sq3 = prologue_load(x_row, r_row, g_ptr, h_row, cols3, g_ok[None, :, None], K, first,
                                         PROLOGUE, not EVEN)
                if NORM:
                    ss += tl.sum(sq3 * sq3, axis=0)
                if MANT:
                    dot += _nibble_in_place(words, hi, i) * (xi3 * _nibble_x_scale(i))
                else:
                    dot += _nibble_as_float(words, i) * xi3
                xs3 += xi3
            xsum = tl.sum(xs3, axis=2)                                    # [BN, G]
        else:
            xs = tl.zeros([GROUPS, W], dtype=tl.float32)
            for i in tl.static_range(8):
                xi, sq = prologue_load(x_row, r_row, g_ptr, h_row, col0 + i * W, g_ok[:, None], K, first,
                                       PROLOGUE, not EVEN)
                if NORM:
                    ss += sq * sq
                if MANT:
                    dot += _nibble_in_place(words, hi, i) * (xi * _nibble_x_scale(i))[None, :, :]
                else:
                    dot += _nibble_as_float(words, i) * xi[None, :, :]
                xs += xi
            xsum = tl.sum(xs, axis=1)[None, :]                            # [1, G]
        if MANT:  # dot = sum u x exactly scaled: w x = s u x + o x
            acc += sc * tl.sum(dot, axis=2) + of * xsum
        else:
            sc16 = 16.0 * sc
            acc += sc16 * tl.sum(dot, axis=2) + (of - sc16) * xsum
        return acc, ss

    @triton.jit
    def _gemv_int4_w32_kernel(
        x_ptr, q_ptr, so_ptr, b_ptr, y_ptr, r_ptr, g_ptr, h_ptr, N, K, s_xm, s_qn, s_sn, s_ym, s_rm, s_hm, eps,
        ss_scale,
        GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr,
        EVEN: tl.constexpr, X_PER_ROW: tl.constexpr, PROLOGUE: tl.constexpr, NORM: tl.constexpr,
        PDL: tl.constexpr, PREFETCH: tl.constexpr, ws_ptr, cnt_ptr, per, SPLIT: tl.constexpr, MANT: tl.constexpr,
    ):
        # PROLOGUE (kernels._prologue): 0 none; 1/2 RMSNorm (NORM; 2: of x + residual, h written); 3 SiLU·mul.
        # ss_scale: 1 / (K * the times each column's square is summed: BLOCK_N with x_per_row, else 1)
        W: tl.constexpr = GROUP // 8                      # words per group
        m = tl.program_id(1).to(tl.int64)
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        n_groups = K // GROUP
        x_row, r_row, h_row = x_ptr + m * s_xm, r_ptr + m * s_rm, h_ptr + m * s_hm
        first = tl.where(tl.program_id(0) == 0, K, 0)  # columns of h this program writes (ADD_NORM)
        acc = tl.zeros([BLOCK_N, GROUPS], dtype=tl.float32)
        ss = tl.zeros([GROUPS, W], dtype=tl.float32)  # the norm's sum of squares (x_per_row: BLOCK_N times)
        # this program's groups [g_lo, g_hi): all of K, or split SPLIT's share (``per`` groups, a whole number of
        # steps; the launcher never makes an empty split)
        g_lo = tl.program_id(2) * per if SPLIT > 1 else 0
        g_hi = tl.minimum(g_lo + per, n_groups) if SPLIT > 1 else n_groups
        if PREFETCH:  # step g0's data is in registers while step g0 + 1's loads are in flight
            words, sc, of = _w32_tile(q_ptr, so_ptr, rows, row_ok, s_qn, s_sn, g_lo, n_groups, GROUP, GROUPS,
                                      EVEN)
            pdl_wait(PDL)  # (PDL) the first step's weights load before the wait: no kernel writes them
            last = g_lo + (g_hi - g_lo - 1) // GROUPS * GROUPS  # the last step's first group
            for g0 in range(g_lo, g_hi, GROUPS):
                # the next step; past the end the last one again (an L2 hit), so the loads need no extra mask
                gn = tl.minimum(g0 + GROUPS, last)
                nw, nsc, nof = _w32_tile(q_ptr, so_ptr, rows, row_ok, s_qn, s_sn, gn, n_groups, GROUP, GROUPS,
                                         EVEN)
                acc, ss = _w32_step(acc, ss, words, sc, of, x_row, r_row, g_ptr, h_row, rows, g0, n_groups, K,
                                    first, GROUP, BLOCK_N, GROUPS, EVEN, X_PER_ROW, PROLOGUE, NORM, MANT)
                words, sc, of = nw, nsc, nof
        else:
            g_first = g_lo
            if PDL:  # the first step's words and scales load before the wait (no kernel writes them)
                words, sc, of = _w32_tile(q_ptr, so_ptr, rows, row_ok, s_qn, s_sn, g_lo, n_groups, GROUP, GROUPS,
                                          EVEN)
                pdl_wait(PDL)
                acc, ss = _w32_step(acc, ss, words, sc, of, x_row, r_row, g_ptr, h_row, rows, g_lo, n_groups, K,
                                    first, GROUP, BLOCK_N, GROUPS, EVEN, X_PER_ROW, PROLOGUE, NORM, MANT)
                g_first = g_lo + GROUPS
            for g0 in range(g_first, g_hi, GROUPS):
                words, sc, of = _w32_tile(q_ptr, so_ptr, rows, row_ok, s_qn, s_sn, g0, n_groups, GROUP, GROUPS,
                                          EVEN)
                acc, ss = _w32_step(acc, ss, words, sc, of, x_row, r_row, g_ptr, h_row, rows, g0, n_groups, K,
                                    first, GROUP, BLOCK_N, GROUPS, EVEN, X_PER_ROW, PROLOGUE, NORM, MANT)
        y = tl.sum(acc, axis=1)
        if NORM:  # y = inv * W (h * g): the norm's scale applied once, after the weights
            y *= tl.rsqrt(tl.sum(tl.sum(ss, 1), 0) * ss_scale + eps)
        if SPLIT > 1:
            _split_k_finish(y, b_ptr, y_ptr, ws_ptr, cnt_ptr, rows, row_ok, m, N, s_ym, HAS_BIAS, BLOCK_N, SPLIT)
        else:
            if HAS_BIAS:
                y += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
            tl.store(y_ptr + m * s_ym + rows, y.to(y_ptr.dtype.element_ty), mask=row_ok)

    @triton.jit
    def _split_k_finish(y, b_ptr, y_ptr, ws_ptr, cnt_ptr, rows, row_ok, m, N, s_ym, HAS_BIAS: tl.constexpr,
                        BLOCK_N: tl.constexpr, SPLIT: tl.constexpr):
        """Split K: this program's partial rows to the workspace; the last of the row block's SPLIT programs
        to arrive (a ticket from its counter) sums them in split order, adds the bias and writes y."""
        n_m = tl.num_programs(1)
        # workspace [SPLIT, M, N] fp32; counters [M, N / BLOCK_N] int32, zero between launches
        tl.store(ws_ptr + (tl.program_id(2) * n_m + m) * N + rows, y, mask=row_ok)
        tl.debug_barrier()  # every thread's partial is stored before the ticket is taken (release, gpu scope)
        counter = cnt_ptr + m * tl.num_programs(0) + tl.program_id(0)
        ticket = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT - 1:  # the last one: every other partial is in L2 (read past L1: .cg)
            total = tl.zeros([BLOCK_N], dtype=tl.float32)
            for j in tl.static_range(SPLIT):
                total += tl.load(ws_ptr + (j * n_m + m) * N + rows, mask=row_ok, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
            tl.store(y_ptr + m * s_ym + rows, total.to(y_ptr.dtype.element_ty), mask=row_ok)
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # ready for the next launch


def _check(x, qweight, scale_offset, bias) -> tuple[int, int, int, int]:
    check_tensor("x", x, 2, FLOAT_DTYPES)
    check_tensor("qweight", qweight, 2, (torch.int32,))
    check_tensor("scale_offset", scale_offset, 3, SCALE_DTYPES)
    m, k = x.shape
    n = qweight.shape[0]
    check_shape("qweight", qweight, (n, k // 8))
    n_groups = scale_offset.shape[1]
    if k % 8 or n_groups == 0 or k % n_groups:
        raise KernelInputError(f"K={k} must be a multiple of 8 and of the group size "
                               f"(scale_offset has {n_groups} groups)")
    _check_group(k, k // n_groups)
    check_shape("scale_offset", scale_offset, (n, n_groups, 2))
    if not scale_offset.is_contiguous():
        raise KernelInputError("scale_offset must be contiguous")
    check_same_device(x=x, qweight=qweight, scale_offset=scale_offset, **check_bias(bias, n, FLOAT_DTYPES))
    return m, n, k, k // n_groups


def gemv_int4_w32(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale_offset: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    tuning: GemvInt4W32Tuning | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """x @ W^T + bias for a few rows of x, W in the w32 int4 layout (:func:`repack_int4_w32`).

    Args:
        x: [M, K] activations (fp16, bf16 or fp32), unit stride in K.
        qweight: [N, K/8] int32 interleaved nibbles.
        scale_offset: [N, K/group, 2] fp16 or bf16, contiguous.
        bias: optional [N].
        out: optional [M, N] result buffer in x's dtype.
        tuning: launch parameters (Triton only; default :func:`tuning_int4_w32`).
        backend: "auto" (Triton on CUDA tensors when it imports), "triton" or "torch".

    Returns:
        [M, N] in x's dtype.
    """
    m, n, k, group = _check(x, qweight, scale_offset, bias)
    if out is None:
        out = x.new_empty((m, n))
    else:
        check_tensor("out", out, 2, (x.dtype,))
        check_shape("out", out, (m, n))
    tune = _tune(tuning, n, k, group)
    tensors = [x, qweight, scale_offset] + ([bias] if bias is not None else [])
    if not (m and use_triton(backend, *tensors)):
        return out.copy_(gemv_int4_w32_reference(x, qweight, scale_offset, bias))
    _launch(x, qweight, scale_offset, bias, out, tune)
    return out


def _launch(x, qweight, scale_offset, bias, out, tune: GemvInt4W32Tuning, prologue: int = _prologue.NONE,
            residual=None, gain=None, h_out=None, eps: float = 0.0) -> None:
    """The kernel over x [M, K] (SILU: gate/up [M, 2K]) and the w32 weight [N, K] -> out [M, N]."""
    n, k = qweight.shape[0], qweight.shape[1] * 8
    group = k // scale_offset.shape[1]
    # shape: x [M, K], qweight [N, K/8], scale_offset [N, K/group, 2] -> out [M, N]
    assert qweight.shape == (n, k // 8) and scale_offset.shape == (n, k // group, 2)
    r = residual if residual is not None else x
    h = h_out if h_out is not None else out
    pdl = _pdl.pdl_launch(x)
    split, per = split_k_plan(k // group, tune)
    if split > 1 and prologue in (_prologue.NORM, _prologue.ADD_NORM):
        raise KernelInputError("split_k needs every column in one program for the RMSNorm prologue")
    ws, cnt = _split_k_buffers(x.device, x.shape[0], n, split) if split > 1 else (out, out)
    _gemv_int4_w32_kernel[(cdiv(n, tune.block_n), x.shape[0], split)](
        x, qweight, scale_offset, bias if bias is not None else scale_offset, out,
        r, gain if gain is not None else scale_offset, h, n, k,
        x.stride(0), qweight.stride(0), scale_offset.stride(0), out.stride(0), r.stride(0), h.stride(0),
        float(eps), 1.0 / (k * (tune.block_n if tune.x_per_row else 1)),
        GROUP=group, HAS_BIAS=bias is not None, BLOCK_N=tune.block_n, GROUPS=tune.groups,
        EVEN=n % tune.block_n == 0 and (k // group) % tune.groups == 0, X_PER_ROW=tune.x_per_row,
        PROLOGUE=prologue, NORM=prologue in (_prologue.NORM, _prologue.ADD_NORM), PDL=pdl,
        PREFETCH=tune.prefetch, ws_ptr=ws, cnt_ptr=cnt, per=per, SPLIT=split,
        MANT=tune.mantissa_unpack, num_warps=tune.num_warps,
        num_stages=tune.num_stages, **_pdl.launch_options(pdl),
    )


def split_k_plan(n_groups: int, tune: GemvInt4W32Tuning) -> tuple[int, int]:
    """(programs per row block, groups per program) for ``tune.split_k``: whole K steps per split and no empty
    split (at most one split per K step), so split 2 of a one-step K is no split."""
    steps = cdiv(n_groups, tune.groups)
    per_steps = cdiv(steps, max(1, tune.split_k))
    return cdiv(steps, per_steps), per_steps * tune.groups


# (device, M, N, split) -> (fp32 partials [split, M, N], int32 counters [M * N]); the counters are zero between
# launches (the last program of a row block resets its own), so a CUDA graph may capture and replay launches.
# Launches that share a key must not run concurrently (one stream, or PDL: a kernel touches them after its wait)
_SPLIT_BUFFERS: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _split_k_buffers(device: torch.device, m: int, n: int, split: int) -> tuple[torch.Tensor, torch.Tensor]:
    key = (str(device), m, n, split)
    if key not in _SPLIT_BUFFERS:
        _SPLIT_BUFFERS[key] = (torch.empty((split, m, n), device=device, dtype=torch.float32),
                               torch.zeros(m * n, device=device, dtype=torch.int32))
    return _SPLIT_BUFFERS[key]


# ---- with a fused prologue (kernels._prologue): RMSNorm before qkv / gate_up, SiLU·mul before down ----------

def _tune(tuning: GemvInt4W32Tuning | None, n: int, k: int, group: int) -> GemvInt4W32Tuning:
    tune = tuning or tuning_int4_w32(n, k, group)
    if tune.groups & (tune.groups - 1) or tune.block_n & (tune.block_n - 1):
        raise KernelInputError(f"tuning block_n and groups must be powers of two, got {tune}")
    if tune.split_k < 1:
        raise KernelInputError(f"tuning split_k must be >= 1, got {tune}")
    return tune


def gemv_int4_w32_rms_norm(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    qweight: torch.Tensor,
    scale_offset: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    residual: torch.Tensor | None = None,
    tuning: GemvInt4W32Tuning | None = None,
    backend: Backend = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """rms_norm(h) @ W^T + bias with h = x (+ residual) and W in the w32 layout, in one launch.

    Args:
        x, norm_weight, eps, residual: as :func:`kernels.gemv_rms_norm`.
        qweight, scale_offset, bias, tuning, backend: as :func:`gemv_int4_w32`.

    Returns:
        (y [M, N], h [M, K]): h is the new residual stream (x itself when no residual is given).
    """
    check_norm_args(x, norm_weight, residual)
    m, n, k, group = _check(x, qweight, scale_offset, bias)
    kind = _prologue.ADD_NORM if residual is not None else _prologue.NORM
    tune = _tune(tuning or _prologue.tuned("w32", kind, n, k), n, k, group)
    if tuning is None and tune.split_k > 1:  # a split recorded for the plain GEMV: the norm needs all of K here
        tune = dataclasses.replace(tune, split_k=1)
    tensors = [x, qweight, scale_offset, norm_weight] + [t for t in (bias, residual) if t is not None]
    if not (m and use_triton(backend, *tensors)):
        h = x if residual is None else x + residual
        return gemv_int4_w32_reference(rms_norm_reference(h, norm_weight, eps), qweight, scale_offset, bias), h
    out = x.new_empty((m, n))
    h = torch.empty_like(x) if residual is not None else x
    _launch(x, qweight, scale_offset, bias, out, tune, kind, residual, norm_weight, h, eps)
    return out, h


def gemv_int4_w32_silu_mul(
    gate_up: torch.Tensor,
    qweight: torch.Tensor,
    scale_offset: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    tuning: GemvInt4W32Tuning | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """silu(gate) * up @ W^T + bias, W in the w32 layout, in one launch (a SwiGLU MLP's down projection).

    Args:
        gate_up: [M, 2I] fused gate/up rows, gate first.
        qweight, scale_offset, bias, tuning, backend: as :func:`gemv_int4_w32` (K = I).

    Returns:
        [M, N] in gate_up's dtype.
    """
    check_tensor("gate_up", gate_up, 2, FLOAT_DTYPES)
    two_i = gate_up.shape[1]
    if two_i % 2:
        raise KernelInputError(f"gate_up must have an even number of columns, got {two_i}")
    m, n, k, group = _check(gate_up[:, :two_i // 2], qweight, scale_offset, bias)
    tune = _tune(tuning or _prologue.tuned("w32", _prologue.SILU, n, k), n, k, group)
    tensors = [gate_up, qweight, scale_offset] + ([bias] if bias is not None else [])
    if not (m and use_triton(backend, *tensors)):
        return gemv_int4_w32_reference(silu_mul_reference(gate_up), qweight, scale_offset, bias)
    out = gate_up.new_empty((m, n))
    _launch(gate_up, qweight, scale_offset, bias, out, tune, _prologue.SILU)
    return out
