"""FP8 (e4m3) KV pools: the quantization every KV kernel shares, and its torch reference.

A quantized pool holds ``torch.float8_e4m3fn`` values ``q = clamp(x / s, -448, 448)`` rounded to nearest
even, with one fp32 scale ``s`` per KV head (per layer and for K and V apart: the caller keeps one
``[Hkv]`` tensor each). The stores divide by the scale (``div_rn``, so kernel and reference round alike)
and saturate at e4m3's largest finite value, 448, instead of producing NaN; the attention kernels read
``q * s``. Because each program of the attention kernels serves one KV head, its K scale folds into the
softmax scale and its V scale into the output, so dequantizing costs only the fp8 -> q-dtype conversion of
each tile.
"""

from __future__ import annotations

import torch

from ._common import HAS_TRITON, check_same_device, check_shape, check_tensor, tl, triton
from .errors import KernelInputError

__all__ = ["FP8_KV_DTYPE", "FP8_MAX", "check_kv_scales", "dequantize_kv", "is_quantized", "quantize_kv"]

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3fn's largest finite value (it has no infinity)


def is_quantized(cache: torch.Tensor) -> bool:
    """Whether a pool holds fp8 values (and so needs scales)."""
    return cache.dtype == FP8_KV_DTYPE


def quantize_kv(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Reference quantization: x [..., Hkv, D] with scale [Hkv] fp32 -> fp8 e4m3 (saturating)."""
    return (x.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_KV_DTYPE)


def dequantize_kv(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Reference dequantization: fp8 x [..., Hkv, D] -> fp32 ``x * scale[h]``; other dtypes -> fp32 as is."""
    if scale is None:
        return x.float()
    return x.float() * scale[:, None]


def check_kv_scales(k_cache: torch.Tensor, k_scale: object, v_scale: object) -> bool:
    """Check the scales that go with a pair of pools; return whether the pools are quantized.

    fp8 pools need fp32 ``k_scale`` and ``v_scale`` of shape [Hkv] on the pools' device; other pools take
    none (a scale passed with a bf16 pool would be silently ignored otherwise).
    """
    quantized = is_quantized(k_cache)
    if not quantized:
        if k_scale is not None or v_scale is not None:
            raise KernelInputError(f"k_scale / v_scale go with fp8 pools only, the pools are {k_cache.dtype}")
        return False
    if k_scale is None or v_scale is None:
        raise KernelInputError("fp8 (float8_e4m3fn) pools need k_scale and v_scale ([Hkv] fp32)")
    hkv = k_cache.shape[2]
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        check_tensor(name, s, 1, (torch.float32,))
        check_shape(name, s, (hkv,))
    check_same_device(k_cache=k_cache, k_scale=k_scale, v_scale=v_scale)
    return True


if HAS_TRITON:

    @triton.jit
    def quantize_fp8(x, scale, dtype: tl.constexpr):
        """x / scale rounded to nearest even and saturated at +-448, as ``dtype`` (the pool's fp8 type)."""
        xf = x.to(tl.float32)
        y = tl.math.div_rn(xf, scale + tl.zeros_like(xf))  # scale broadcast to x's shape
        return tl.minimum(tl.maximum(y, -448.0), 448.0).to(dtype, fp_downcast_rounding="rtne")
