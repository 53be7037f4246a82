"""Skinny GEMM for decode: y = x @ W^T (+ bias) with a handful of rows x, weight-bandwidth bound.

At batch 1 cuBLAS picks tile GEMMs (and split-K with a separate reduce kernel) that move a 2-17 MB weight
at 0.5-2.5 TB/s on an H200; this kernel streams W once, in row blocks.

Layouts: x [M, K] (M small: each row is its own program column, so W is re-read from L2 per row); weight
[N, K] (nn.Linear layout, unit stride in K); bias [N] or None; out [M, N]. Grid: (cdiv(N, BLOCK_N), M).
A program keeps a [BLOCK_N, BLOCK_K] fp32 partial-product tile over its K loop and reduces it once at the
end (fp32 accumulation, one rounding to x's dtype, as cuBLAS).
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
    check_same_device,
    check_same_dtype,
    check_shape,
    check_tensor,
    tl,
    triton,
    use_triton,
)

__all__ = ["GemvTuning", "gemv", "gemv_reference"]


@dataclasses.dataclass(frozen=True)
class GemvTuning:
    """Launch parameters: output rows per program, K per loop step, warps, pipeline stages.

    The defaults were best or within 0.6 µs of the best of 68 variants on every layer GEMM of the
    Qwen2.5-0.5B and Llama-3.2-1B shapes on an H200 (``bench/gpu_kernels.py --gemv``, docs/kernels.md).
    """

    block_n: int = 2
    block_k: int = 1024
    num_warps: int = 4
    num_stages: int = 3


def gemv_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Torch reference of :func:`gemv` (fp32 math, one rounding)."""
    b = None if bias is None else bias.float()
    return F.linear(x.float(), weight.float(), b).to(x.dtype)


if HAS_TRITON:

    @triton.jit
    def _gemv_kernel(
        x_ptr, w_ptr, b_ptr, y_ptr, N, K, s_xm, s_wn, s_ym,
        HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        m = tl.program_id(1).to(tl.int64)
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        w_rows = w_ptr + rows.to(tl.int64)[:, None] * s_wn
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            col_ok = cols < K
            x = tl.load(x_ptr + m * s_xm + cols, mask=col_ok, other=0.0).to(tl.float32)
            w = tl.load(w_rows + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0,
                        eviction_policy="evict_first")  # each weight byte is read once: keep L2 for x
            acc += w.to(tl.float32) * x[None, :]
        y = tl.sum(acc, axis=1)
        if HAS_BIAS:
            y += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + m * s_ym + rows, y.to(y_ptr.dtype.element_ty), mask=row_ok)


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    tuning: GemvTuning | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """x @ weight^T + bias for a few rows of x.

    Args:
        x: [M, K] activations (fp16, bf16 or fp32), unit stride in K.
        weight: [N, K], same dtype, unit stride in K.
        bias: optional [N], same dtype.
        out: optional [M, N] result buffer.
        tuning: launch parameters (Triton only); None: the defaults of :class:`GemvTuning`.
        backend: "auto" (Triton on CUDA tensors when it imports), "triton" or "torch".

    Returns:
        [M, N] in x's dtype.
    """
    check_tensor("x", x, 2, FLOAT_DTYPES)
    check_tensor("weight", weight, 2, FLOAT_DTYPES)
    m, k = x.shape
    n = weight.shape[0]
    check_shape("weight", weight, (n, k))
    tensors = dict(x=x, weight=weight)
    if bias is not None:
        check_tensor("bias", bias, 1, FLOAT_DTYPES)
        check_shape("bias", bias, (n,))
        tensors["bias"] = bias
    check_same_dtype(**tensors)
    check_same_device(**tensors)
    if out is None:
        out = x.new_empty((m, n))
    else:
        check_tensor("out", out, 2, (x.dtype,))
        check_shape("out", out, (m, n))
    if not (m and use_triton(backend, *tensors.values())):
        return out.copy_(gemv_reference(x, weight, bias))
    tune = tuning or GemvTuning()
    _gemv_kernel[(cdiv(n, tune.block_n), m)](
        x, weight, bias if bias is not None else weight, out, n, k, x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_N=tune.block_n, BLOCK_K=tune.block_k,
        num_warps=tune.num_warps, num_stages=tune.num_stages,
    )
    return out
