"""KV store: scatter the new tokens' K/V rows into the paged cache.

Layouts: k, v [T, Hkv, D]; k_cache, v_cache [NB, BS, Hkv, D]; slot_mapping [T] int64 where token t goes to
flat slot s = slot_mapping[t] (block s // BS, offset s % BS) and s = -1 means "padding, skip".
Triton grid: (T,) — one program copies one token's Hkv x D tile of K and of V.
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

__all__ = ["store_kv", "store_kv_reference"]


def store_kv_reference(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
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
    k_cache[blk, off] = k[valid]
    v_cache[blk, off] = v[valid]


if HAS_TRITON:

    @triton.jit
    def _store_kv_kernel(
        k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
        s_kt, s_kh, s_vt, s_vh,
        s_kcb, s_kcs, s_kch, s_vcb, s_vcs, s_vch,
        num_slots, HKV, D,
        BS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
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
        tl.store(kc_ptr + blk * s_kcb + off * s_kcs + h * s_kch + d, k, mask=mask)
        tl.store(vc_ptr + blk * s_vcb + off * s_vcs + h * s_vch + d, v, mask=mask)


def _store_kv_triton(k, v, k_cache, v_cache, slot_mapping) -> None:
    t, hkv, d = k.shape
    nb, bs = k_cache.shape[:2]
    _store_kv_kernel[(t,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        nb * bs, hkv, d,
        BS=bs, BLOCK_H=next_pow2(hkv), BLOCK_D=next_pow2(d),
    )


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    backend: Backend = "auto",
) -> None:
    """Write token t's K/V rows to flat cache slot ``slot_mapping[t]``; slot -1 is skipped.

    Args:
        k, v: [T, Hkv, D], same dtype as the caches.
        k_cache, v_cache: [NB, BS, Hkv, D] paged pools, written in place.
        slot_mapping: [T] int64 flat slots (block * BS + offset), -1 for padding tokens.
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
    check_same_dtype(k=k, v=v, k_cache=k_cache)
    check_same_device(k=k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    if t == 0:
        return
    if use_triton(backend, k, v, k_cache, v_cache, slot_mapping):
        _store_kv_triton(k, v, k_cache, v_cache, slot_mapping)
    else:
        store_kv_reference(k, v, k_cache, v_cache, slot_mapping)
