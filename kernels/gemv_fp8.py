"""Weight-only FP8 GEMV for decode: y = (x @ W^T) * scale (+ bias), W in float8_e4m3fn.

The batch-1 decode path of ``cuda_weight_format = "fp8"`` (``engine.fp8``): the weight is stored as e4m3
with one fp32 scale per output row (``w[n, k] = scale[n] * weight[n, k]``), the activations stay in
their 16-bit dtype (weight-only: no activation rounding on the decode path), products and sums are fp32,
the row scale is applied once after the sum and the output is rounded once.

Layouts: x [M, K] (M small: each row is its own program column, so W is re-read from L2 per row);
weight [N, K] float8_e4m3fn, unit stride in K; scale [N] fp32; bias [N] of x's dtype or None; out [M, N].
Grid: (cdiv(N, BLOCK_N), M). A program keeps a [BLOCK_N, BLOCK_K] fp32 partial-product tile over its K
loop and reduces it once at the end, as :mod:`kernels.gemv`; one byte per weight instead of two, so a
step streams half the bytes of the bf16 GEMV.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

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

__all__ = ["FP8_DTYPE", "GemvFp8Tuning", "dequantize_fp8_rows", "gemv_fp8", "gemv_fp8_reference",
           "set_tuning_fp8", "tuning_fp8"]

FP8_DTYPE = torch.float8_e4m3fn


@dataclasses.dataclass(frozen=True)
class GemvFp8Tuning:
    """Launch parameters: output rows per program, K per loop step, warps, pipeline stages."""

    block_n: int = 4
    block_k: int = 1024
    num_warps: int = 4
    num_stages: int = 3


# (N, K) -> a launch measured best on this machine (bench/gemv_fp8_gpu.py records its sweep here)
_TUNED: dict[tuple[int, int], GemvFp8Tuning] = {}


def set_tuning_fp8(n: int, k: int, tuning: GemvFp8Tuning | None) -> None:
    """Use ``tuning`` for every later launch on an [N, K] fp8 weight (None: back to the default)."""
    if tuning is None:
        _TUNED.pop((n, k), None)
    else:
        _TUNED[(n, k)] = tuning


def tuning_fp8(n: int, k: int) -> GemvFp8Tuning:
    """The launch for an [N, K] weight: a recorded one (:func:`set_tuning_fp8`), else the default."""
    return _TUNED.get((n, k), GemvFp8Tuning())


def dequantize_fp8_rows(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The fp32 weight [N, K] (exactly ``scale[n] * weight[n, k]``: e4m3 times an fp32 is exact in fp32)."""
    return weight.float() * scale.float()[:, None]


def gemv_fp8_reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """Torch reference of :func:`gemv_fp8`: fp32 product over the e4m3 values, row scale after, one rounding."""
    y = F.linear(x.float(), weight.float()) * scale.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


if HAS_TRITON:

    @triton.jit
    def _gemv_fp8_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, N, K, s_xm, s_wn, s_ym,
                         HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         EVEN: tl.constexpr):
        m = tl.program_id(1).to(tl.int64)
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        w_rows = w_ptr + rows.to(tl.int64)[:, None] * s_wn
        x_row = x_ptr + m * s_xm
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            if EVEN:  # no mask: keeps the 16-byte vector loads
                x = tl.load(x_row + cols).to(tl.float32)
                w = tl.load(w_rows + cols[None, :], eviction_policy="evict_first")  # each byte read once
            else:
                col_ok = cols < K
                x = tl.load(x_row + cols, mask=col_ok, other=0.0).to(tl.float32)
                w = tl.load(w_rows + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0,
                            eviction_policy="evict_first")
            acc += w.to(tl.float32) * x[None, :]
        y = tl.sum(acc, axis=1) * tl.load(s_ptr + rows, mask=row_ok, other=0.0)
        if HAS_BIAS:
            y += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + m * s_ym + rows, y.to(y_ptr.dtype.element_ty), mask=row_ok)


def check_fp8_weight(weight: torch.Tensor, scale: torch.Tensor) -> tuple[int, int]:
    """An e4m3 weight [N, K] and its fp32 row scales [N] on one device; return N, K."""
    check_tensor("weight", weight, 2, (FP8_DTYPE,))
    check_tensor("scale", scale, 1, (torch.float32,))
    n, k = weight.shape
    check_shape("scale", scale, (n,))
    check_same_device(weight=weight, scale=scale)
    return n, k


def _check(x, weight, scale, bias) -> tuple[int, int]:
    check_tensor("x", x, 2, FLOAT_DTYPES)
    n, k = check_fp8_weight(weight, scale)
    if x.shape[1] != k:
        raise KernelInputError(f"x must have K={k} columns (the weight's), got shape {tuple(x.shape)}")
    check_same_device(x=x, weight=weight, **check_bias(bias, n, (x.dtype,)))
    return x.shape[0], n


def gemv_fp8(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    tuning: GemvFp8Tuning | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """(x @ weight^T) * scale + bias for a few rows of x, the weight in e4m3.

    Args:
        x: [M, K] activations (fp16, bf16 or fp32), unit stride in K.
        weight: [N, K] float8_e4m3fn, unit stride in K.
        scale: [N] fp32 per-output-row scales.
        bias: optional [N] of x's dtype.
        out: optional [M, N] result buffer of x's dtype.
        tuning: launch parameters (Triton only); None: :func:`tuning_fp8`'s.
        backend: "auto" (Triton on CUDA tensors when it imports), "triton" or "torch".

    Returns:
        [M, N] in x's dtype.
    """
    m, n = _check(x, weight, scale, bias)
    if out is None:
        out = x.new_empty((m, n))
    else:
        check_tensor("out", out, 2, (x.dtype,))
        check_shape("out", out, (m, n))
    tensors = [x, weight, scale] + ([bias] if bias is not None else [])
    if not (m and use_triton(backend, *tensors)):
        return out.copy_(gemv_fp8_reference(x, weight, scale, bias))
    k = x.shape[1]
    tune = tuning or tuning_fp8(n, k)
    _gemv_fp8_kernel[(cdiv(n, tune.block_n), m)](
        x, weight, scale, bias if bias is not None else scale, out, n, k, x.stride(0), weight.stride(0),
        out.stride(0), HAS_BIAS=bias is not None, BLOCK_N=tune.block_n, BLOCK_K=tune.block_k,
        EVEN=n % tune.block_n == 0 and k % tune.block_k == 0, num_warps=tune.num_warps,
        num_stages=tune.num_stages,
    )
    return out
