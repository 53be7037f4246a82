"""KV store: scatter the new tokens' K/V rows into the paged cache.

Layouts: k, v [T, Hkv, D]; k_cache, v_cache [NB, BS, Hkv, D]; slot_mapping [T] int64 where token t goes to
flat slot s = slot_mapping[t] (block s // BS, offset s % BS) and s = -1 means "padding, skip".
Triton grid: (T,) — one program copies one token's Hkv x D tile of K and of V.
fp8 pools (``kernels.kv_quant``): the rows are quantized on the way in with the per-KV-head ``k_scale`` /
``v_scale`` [Hkv] fp32.
"""

from __future__ import annotations

import torch

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
from .kv_quant import check_kv_scales, quantize_kv

__all__ = ["store_kv", "store_kv_reference"]


def store_kv_reference(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> None:
    """Torch reference of :func:`store_kv` (same arguments, writes in place)."""
    nb, bs = k_cache.shape[:2]
    valid = slot_mapping >= 0  # padding slots are skipped
    slots = slot_mapping[valid]
    if slots.numel() == 0:
        return
    if int(slots.max()) >= nb * bs:
        raise KernelInputError(f"slot_mapping holds slot {int(slots.max())} >= cache size {nb * bs}")
    blk, off = slots // bs, slots % bs
    k, v = k[valid], v[valid]
    if k_scale is not None:  # fp8 pools, written as bytes (index kernels do not all take float8)
        k, v = quantize_kv(k, k_scale).view(torch.uint8), quantize_kv(v, v_scale).view(torch.uint8)
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    k_cache[blk, off] = k
    v_cache[blk, off] = v


if HAS_TRITON:
    from .kv_quant import quantize_fp8

    @triton.jit
    def _store_kv_kernel(
        k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, ks_ptr, vs_ptr,
        s_kt, s_kh, s_vt, s_vh,
        s_kcb, s_kcs, s_kch, s_vcb, s_vcs, s_vch,
        num_slots, HKV, D,
        BS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, QUANT: tl.constexpr,
    ):
        t = tl.program_id(0)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        blk = slot // BS
        off = slot % BS
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        # padding (-1) and out-of-range slots are skipped, so a bad slot can never write out of bounds
        heads = tl.where((slot >= 0) & (slot < num_slots), HKV, 0)
        mask = (h < heads) & (d < D)
        k = tl.load(k_ptr + t.to(tl.int64) * s_kt + h * s_kh + d, mask=mask)
        v = tl.load(v_ptr + t.to(tl.int64) * s_vt + h * s_vh + d, mask=mask)
        if QUANT:  # fp8 pools: per-KV-head scales [Hkv]
            k = quantize_fp8(k, tl.load(ks_ptr + h, mask=h < HKV, other=1.0), kc_ptr.dtype.element_ty)
            v = quantize_fp8(v, tl.load(vs_ptr + h, mask=h < HKV, other=1.0), vc_ptr.dtype.element_ty)
        tl.store(kc_ptr + blk * s_kcb + off * s_kcs + h * s_kch + d, k, mask=mask)
        tl.store(vc_ptr + blk * s_vcb + off * s_vcs + h * s_vch + d, v, mask=mask)


def _store_kv_triton(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale) -> None:
    t, hkv, d = k.shape
    nb, bs = k_cache.shape[:2]
    quant = k_scale is not None
    _store_kv_kernel[(t,)](
        k, v, k_cache, v_cache, slot_mapping, k_scale if quant else k, v_scale if quant else v,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        nb * bs, hkv, d,
        BS=bs, BLOCK_H=next_pow2(hkv), BLOCK_D=next_pow2(d), QUANT=quant,
    )


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    backend: Backend = "auto",
) -> None:
    """Write token t's K/V rows to flat cache slot ``slot_mapping[t]``; slot -1 is skipped.

    Args:
        k, v: [T, Hkv, D], same dtype as the caches (any float dtype for fp8 caches).
        k_cache, v_cache: [NB, BS, Hkv, D] paged pools, written in place; fp8 e4m3 pools store
            ``clamp(x / scale, -448, 448)``.
        slot_mapping: [T] int64 flat slots (block * BS + offset), -1 for padding tokens.
        k_scale, v_scale: [Hkv] fp32 per-KV-head scales, with fp8 pools only.
        backend: "auto" (Triton on CUDA tensors when it imports), "triton" or "torch".

    Raises:
        KernelInputError: a dtype, shape, stride or device mismatch.
    """
    nb, bs, hkv, d = check_cache_pair(k_cache, v_cache)
    check_tensor("k", k, 3, FLOAT_DTYPES)
    check_tensor("v", v, 3, FLOAT_DTYPES)
    check_tensor("slot_mapping", slot_mapping, 1, (torch.int64,))
    t = k.shape[0]
    check_shape("k", k, (t, hkv, d))
    check_shape("v", v, (t, hkv, d))
    check_shape("slot_mapping", slot_mapping, (t,))
    quantized = check_kv_scales(k_cache, k_scale, v_scale)
    check_same_dtype(k=k, v=v, **({} if quantized else {"k_cache": k_cache}))
    check_same_device(k=k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    if t == 0:
        return
    if use_triton(backend, k, v, k_cache, v_cache, slot_mapping):
        _store_kv_triton(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    else:
        store_kv_reference(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
