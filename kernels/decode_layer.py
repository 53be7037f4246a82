"""A batch-1 decode layer in four GEMV launches (+ attention): norms, SiLU·mul, RoPE, the K/V store and the
residual adds ride in the GEMVs' prologues and epilogues.

Why: a batch-1 Qwen2.5-0.5B step ran ~10 kernels per layer (add+RMSNorm, QKV GEMV, RoPE+store, attention
partition and merge, O GEMV, add+RMSNorm, gate/up GEMV, SiLU·mul, down GEMV), each 1.5-5 µs, so launches,
not weight bytes, bound it (docs/benchmarks.md, issue 19 item 2). Here a layer is

1. :func:`norm_qkv_rope_store`: ``rms_norm(h)`` → QKV GEMV (+ bias) → RoPE of q and k → k, v into their
   cache slot, q out;
2. the paged decode attention (unchanged: ``kernels.paged_decode_attention``);
3. :func:`gemv_add_residual`: O GEMV, ``h += y`` in place (the residual stream);
4. :func:`norm_gate_up_silu`: ``rms_norm(h)`` → gate/up GEMV → ``silu(gate) * up``;
5. :func:`gemv_add_residual` again: down GEMV, ``h += y``.

How each fused kernel stays as cheap as the GEMV it replaces (the session-16 GEMV prologues did not:
+3-5 µs each on an H100, docs/benchmarks.md "Decode fusions"). Those did the add of the residual and the
store of the new stream in every program's prologue and loaded x, the residual and the gain per K step at
two weight rows a program, so a program's side loads outweighed its weight loads. Here:

* The residual add moves to the *previous* GEMV's epilogue (step 3/5: each program adds and stores only its
  own output rows), so a norm GEMV reads one vector h, already summed, and the gain.
* ``rms_norm(h) W^T = inv * ((h * g) W^T)``: the sum of squares accumulates from the h values the program
  loads anyway (one FMA a column), and ``inv`` scales the outputs once, after the weights: no pass over h
  before the weights stream, no reduction kernel.
* Every program owns two row tiles that share one load of x: the (d, d + D/2) halves of a head for RoPE, the
  gate and up rows of the same MLP channel for SiLU·mul, two adjacent tiles otherwise. The side loads
  (x, gain) are amortised over twice the rows of the plain GEMV's program, and the epilogue needs no other
  program's output.
* The next tile's weights load before this tile's x (register double-buffering), and with PDL the first
  tile's weights load before ``griddepcontrol.wait``.

Weights: bf16/fp16/fp32 ``[N, K]`` (the ``kernels.gemv`` layout) or int4 in the w32 layout
(``kernels.repack_int4_w32``: ``qweight [N, K/8]`` int32 + ``scale_offset [N, K/group, 2]``).

Numerics against the unfused ops (each launcher's ``*_reference``): the GEMV outputs are rounded to the
activations' dtype before RoPE, SiLU·mul and the residual add, as the unfused kernels receive them; the normed
row is not rounded to bf16 before the product (fp32: as the session-16 prologues, slightly more exact), so
bf16 results agree to rounding, fp32 ones to ~1e-6.
"""

from __future__ import annotations

import dataclasses

import torch

from . import _pdl
from ._common import (
    FLOAT_DTYPES,
    HAS_TRITON,
    Backend,
    cdiv,
    check_cache_pair,
    check_same_device,
    check_same_dtype,
    check_shape,
    check_tensor,
    tl,
    triton,
    use_triton,
)
from .errors import KernelInputError
from .gemv import gemv_reference
from .gemv_int4_w32 import GROUP_SIZES, SCALE_DTYPES, gemv_int4_w32_reference, triton_next_pow2
from .rms_norm import rms_norm_reference
from .rope_store_kv import rope_store_kv_reference
from .silu_mul import silu_mul_reference

if HAS_TRITON:
    from ._pdl import pdl_wait
    from .gemv_int4_w32 import _nibble_as_float, _w32_tile

__all__ = ["DecodeLayerTuning", "gemv_add_residual", "gemv_add_residual_reference", "norm_gate_up_silu",
           "norm_gate_up_silu_reference", "norm_qkv_rope_store", "norm_qkv_rope_store_reference"]

RESIDUAL, SILU, ROPE = 0, 1, 2  # the epilogues


@dataclasses.dataclass(frozen=True)
class DecodeLayerTuning:
    """Launch parameters: rows per tile (a program owns two tiles), K per step (16-bit weights: columns;
    int4: groups), warps. None: chosen from the weight and the epilogue (:func:`_default_tuning`)."""

    block_n: int = 2
    block_k: int = 1024
    num_warps: int = 4
    # issue the next K step's weight loads before this step's x loads and FMAs (register double-buffering,
    # more registers); False: after them
    prefetch: bool = True


def _default_tuning(int4: bool, k: int, group: int, epi: int) -> DecodeLayerTuning:
    """As many programs as the plain GEMV the kernel replaces runs, or more: 16-bit weights 2 rows a program
    (1 per half) for the residual and RoPE epilogues, 4 for gate/up (2 per half: 4864-8192 channels,
    programs to spare); int4 4 rows a program (2 per half; ``tuning_int4_w32``'s 4), 8 for gate/up. K steps of
    512 16-bit columns or up to 1024 int4 ones, the next step prefetched. Chosen from the sm_90 compile
    (bench/results/q23_s23/compile_sm90.txt), not yet measured: 32-64 registers (int4: 55-96), against 40 for
    the plain GEMV and 64 / 125 for the session-16 norm / SiLU·mul prologue GEMVs."""
    wide = epi == SILU
    if not int4:
        return DecodeLayerTuning(2 if wide else 1, min(512, triton_next_pow2(k)), 4)
    return DecodeLayerTuning(4 if wide else 2, min(triton_next_pow2(k // group), max(1, 1024 // group)), 4)


if HAS_TRITON:

    @triton.jit
    def _x_cols(x_row, g_ptr, cols, ok, ss, NORM: tl.constexpr):
        """x at ``cols`` in fp32, times the norm gain (NORM); ss gains the squares of the raw x."""
        x = tl.load(x_row + cols, mask=ok, other=0.0).to(tl.float32)
        if NORM:
            ss += x * x
            x = x * tl.load(g_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        return x, ss

    @triton.jit
    def _dense_tiles(w_ptr, rows_lo, rows_hi, ok_lo, ok_hi, s_wn, k0, K, BLOCK_K: tl.constexpr):
        cols = k0 + tl.arange(0, BLOCK_K)
        c_ok = cols < K
        w_lo = tl.load(w_ptr + rows_lo.to(tl.int64)[:, None] * s_wn + cols[None, :],
                       mask=ok_lo[:, None] & c_ok[None, :], other=0.0, eviction_policy="evict_first")
        w_hi = tl.load(w_ptr + rows_hi.to(tl.int64)[:, None] * s_wn + cols[None, :],
                       mask=ok_hi[:, None] & c_ok[None, :], other=0.0, eviction_policy="evict_first")
        return w_lo, w_hi

    @triton.jit
    def _dense_dot(w_ptr, x_row, g_ptr, rows_lo, rows_hi, ok_lo, ok_hi, s_wn, K,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr,
                   PREFETCH: tl.constexpr):
        """(W[rows_lo] x', W[rows_hi] x', sum of x^2) over K, x' = x * gain (NORM) or x; fp32."""
        acc_lo = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        acc_hi = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        ss = tl.zeros([BLOCK_K], dtype=tl.float32)
        w_lo, w_hi = _dense_tiles(w_ptr, rows_lo, rows_hi, ok_lo, ok_hi, s_wn, 0, K, BLOCK_K)
        pdl_wait(PDL)  # the first step's weights were loaded before: no kernel writes them
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            if PREFETCH:  # the next step's weights in flight while this one's x loads and multiplies
                n_lo, n_hi = _dense_tiles(w_ptr, rows_lo, rows_hi, ok_lo, ok_hi, s_wn, k0 + BLOCK_K, K, BLOCK_K)
            x, ss = _x_cols(x_row, g_ptr, cols, cols < K, ss, NORM)
            acc_lo += w_lo.to(tl.float32) * x[None, :]
            acc_hi += w_hi.to(tl.float32) * x[None, :]
            if PREFETCH:
                w_lo, w_hi = n_lo, n_hi
            else:  # masked off past K
                w_lo, w_hi = _dense_tiles(w_ptr, rows_lo, rows_hi, ok_lo, ok_hi, s_wn, k0 + BLOCK_K, K, BLOCK_K)
        return tl.sum(acc_lo, axis=1), tl.sum(acc_hi, axis=1), tl.sum(ss, axis=0)

    @triton.jit
    def _int4_dot(q_ptr, so_ptr, x_row, g_ptr, rows_lo, rows_hi, ok_lo, ok_hi, s_qn, s_sn, K,
                  GROUP: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, NORM: tl.constexpr,
                  PDL: tl.constexpr, PREFETCH: tl.constexpr):
        """:func:`_dense_dot` for w32 int4 weights (kernels.gemv_int4_w32's arithmetic: per weight one shift,
        one LOP3, one FMA; ``sum w x = 16 s sum f x + (o - 16 s) sum x`` per group), x loaded once for both
        tiles."""
        W: tl.constexpr = GROUP // 8
        n_groups = K // GROUP
        acc_lo = tl.zeros([BLOCK_N, GROUPS], dtype=tl.float32)
        acc_hi = tl.zeros([BLOCK_N, GROUPS], dtype=tl.float32)
        ss = tl.zeros([GROUPS, W], dtype=tl.float32)
        wl, sl, ol = _w32_tile(q_ptr, so_ptr, rows_lo, ok_lo, s_qn, s_sn, 0, n_groups, GROUP, GROUPS, False)
        wh, sh, oh = _w32_tile(q_ptr, so_ptr, rows_hi, ok_hi, s_qn, s_sn, 0, n_groups, GROUP, GROUPS, False)
        pdl_wait(PDL)
        for g0 in range(0, n_groups, GROUPS):
            if PREFETCH:
                nwl, nsl, nol = _w32_tile(q_ptr, so_ptr, rows_lo, ok_lo, s_qn, s_sn, g0 + GROUPS, n_groups, GROUP,
                                          GROUPS, False)
                nwh, nsh, noh = _w32_tile(q_ptr, so_ptr, rows_hi, ok_hi, s_qn, s_sn, g0 + GROUPS, n_groups, GROUP,
                                          GROUPS, False)
            gi = g0 + tl.arange(0, GROUPS)
            g_ok = (gi < n_groups)[:, None]
            col0 = gi[:, None] * GROUP + tl.arange(0, W)[None, :]      # [G, W] column of nibble 0
            d_lo = tl.zeros([BLOCK_N, GROUPS, W], dtype=tl.float32)
            d_hi = tl.zeros([BLOCK_N, GROUPS, W], dtype=tl.float32)
            xs = tl.zeros([GROUPS, W], dtype=tl.float32)
            for i in tl.static_range(8):
                xi, ss = _x_cols(x_row, g_ptr, col0 + i * W, g_ok, ss, NORM)
                d_lo += _nibble_as_float(wl, i) * xi[None, :, :]
                d_hi += _nibble_as_float(wh, i) * xi[None, :, :]
                xs += xi
            xsum = tl.sum(xs, axis=1)[None, :]
            s16 = 16.0 * sl
            acc_lo += s16 * tl.sum(d_lo, axis=2) + (ol - s16) * xsum
            s16 = 16.0 * sh
            acc_hi += s16 * tl.sum(d_hi, axis=2) + (oh - s16) * xsum
            if PREFETCH:
                wl, sl, ol, wh, sh, oh = nwl, nsl, nol, nwh, nsh, noh
            else:
                wl, sl, ol = _w32_tile(q_ptr, so_ptr, rows_lo, ok_lo, s_qn, s_sn, g0 + GROUPS, n_groups, GROUP,
                                       GROUPS, False)
                wh, sh, oh = _w32_tile(q_ptr, so_ptr, rows_hi, ok_hi, s_qn, s_sn, g0 + GROUPS, n_groups, GROUP,
                                       GROUPS, False)
        return tl.sum(acc_lo, axis=1), tl.sum(acc_hi, axis=1), tl.sum(tl.sum(ss, axis=1), axis=0)

    @triton.jit
    def _decode_layer_kernel(
        x_ptr, g_ptr, w_ptr, so_ptr, b_ptr, out_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, slot_ptr,
        N, K, s_xm, s_wn, s_sn, s_om, s_cos, s_kcb, s_kcs, s_kch, s_vcb, s_vcs, s_vch, eps, num_slots, HQ, HKV,
        EPI: tl.constexpr, NORM: tl.constexpr, INT4: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, PDL: tl.constexpr,
        PREFETCH: tl.constexpr,
    ):
        # EPI RESIDUAL: rows [2p BN, 2p BN + 2 BN) of N, out (the residual stream) += y in place.
        # EPI SILU: gate rows [p BN, p BN + BN) and the up rows N/2 below them -> out [M, N/2].
        # EPI ROPE: the (d, d + D/2) halves of one head (BN | D/2) -> q out [M, HQ, D] or the K/V cache.
        m = tl.program_id(1).to(tl.int64)
        p = tl.program_id(0)
        r = tl.arange(0, BLOCK_N)
        if EPI == 0:
            rows_lo = p * 2 * BLOCK_N + r
            rows_hi = rows_lo + BLOCK_N
            ok_lo, ok_hi = rows_lo < N, rows_hi < N
        elif EPI == 1:
            rows_lo = p * BLOCK_N + r
            rows_hi = rows_lo + N // 2
            ok_lo = rows_lo < N // 2
            ok_hi = ok_lo
        else:
            HALF: tl.constexpr = D // 2
            head = (p * BLOCK_N) // HALF
            dd = (p * BLOCK_N) % HALF + r                                 # [BN] column in the first half
            rows_lo = head * D + dd
            rows_hi = rows_lo + HALF
            ok_lo = rows_lo < N
            ok_hi = ok_lo
        x_row = x_ptr + m * s_xm
        if INT4:
            y_lo, y_hi, ss = _int4_dot(w_ptr, so_ptr, x_row, g_ptr, rows_lo, rows_hi, ok_lo, ok_hi, s_wn, s_sn,
                                       K, GROUP, BLOCK_N, BLOCK_K, NORM, PDL, PREFETCH)
        else:
            y_lo, y_hi, ss = _dense_dot(w_ptr, x_row, g_ptr, rows_lo, rows_hi, ok_lo, ok_hi, s_wn, K,
                                        BLOCK_N, BLOCK_K, NORM, PDL, PREFETCH)
        if NORM:  # rms_norm(h) W^T = inv * ((h * g) W^T)
            inv = tl.rsqrt(ss / K + eps)
            y_lo *= inv
            y_hi *= inv
        if HAS_BIAS:
            y_lo += tl.load(b_ptr + rows_lo, mask=ok_lo, other=0.0).to(tl.float32)
            y_hi += tl.load(b_ptr + rows_hi, mask=ok_hi, other=0.0).to(tl.float32)
        dt = out_ptr.dtype.element_ty
        # the product rounded to the activations' dtype, as the unfused epilogue ops receive it
        y_lo = y_lo.to(dt).to(tl.float32)
        y_hi = y_hi.to(dt).to(tl.float32)
        o_row = out_ptr + m * s_om
        if EPI == 0:  # each program adds only its own rows: in place, no other program reads them
            r_lo = tl.load(o_row + rows_lo, mask=ok_lo, other=0.0).to(tl.float32)
            r_hi = tl.load(o_row + rows_hi, mask=ok_hi, other=0.0).to(tl.float32)
            tl.store(o_row + rows_lo, (y_lo + r_lo).to(dt), mask=ok_lo)
            tl.store(o_row + rows_hi, (y_hi + r_hi).to(dt), mask=ok_hi)
        elif EPI == 1:
            act = y_lo / (1.0 + tl.exp(-y_lo)) * y_hi
            tl.store(o_row + rows_lo, act.to(dt), mask=ok_lo)
        else:
            c = tl.load(cos_ptr + m * s_cos + dd).to(tl.float32)           # the table's halves repeat
            s = tl.load(sin_ptr + m * s_cos + dd).to(tl.float32)
            is_v = head >= HQ + HKV
            a_lo = tl.where(is_v, y_lo, y_lo * c - y_hi * s)
            a_hi = tl.where(is_v, y_hi, y_hi * c + y_lo * s)
            # masks from tensor comparisons only (Triton's interpreter refuses a scalar bool in a mask)
            q_ok = ok_lo & (rows_lo < HQ * D)
            q_dst = o_row + head * D + dd
            tl.store(q_dst, a_lo.to(dt), mask=q_ok)
            tl.store(q_dst + HALF, a_hi.to(dt), mask=q_ok)
            slot = tl.load(slot_ptr + m)
            slot_ok = (slot >= 0) & (slot < num_slots)                    # padding (-1) stores nothing
            slot = tl.where(slot_ok, slot, 0)
            kv_ok = ok_lo & (rows_lo >= HQ * D) & (dd < tl.where(slot_ok, HALF, 0))
            kh = tl.where(is_v, head - HQ - HKV, head - HQ)
            kh = tl.where(head >= HQ, kh, 0)
            blk, off = slot // BS, slot % BS
            k_dst = kc_ptr + blk * s_kcb + off * s_kcs + kh * s_kch + dd
            v_dst = vc_ptr + blk * s_vcb + off * s_vcs + kh * s_vch + dd
            k_ok = kv_ok & (rows_lo < (HQ + HKV) * D)
            v_ok = kv_ok & (rows_lo >= (HQ + HKV) * D)
            tl.store(k_dst, a_lo.to(kc_ptr.dtype.element_ty), mask=k_ok)
            tl.store(k_dst + HALF, a_hi.to(kc_ptr.dtype.element_ty), mask=k_ok)
            tl.store(v_dst, a_lo.to(vc_ptr.dtype.element_ty), mask=v_ok)
            tl.store(v_dst + HALF, a_hi.to(vc_ptr.dtype.element_ty), mask=v_ok)


# ---- arguments ------------------------------------------------------------------------------------------

def _weight_shape(weight: torch.Tensor, scale_offset: torch.Tensor | None) -> tuple[int, int, int]:
    """(N, K, group) of a 16-bit weight [N, K] (group 0) or a w32 int4 one (qweight [N, K/8] int32)."""
    if scale_offset is None:
        check_tensor("weight", weight, 2, FLOAT_DTYPES)
        return weight.shape[0], weight.shape[1], 0
    check_tensor("weight", weight, 2, (torch.int32,))
    check_tensor("scale_offset", scale_offset, 3, SCALE_DTYPES)
    n, k = weight.shape[0], weight.shape[1] * 8
    n_groups = scale_offset.shape[1]
    if n_groups == 0 or k % n_groups or k // n_groups not in GROUP_SIZES:
        raise KernelInputError(f"int4 weights need a group size in {GROUP_SIZES} dividing K={k}")
    check_shape("scale_offset", scale_offset, (n, n_groups, 2))
    if not scale_offset.is_contiguous():
        raise KernelInputError("scale_offset must be contiguous")
    return n, k, k // n_groups


def _product_reference(x: torch.Tensor, weight: torch.Tensor, scale_offset: torch.Tensor | None,
                       bias: torch.Tensor | None) -> torch.Tensor:
    if scale_offset is None:
        return gemv_reference(x, weight, bias)
    return gemv_int4_w32_reference(x, weight, scale_offset, bias)


def _check_x(name: str, x: torch.Tensor, k: int) -> int:
    check_tensor(name, x, 2, FLOAT_DTYPES)
    check_shape(name, x, (x.shape[0], k))
    return x.shape[0]


def _check_norm(h: torch.Tensor, norm_weight: torch.Tensor) -> None:
    check_tensor("norm_weight", norm_weight, 1, FLOAT_DTYPES)
    check_shape("norm_weight", norm_weight, (h.shape[1],))


def _check_16bit(x: torch.Tensor, weight: torch.Tensor, scale_offset: torch.Tensor | None, **more) -> None:
    """One dtype for x, a 16-bit weight and the rest; one device for everything."""
    if scale_offset is None:
        check_same_dtype(x=x, weight=weight, **more)
    else:
        check_same_dtype(x=x, **more)
    check_same_device(x=x, weight=weight, **({} if scale_offset is None else {"scale_offset": scale_offset}),
                      **more)


def _tune(tuning: DecodeLayerTuning | None, int4: bool, k: int, group: int, epi: int) -> DecodeLayerTuning:
    tune = tuning or _default_tuning(int4, k, group, epi)
    if tune.block_n & (tune.block_n - 1) or tune.block_k & (tune.block_k - 1):
        raise KernelInputError(f"tuning block_n and block_k must be powers of two, got {tune}")
    return tune


def _launch(grid_n: int, x, gain, weight, scale_offset, bias, out, tune: DecodeLayerTuning, epi: int, n: int,
            k: int, group: int, eps: float = 0.0, rope: tuple | None = None) -> None:
    """The kernel over x [M, K] -> out ([M, ...] by epilogue); rope: (cos, sin, k_cache, v_cache, slots, hq,
    hkv) for the ROPE epilogue."""
    pdl = _pdl.pdl_launch(x)
    cos, sin, kc, vc, slots, hq, hkv = rope if rope is not None else (x, x, x[None, None], x[None, None], x, 0,
                                                                      0)
    d = kc.shape[-1] if rope is not None else 2
    bs = kc.shape[1] if rope is not None else 1
    num_slots = kc.shape[0] * kc.shape[1] if rope is not None else 0
    _decode_layer_kernel[(grid_n, x.shape[0])](
        x, gain if gain is not None else x, weight, scale_offset if scale_offset is not None else weight,
        bias if bias is not None else x, out, cos, sin, kc, vc, slots,
        n, k, x.stride(0), weight.stride(0), scale_offset.stride(0) if scale_offset is not None else 0,
        out.stride(0), cos.stride(0), kc.stride(0), kc.stride(1), kc.stride(2), vc.stride(0), vc.stride(1),
        vc.stride(2), float(eps), num_slots, hq, hkv,
        EPI=epi, NORM=gain is not None, INT4=scale_offset is not None, GROUP=max(group, 16),
        HAS_BIAS=bias is not None, BLOCK_N=tune.block_n, BLOCK_K=tune.block_k, D=d, BS=bs, PDL=pdl,
        PREFETCH=tune.prefetch, num_warps=tune.num_warps, **_pdl.launch_options(pdl),
    )


# ---- (3)/(5): GEMV + residual add ------------------------------------------------------------------------

def gemv_add_residual_reference(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor,
                                scale_offset: torch.Tensor | None = None) -> torch.Tensor:
    """Torch reference of :func:`gemv_add_residual`: the GEMV rounded to x's dtype, then ``residual + y``
    (in place, rounded to the residual's dtype, as ``kernels.add_rms_norm`` forms it)."""
    y = _product_reference(x, weight, scale_offset, None)
    return residual.copy_((residual.float() + y.float()).to(residual.dtype))


def gemv_add_residual(
    x: torch.Tensor,
    weight: torch.Tensor,
    residual: torch.Tensor,
    scale_offset: torch.Tensor | None = None,
    *,
    tuning: DecodeLayerTuning | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """``residual += x @ W^T`` in one launch (a layer's O or down projection and its residual add).

    Args:
        x: [M, K] activations (fp16, bf16 or fp32), unit stride in K.
        weight: [N, K] of x's dtype, or int4 ``qweight [N, K/8]`` int32 with ``scale_offset`` (w32 layout).
        residual: [M, N] of x's dtype, updated in place.
        scale_offset: [N, K/group, 2] fp16/bf16 for int4 weights, else None.
        tuning: launch parameters (Triton only); backend: "auto", "triton" or "torch".

    Returns:
        residual (the same tensor).
    """
    n, k, group = _weight_shape(weight, scale_offset)
    m = _check_x("x", x, k)
    check_tensor("residual", residual, 2, FLOAT_DTYPES)
    check_shape("residual", residual, (m, n))
    _check_16bit(x, weight, scale_offset, residual=residual)
    tensors = [x, weight, residual] + ([scale_offset] if scale_offset is not None else [])
    if not (m and use_triton(backend, *tensors)):
        return gemv_add_residual_reference(x, weight, residual, scale_offset)
    tune = _tune(tuning, scale_offset is not None, k, group, RESIDUAL)
    _launch(cdiv(n, 2 * tune.block_n), x, None, weight, scale_offset, None, residual, tune, RESIDUAL, n, k, group)
    return residual


# ---- (4): RMSNorm + gate/up GEMV + SiLU·mul ------------------------------------------------------------

def norm_gate_up_silu_reference(h: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                                scale_offset: torch.Tensor | None = None) -> torch.Tensor:
    """Torch reference of :func:`norm_gate_up_silu`: rms_norm, the gate/up GEMV, silu_mul."""
    return silu_mul_reference(_product_reference(rms_norm_reference(h, norm_weight, eps), weight, scale_offset,
                                                 None))


def norm_gate_up_silu(
    h: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    scale_offset: torch.Tensor | None = None,
    *,
    tuning: DecodeLayerTuning | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """``silu(g) * u`` with ``[g | u] = rms_norm(h) @ W^T``, in one launch (a SwiGLU MLP up to its down).

    Args:
        h: [M, K] the residual stream; norm_weight: [K] RMSNorm gain; eps: added to the mean square.
        weight: the fused gate/up weight [2I, K] (gate rows first) of h's dtype, or int4 w32 with
            ``scale_offset``.
        tuning, backend: as :func:`gemv_add_residual`.

    Returns:
        [M, I] in h's dtype.
    """
    n, k, group = _weight_shape(weight, scale_offset)
    m = _check_x("h", h, k)
    _check_norm(h, norm_weight)
    if n % 2:
        raise KernelInputError(f"the gate/up weight needs an even number of rows, got {n}")
    _check_16bit(h, weight, scale_offset, norm_weight=norm_weight)
    tensors = [h, weight, norm_weight] + ([scale_offset] if scale_offset is not None else [])
    if not (m and use_triton(backend, *tensors)):
        return norm_gate_up_silu_reference(h, norm_weight, eps, weight, scale_offset)
    tune = _tune(tuning, scale_offset is not None, k, group, SILU)
    out = h.new_empty((m, n // 2))
    _launch(cdiv(n // 2, tune.block_n), h, norm_weight, weight, scale_offset, None, out, tune, SILU, n, k, group,
            eps)
    return out


# ---- (1): RMSNorm + QKV GEMV + RoPE + K/V store ------------------------------------------------------------

def norm_qkv_rope_store_reference(h: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                                  bias: torch.Tensor | None, num_heads: int, num_kv_heads: int,
                                  cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                                  v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                                  scale_offset: torch.Tensor | None = None) -> torch.Tensor:
    """Torch reference of :func:`norm_qkv_rope_store`: rms_norm, the QKV GEMV, rope_store_kv."""
    qkv = _product_reference(rms_norm_reference(h, norm_weight, eps), weight, scale_offset, bias)
    return rope_store_kv_reference(qkv, num_heads, num_kv_heads, cos, sin, k_cache, v_cache, slot_mapping)


def norm_qkv_rope_store(
    h: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    num_heads: int,
    num_kv_heads: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    scale_offset: torch.Tensor | None = None,
    *,
    tuning: DecodeLayerTuning | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """RMSNorm, the fused QKV projection, RoPE of q and k and the K/V store, in one launch.

    Args:
        h: [M, K] the residual stream; norm_weight: [K] the gain; eps: added to the mean square.
        weight: [(Hq + 2 Hkv) D, K] q, k, v rows (``engine.fused``'s order) of h's dtype, or int4 w32 with
            ``scale_offset``; bias: optional [(Hq + 2 Hkv) D] of h's dtype.
        num_heads, num_kv_heads: Hq and Hkv.
        cos, sin: [M, D] fp32 RoPE tables (halves equal).
        k_cache, v_cache: [NB, BS, Hkv, D] pools of h's dtype (fp8 pools: use the unfused path), written in place.
        slot_mapping: [M] int64 flat slots, -1: padding (nothing stored; q still computed).
        tuning, backend: as :func:`gemv_add_residual` (``block_n`` must divide D / 2).

    Returns:
        q [M, Hq, D] (rotated), in h's dtype.
    """
    n, k, group = _weight_shape(weight, scale_offset)
    m = _check_x("h", h, k)
    _check_norm(h, norm_weight)
    _, _, hkv, d = check_cache_pair(k_cache, v_cache)
    if num_kv_heads != hkv or num_heads % hkv or d % 2:
        raise KernelInputError(f"need Hkv = the cache's {hkv} dividing Hq and an even head_dim, got "
                               f"Hq={num_heads}, Hkv={num_kv_heads}, D={d}")
    check_shape("weight rows", weight[:, 0], ((num_heads + 2 * hkv) * d,))
    if bias is not None:
        check_tensor("bias", bias, 1, FLOAT_DTYPES)
        check_shape("bias", bias, (n,))
    for name, table in (("cos", cos), ("sin", sin)):
        check_tensor(name, table, 2, (torch.float32,))
        check_shape(name, table, (m, d))
    if cos.stride() != sin.stride():
        raise KernelInputError(f"cos and sin must share strides, got {cos.stride()} and {sin.stride()}")
    check_tensor("slot_mapping", slot_mapping, 1, (torch.int64,))
    check_shape("slot_mapping", slot_mapping, (m,))
    more = dict(norm_weight=norm_weight, k_cache=k_cache, v_cache=v_cache, **({} if bias is None else
                                                                              {"bias": bias}))
    _check_16bit(h, weight, scale_offset, **more)
    check_same_device(h=h, cos=cos, sin=sin, slot_mapping=slot_mapping)
    tensors = [h, weight, norm_weight, cos, sin, k_cache, v_cache, slot_mapping] + [
        t for t in (bias, scale_offset) if t is not None]
    if not (m and use_triton(backend, *tensors)):
        return norm_qkv_rope_store_reference(h, norm_weight, eps, weight, bias, num_heads, hkv, cos, sin, k_cache,
                                             v_cache, slot_mapping, scale_offset)
    tune = _tune(tuning, scale_offset is not None, k, group, ROPE)
    if (d // 2) % tune.block_n:
        raise KernelInputError(f"block_n={tune.block_n} must divide head_dim / 2 = {d // 2}")
    q = h.new_empty((m, num_heads, d))
    # shape: q [M, Hq, D] contiguous: row m of the out pointer is q[m] (stride Hq * D)
    _launch(n // tune.block_n // 2, h, norm_weight, weight, scale_offset, bias, q.view(m, -1), tune, ROPE, n, k,
            group, eps, (cos, sin, k_cache, v_cache, slot_mapping, num_heads, hkv))
    return q
