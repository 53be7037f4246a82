"""Fused rotary embedding of q and k in one launch (rotate-half layout of HF Llama: pairs (i, i + D/2)).

Layouts: q [T, Hq, D], k [T, Hkv, D] (strided views of a fused projection are fine); cos, sin [T, D] fp32
as produced by engine.model.RotaryEmbedding.cos_sin. Grid: (T,) — one program rotates every head of one
token, q and k, reading cos/sin once. Math in fp32, one rounding to the input dtype (as
engine.model.apply_rope).
"""

from __future__ import annotations

import torch

from ._common import (
    FLOAT_DTYPES,
    HAS_TRITON,
    Backend,
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

__all__ = ["rope", "rope_reference"]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    xf = x.float()
    rot = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos[:, None, :] + rot * sin[:, None, :]).to(x.dtype)


def rope_reference(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of :func:`rope`."""
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


if HAS_TRITON:

    @triton.jit
    def _rope_heads(x_ptr, o_ptr, t, s_xt, s_xh, s_ot, s_oh, NH, c, s, HALF,
                    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
        h = tl.arange(0, BLOCK_H)[:, None]
        i = tl.arange(0, BLOCK_HALF)[None, :]
        mask = (h < NH) & (i < HALF)
        src = x_ptr + t * s_xt + h * s_xh + i
        x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
        dst = o_ptr + t * s_ot + h * s_oh + i
        tl.store(dst, (x1 * c - x2 * s).to(o_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + HALF, (x2 * c + x1 * s).to(o_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rope_kernel(
        q_ptr, k_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr,
        s_qt, s_qh, s_kt, s_kh, s_cos, s_sin, s_qot, s_qoh, s_kot, s_koh, HQ, HKV, HALF,
        BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_HALF: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        i = tl.arange(0, BLOCK_HALF)[None, :]
        # rotate-half tables repeat: cos[:, :HALF] == cos[:, HALF:]
        c = tl.load(cos_ptr + t * s_cos + i, mask=i < HALF, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + t * s_sin + i, mask=i < HALF, other=0.0).to(tl.float32)
        _rope_heads(q_ptr, qo_ptr, t, s_qt, s_qh, s_qot, s_qoh, HQ, c, s, HALF, BLOCK_HQ, BLOCK_HALF)
        _rope_heads(k_ptr, ko_ptr, t, s_kt, s_kh, s_kot, s_koh, HKV, c, s, HALF, BLOCK_HKV, BLOCK_HALF)


def _rope_triton(q, k, cos, sin):
    t, hq, d = q.shape
    hkv = k.shape[1]
    qo, ko = torch.empty_like(q, memory_format=torch.contiguous_format), torch.empty_like(
        k, memory_format=torch.contiguous_format)
    _rope_kernel[(t,)](
        q, k, cos, sin, qo, ko,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0),
        qo.stride(0), qo.stride(1), ko.stride(0), ko.stride(1), hq, hkv, d // 2,
        BLOCK_HQ=next_pow2(hq), BLOCK_HKV=next_pow2(hkv), BLOCK_HALF=next_pow2(d // 2), num_warps=2,
    )
    return qo, ko


def rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, backend: Backend = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k by their tokens' positions (rotate-half layout), out of place.

    Args:
        q: [T, Hq, D]; k: [T, Hkv, D], same dtype; D even.
        cos, sin: [T, D] fp32 tables (halves equal, as RotaryEmbedding.cos_sin builds them).
        backend: "auto" (Triton on CUDA tensors when it imports), "triton" or "torch".

    Returns:
        (q_rot, k_rot), contiguous, in q's dtype.
    """
    check_tensor("q", q, 3, FLOAT_DTYPES)
    check_tensor("k", k, 3, FLOAT_DTYPES)
    check_tensor("cos", cos, 2, (torch.float32,))
    check_tensor("sin", sin, 2, (torch.float32,))
    t, _, d = q.shape
    if d % 2:
        raise KernelInputError(f"head_dim must be even for RoPE, got {d}")
    check_shape("k", k, (t, k.shape[1], d))
    check_shape("cos", cos, (t, d))
    check_shape("sin", sin, (t, d))
    check_same_dtype(q=q, k=k)
    check_same_device(q=q, k=k, cos=cos, sin=sin)
    if t and use_triton(backend, q, k, cos, sin):
        return _rope_triton(q, k, cos, sin)
    return rope_reference(q, k, cos, sin)
