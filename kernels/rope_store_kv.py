"""RoPE of q and k and the K/V store into the paged cache, in one launch, straight from the fused QKV row.

The fused forward ran ``kernels.rope`` (q and k rotated into new tensors) then ``kernels.store_kv`` (k and v
copied into the pool): two launches of ~1-1.5 µs per layer of a batch-1 step, and k written once only to be
read back. Here one program per token reads its q/k/v slices of the projection, writes the rotated q, and
writes the rotated k and the v straight into their cache slot.

Layouts: qkv [T, (Hq + 2 Hkv) * D] (q heads, then k heads, then v heads, as ``engine.fused`` concatenates
them); cos, sin [T, D] fp32 (``RotaryEmbedding.cos_sin``); k_cache, v_cache [NB, BS, Hkv, D];
slot_mapping [T] int64 (-1: padding, nothing stored). Returns q [T, Hq, D]. Grid: (T,).
fp8 pools (``kernels.kv_quant``): the rotated k (rounded to qkv's dtype first, as the unfused pair does) and
the v are quantized with the per-KV-head ``k_scale`` / ``v_scale`` [Hkv] fp32 on the way in.
"""

from __future__ import annotations

import torch

from . import _pdl
from ._common import (
    FLOAT_DTYPES,
    HAS_TRITON,
    Backend,
    check_cache_pair,
    check_same_device,
    check_same_dtype,
    check_shape,
    check_tensor,
    next_pow2,
    tl,
    triton,
    use_triton,
)
from .errors import KernelInputError
from .kv_quant import check_kv_scales
from .rope import rope_reference
from .store_kv import store_kv_reference

__all__ = ["rope_store_kv", "rope_store_kv_reference"]


def _split(qkv: torch.Tensor, hq: int, hkv: int, d: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    t = qkv.shape[0]
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=1)
    return q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d)


def rope_store_kv_reference(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, cos: torch.Tensor,
                            sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                            v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Torch reference of :func:`rope_store_kv`: ``rope`` then ``store_kv`` (writes the caches in place)."""
    q, k, v = _split(qkv, num_heads, num_kv_heads, k_cache.shape[-1])
    q, k = rope_reference(q, k, cos, sin)
    store_kv_reference(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return q


if HAS_TRITON:
    from ._pdl import pdl_wait
    from .kv_quant import quantize_fp8
    from .rope import _rope_heads

    @triton.jit
    def _rope_heads_fp8(x_ptr, o_ptr, scale_ptr, t, s_xt, s_oh, NH, c, s, HALF,
                        BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
        """``_rope_heads`` into an fp8 destination: rotate, round to x's dtype, quantize by head scale."""
        h = tl.arange(0, BLOCK_H)[:, None]
        i = tl.arange(0, BLOCK_HALF)[None, :]
        mask = (h < NH) & (i < HALF)
        src = x_ptr + t * s_xt + h * HALF * 2 + i
        x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
        scale = tl.load(scale_ptr + h, mask=h < NH, other=1.0)
        dst = o_ptr + h * s_oh + i
        y1 = (x1 * c - x2 * s).to(x_ptr.dtype.element_ty)  # the rotated k in qkv's dtype, as `rope` returns it
        y2 = (x2 * c + x1 * s).to(x_ptr.dtype.element_ty)
        tl.store(dst, quantize_fp8(y1, scale, o_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + HALF, quantize_fp8(y2, scale, o_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rope_store_kv_kernel(
        qkv_ptr, cos_ptr, sin_ptr, qo_ptr, kc_ptr, vc_ptr, slot_ptr, ks_ptr, vs_ptr,
        s_t, s_cos, s_sin, s_qot, s_qoh, s_kcb, s_kcs, s_kch, s_vcb, s_vcs, s_vch,
        num_slots, HQ, HKV, D,
        BS: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_HALF: tl.constexpr,
        BLOCK_D: tl.constexpr, QUANT: tl.constexpr, PDL: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        pdl_wait(PDL)
        half = D // 2
        i = tl.arange(0, BLOCK_HALF)[None, :]
        c = tl.load(cos_ptr + t * s_cos + i, mask=i < half, other=0.0).to(tl.float32)  # halves repeat
        s = tl.load(sin_ptr + t * s_sin + i, mask=i < half, other=0.0).to(tl.float32)
        _rope_heads(qkv_ptr, qo_ptr, t, s_t, D, s_qot, s_qoh, HQ, c, s, half, BLOCK_HQ, BLOCK_HALF)
        slot = tl.load(slot_ptr + t)
        ok = (slot >= 0) & (slot < num_slots)  # padding (-1) and out-of-range slots store nothing
        slot = tl.where(ok, slot, 0)
        kv_heads = tl.where(ok, HKV, 0)
        k_dst = kc_ptr + (slot // BS) * s_kcb + (slot % BS) * s_kcs
        # k_dst is already the token's slot: a token stride of 0 for the destination
        if QUANT:
            _rope_heads_fp8(qkv_ptr + HQ * D, k_dst, ks_ptr, t, s_t, s_kch, kv_heads, c, s, half, BLOCK_HKV,
                            BLOCK_HALF)
        else:
            _rope_heads(qkv_ptr + HQ * D, k_dst, t, s_t, D, 0, s_kch, kv_heads, c, s, half, BLOCK_HKV,
                        BLOCK_HALF)
        h = tl.arange(0, BLOCK_HKV)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        mask = (h < kv_heads) & (d < D)
        v = tl.load(qkv_ptr + t * s_t + (HQ + HKV) * D + h * D + d, mask=mask)
        if QUANT:
            v = quantize_fp8(v, tl.load(vs_ptr + h, mask=h < HKV, other=1.0), vc_ptr.dtype.element_ty)
        tl.store(vc_ptr + (slot // BS) * s_vcb + (slot % BS) * s_vcs + h * s_vch + d, v, mask=mask)


def rope_store_kv(
    qkv: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Rotate q and k of a fused projection, store k and v in the paged cache; return the rotated q.

    Args:
        qkv: [T, (Hq + 2 Hkv) * D] q, k, v heads side by side, of the caches' dtype.
        num_heads, num_kv_heads: Hq and Hkv.
        cos, sin: [T, D] fp32 RoPE tables (halves equal).
        k_cache, v_cache: [NB, BS, Hkv, D] paged pools, written in place (fp8 e4m3 pools: quantized).
        slot_mapping: [T] int64 flat slots, -1 for padding tokens (their q is still rotated).
        k_scale, v_scale: [Hkv] fp32 per-KV-head scales, with fp8 pools only.
        backend: "auto" (Triton on CUDA tensors when it imports), "triton" or "torch".

    Returns:
        q [T, Hq, D], contiguous, in qkv's dtype.

    Raises:
        KernelInputError: a dtype, shape, stride or device mismatch.
    """
    _, _, hkv, d = check_cache_pair(k_cache, v_cache)
    check_tensor("qkv", qkv, 2, FLOAT_DTYPES)
    check_tensor("cos", cos, 2, (torch.float32,))
    check_tensor("sin", sin, 2, (torch.float32,))
    check_tensor("slot_mapping", slot_mapping, 1, (torch.int64,))
    if num_kv_heads != hkv or num_heads % hkv or d % 2:
        raise KernelInputError(f"need Hkv = the cache's {hkv} dividing Hq and an even head_dim, got "
                               f"Hq={num_heads}, Hkv={num_kv_heads}, D={d}")
    t = qkv.shape[0]
    check_shape("qkv", qkv, (t, (num_heads + 2 * hkv) * d))
    for name, table in (("cos", cos), ("sin", sin)):
        check_shape(name, table, (t, d))
    check_shape("slot_mapping", slot_mapping, (t,))
    quantized = check_kv_scales(k_cache, k_scale, v_scale)
    if not quantized:
        check_same_dtype(qkv=qkv, k_cache=k_cache)
    check_same_device(qkv=qkv, cos=cos, sin=sin, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    if not (t and use_triton(backend, qkv, cos, sin, k_cache, v_cache, slot_mapping)):
        return rope_store_kv_reference(qkv, num_heads, hkv, cos, sin, k_cache, v_cache, slot_mapping, k_scale,
                                       v_scale)
    nb, bs = k_cache.shape[:2]
    q = qkv.new_empty((t, num_heads, d))
    pdl = _pdl.pdl_launch(qkv)
    _rope_store_kv_kernel[(t,)](
        qkv, cos, sin, q, k_cache, v_cache, slot_mapping, k_scale if quantized else cos,
        v_scale if quantized else cos,
        qkv.stride(0), cos.stride(0), sin.stride(0), q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        nb * bs, num_heads, hkv, d,
        BS=bs, BLOCK_HQ=next_pow2(num_heads), BLOCK_HKV=next_pow2(hkv), BLOCK_HALF=next_pow2(d // 2),
        BLOCK_D=next_pow2(d), QUANT=quantized, PDL=pdl, num_warps=2, **_pdl.launch_options(pdl),
    )
    return q
