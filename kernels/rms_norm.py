"""Fused RMSNorm, optionally with the residual add before it (one pass over the row instead of three).

Layouts: x, residual [T, H]; weight [H]. Grid: (T,) — one program normalizes one row in fp32.
Numerics follow HF Llama (and engine.model.RMSNorm): the residual sum is rounded to x's dtype before it is
normalized, and the norm is taken in fp32; the gain is applied in fp32 and the result rounded once.
"""

from __future__ import annotations

import torch

from . import _pdl
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

__all__ = ["add_rms_norm", "add_rms_norm_reference", "rms_norm", "rms_norm_reference"]


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Torch reference of :func:`rms_norm`."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of :func:`add_rms_norm`."""
    h = x + residual
    return rms_norm_reference(h, weight, eps), h


if HAS_TRITON:
    from ._pdl import pdl_wait

    @triton.jit
    def _rms_norm_kernel(
        x_ptr, r_ptr, w_ptr, out_ptr, sum_ptr,
        s_x, s_r, s_o, s_s, H, eps,
        HAS_RESIDUAL: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_H)
        mask = cols < H
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # the gain: no kernel writes it
        pdl_wait(PDL)
        x = tl.load(x_ptr + row * s_x + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(r_ptr + row * s_r + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(sum_ptr.dtype.element_ty)  # rounded like x + r
            tl.store(sum_ptr + row * s_s + cols, x, mask=mask)
        xf = x.to(tl.float32)
        inv = tl.rsqrt(tl.sum(xf * xf, 0) / H + eps)
        tl.store(out_ptr + row * s_o + cols, (xf * inv * w).to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x, residual, weight, eps):
    t, h = x.shape
    out = torch.empty_like(x)
    summed = torch.empty_like(x) if residual is not None else out
    r = residual if residual is not None else x
    block = next_pow2(h)
    pdl = _pdl.pdl_launch(x)
    _rms_norm_kernel[(t,)](
        x, r, weight, out, summed, x.stride(0), r.stride(0), out.stride(0), summed.stride(0), h, float(eps),
        HAS_RESIDUAL=residual is not None, BLOCK_H=block, num_warps=min(16, max(1, block // 256)), PDL=pdl,
        **_pdl.launch_options(pdl),
    )
    return out, summed


def _check(x, weight, residual=None) -> None:
    check_tensor("x", x, 2, FLOAT_DTYPES)
    check_tensor("weight", weight, 1, FLOAT_DTYPES)
    check_shape("weight", weight, (x.shape[1],))
    tensors = dict(x=x, weight=weight)
    if residual is not None:
        check_tensor("residual", residual, 2, FLOAT_DTYPES)
        check_shape("residual", residual, tuple(x.shape))
        check_same_dtype(x=x, residual=residual)
        tensors["residual"] = residual
    check_same_device(**tensors)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, backend: Backend = "auto") -> torch.Tensor:
    """weight * x / rms(x) per row.

    Args:
        x: [T, H] activations (fp16, bf16 or fp32).
        weight: [H] gain.
        eps: added to the mean square.
        backend: "auto" (Triton on CUDA tensors when it imports), "triton" or "torch".

    Returns:
        [T, H] in x's dtype.
    """
    _check(x, weight)
    if x.shape[0] and use_triton(backend, x, weight):
        return _launch(x, None, weight, eps)[0]
    return rms_norm_reference(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *, backend: Backend = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add then RMSNorm in one pass: h = x + residual; return (rms_norm(h), h).

    Args:
        x, residual: [T, H], same dtype.
        weight: [H] gain.
        eps: added to the mean square.
        backend: "auto" (Triton on CUDA tensors when it imports), "triton" or "torch".

    Returns:
        (normed [T, H], h [T, H]), both in x's dtype; h is the new residual stream.
    """
    _check(x, weight, residual)
    if x.shape[0] and use_triton(backend, x, residual, weight):
        return _launch(x, residual, weight, eps)
    return add_rms_norm_reference(x, residual, weight, eps)
