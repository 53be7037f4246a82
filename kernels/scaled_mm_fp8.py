"""FP8 GEMM with dynamic per-token activation scales: y = (q_x @ W^T) * s_x * s_w (+ bias).

The many-row path (prefill chunks, batched decode) of ``cuda_weight_format = "fp8"`` (``engine.fp8``), as
vLLM's dynamic-fp8 linears run it: each row of x is quantized to e4m3 with its own fp32 scale
(``s_x[m] = amax_k |x[m, k]| / 448``), then ``torch._scaled_mm`` multiplies the e4m3 operands on the tensor
cores (Hopper's fp8 wgmma) with the row scales of x and the output-channel scales of W applied to the
fp32 accumulator, and writes bf16 (the only output dtype of its row-wise mode).

* :func:`quantize_fp8_rows` — one Triton launch per call, one program per row (the row is read once, in
  fp32): amax, ``scale = amax / 448`` and ``inv = 1 / scale`` rounded as IEEE division, ``x * inv``
  clamped to +-448 and rounded to the nearest e4m3 value (ties to even) **in fp32** before the
  conversion, so the stored byte is the one torch's ``.to(float8_e4m3fn)`` gives on any backend (the
  conversion of an exact value cannot round; Triton's CPU interpreter rounds inexact ones wrongly).
* :func:`scaled_mm_fp8` — ``torch._scaled_mm(q_x [M, K], W^T [K, N] (column-major: the [N, K] weight
  transposed), scale_a = s_x [M, 1], scale_b = s_w [1, N], out_dtype = bf16)``; torch's rules for the
  row-wise mode: fp32 scales of exactly those shapes, contiguous; K and N multiples of 16. The bias is added
  after, in x's dtype. On CPU (or ``backend="torch"``) the reference: the same quantized operands,
  an fp32 product, the same scales.
"""

from __future__ import annotations

import torch

from ._common import (
    FLOAT_DTYPES,
    HAS_TRITON,
    Backend,
    check_bias,
    check_same_device,
    check_tensor,
    next_pow2,
    tl,
    triton,
    use_triton,
)
from .errors import KernelInputError
from .gemv_fp8 import FP8_DTYPE, check_fp8_weight

__all__ = ["FP8_MAX", "quantize_fp8_rows", "quantize_fp8_rows_reference", "scaled_mm_fp8",
           "scaled_mm_fp8_reference"]

FP8_MAX = 448.0       # the largest finite e4m3fn value
MIN_AMAX = 1e-12      # an all-zero row gets this amax (zeros quantize to zeros, the scale stays finite)
MAX_K = 1 << 15       # one program holds its whole row
MM_ALIGN = 16         # torch._scaled_mm: K and N multiples of 16


def quantize_fp8_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of :func:`quantize_fp8_rows`: (q [M, K] e4m3, scale [M, 1] fp32), x ~ q * scale."""
    xf = x.float()
    amax = xf.abs().amax(-1, keepdim=True).clamp(min=MIN_AMAX)
    # a tensor divisor: torch on CUDA divides by a Python scalar as a multiply by its reciprocal (not IEEE)
    scale = amax / torch.full_like(amax, FP8_MAX)
    q = (xf * torch.reciprocal(scale)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


if HAS_TRITON:

    @triton.jit
    def _round_e4m3(v):
        """fp32 v (|v| <= 448) rounded to the nearest e4m3 value, ties to even, still fp32: adding
        1.5 * 2^23 * step leaves a sum whose fp32 ulp is the e4m3 step of v's binade (2^(E - 3); 2^-9 below
        2^-6, the subnormals), so the add rounds |v| to a multiple of the step and the subtraction is exact;
        the sign is put back after, so a small negative v rounds to -0 as torch's conversion does."""
        a = tl.abs(v)
        e = tl.maximum((a.to(tl.int32, bitcast=True) >> 23) & 0xFF, 127 - 6)  # biased fp32 exponent of |v|
        big = ((e + 20) << 23).to(tl.float32, bitcast=True) * 1.5            # 1.5 * 2^(E - 3 + 23)
        r = (a + big) - big
        return tl.where(v < 0, -r, r)

    @triton.jit
    def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, s_xm, s_qm, min_amax, BLOCK_K: tl.constexpr):
        m = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_K)
        ok = cols < K
        x = tl.load(x_ptr + m * s_xm + cols, mask=ok, other=0.0).to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(x), axis=0), min_amax)
        scale = tl.math.div_rn(amax, 448.0)
        inv = tl.math.div_rn(1.0, scale)
        v = tl.minimum(tl.maximum(x * inv, -448.0), 448.0)
        tl.store(q_ptr + m * s_qm + cols, _round_e4m3(v).to(q_ptr.dtype.element_ty), mask=ok)
        tl.store(s_ptr + m, scale)


def quantize_fp8_rows(x: torch.Tensor, *, backend: Backend = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token (per-row) e4m3 quantization of activations.

    Args:
        x: [M, K] fp16, bf16 or fp32, unit stride in K, K <= 32768.
        backend: "auto" (Triton on CUDA tensors when it imports), "triton" or "torch".

    Returns:
        (q [M, K] float8_e4m3fn, scale [M, 1] fp32) with ``x[m] ~ q[m] * scale[m]``.
    """
    check_tensor("x", x, 2, FLOAT_DTYPES)
    m, k = x.shape
    if k > MAX_K:
        raise KernelInputError(f"x may have at most {MAX_K} columns, got {k}")
    if not (m and use_triton(backend, x)):
        return quantize_fp8_rows_reference(x)
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    block = next_pow2(k)
    _quantize_rows_kernel[(m,)](x, q, scale, k, x.stride(0), q.stride(0), MIN_AMAX, BLOCK_K=block,
                                num_warps=8 if block >= 4096 else 4)
    return q, scale


def scaled_mm_fp8_reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                            bias: torch.Tensor | None = None) -> torch.Tensor:
    """Torch reference of :func:`scaled_mm_fp8`: x quantized per row, fp32 product, both scales, bias."""
    return _product_reference(*quantize_fp8_rows_reference(x), weight, scale, bias, x.dtype)


def _product_reference(q, sx, weight, scale, bias, dtype: torch.dtype) -> torch.Tensor:
    """(q @ weight^T) * sx * scale + bias in fp32 over the e4m3 operands, rounded once to dtype."""
    y = (q.float() @ weight.float().t()) * sx * scale.float()[None, :]
    if bias is not None:
        y = y + bias.float()
    return y.to(dtype)


def _check(x, weight, scale, bias) -> tuple[int, int, int]:
    check_tensor("x", x, 2, FLOAT_DTYPES)
    n, k = check_fp8_weight(weight, scale)
    if x.shape[1] != k:
        raise KernelInputError(f"x must have K={k} columns (the weight's), got shape {tuple(x.shape)}")
    if k % MM_ALIGN or n % MM_ALIGN:
        raise KernelInputError(f"the fp8 GEMM needs K and N multiples of {MM_ALIGN}, got K={k}, N={n}")
    check_same_device(x=x, weight=weight, **check_bias(bias, n, (x.dtype,)))
    return x.shape[0], n, k


def scaled_mm_fp8(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    backend: Backend = "auto",
) -> torch.Tensor:
    """x @ (scale * weight)^T + bias with x quantized to e4m3 per row (W8A8, fp32 accumulation).

    Args:
        x: [M, K] activations (fp16, bf16 or fp32).
        weight: [N, K] float8_e4m3fn; scale: [N] fp32 per-output-channel scales; K, N multiples of 16.
        bias: optional [N] of x's dtype.
        backend: "auto" (the Triton row quantizer and ``torch._scaled_mm`` on CUDA tensors), "triton"
            (Triton's quantizer; on CPU tensors under the interpreter, the product then in torch) or "torch".

    Returns:
        [M, N] in x's dtype (on CUDA through bf16, the row-wise GEMM's output dtype).
    """
    m, n, _ = _check(x, weight, scale, bias)
    if m == 0:
        return x.new_empty((0, n))
    q, sx = quantize_fp8_rows(x, backend=backend)
    if x.is_cuda and backend != "torch":
        y = torch._scaled_mm(q, weight.t(), scale_a=sx, scale_b=scale.view(1, n), out_dtype=torch.bfloat16)
        y = y.to(x.dtype)
        return y if bias is None else y.add_(bias)
    return _product_reference(q, sx, weight, scale, bias, x.dtype)
