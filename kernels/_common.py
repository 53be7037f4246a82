"""Shared plumbing of the launchers: the Triton probe, backend choice and argument checks."""

from __future__ import annotations

import functools
import os
from typing import Literal

import torch

from .errors import BackendUnavailableError, KernelInputError

try:  # Triton is optional: without it every launcher runs its torch reference.
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None
    HAS_TRITON = False

Backend = Literal["auto", "triton", "torch"]
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
KV_DTYPES = (*FLOAT_DTYPES, torch.float8_e4m3fn)  # pools may hold fp8 e4m3 (kernels.kv_quant)


def _interpreting() -> bool:
    """Triton's CPU interpreter (TRITON_INTERPRET=1, read when the kernels are defined) runs CPU tensors."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def use_triton(backend: Backend, *tensors: torch.Tensor) -> bool:
    """Whether to launch the Triton kernel: "auto" picks it for CUDA tensors when Triton imports.

    ``backend="triton"`` forces it (on CUDA tensors, or on CPU tensors under Triton's interpreter).
    """
    on_cuda = all(t.is_cuda for t in tensors)
    if backend == "torch":
        return False
    if backend == "triton":
        if not (HAS_TRITON and (on_cuda or _interpreting())):
            raise BackendUnavailableError("backend='triton' needs triton installed and CUDA tensors")
        return True
    if backend != "auto":
        raise KernelInputError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    return HAS_TRITON and on_cuda


def check_tensor(name: str, t: object, ndim: int, dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    """Check that `t` is a tensor of `ndim` dims with one of `dtypes` and a unit last stride."""
    # the passing case in one expression: an eager step runs every launcher's checks once per layer
    if (isinstance(t, torch.Tensor) and t.dim() == ndim and t.dtype in dtypes
            and (t.stride(-1) == 1 or not t.numel())):
        return t
    if not isinstance(t, torch.Tensor):
        raise KernelInputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise KernelInputError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise KernelInputError(f"{name} must have dtype in ({names}), got {t.dtype}")
    if t.numel() > 0 and t.stride(-1) != 1:
        raise KernelInputError(f"{name} must have a unit stride in its last dim, got strides {t.stride()}")
    return t


def check_shape(name: str, t: torch.Tensor, expected: tuple[int, ...]) -> None:
    """Raise KernelInputError unless t.shape == expected."""
    if t.shape != tuple(expected):  # torch.Size is a tuple
        raise KernelInputError(f"{name} must have shape {tuple(expected)}, got {tuple(t.shape)}")


def check_bias(bias: torch.Tensor | None, n: int, dtypes: tuple[torch.dtype, ...]) -> dict[str, torch.Tensor]:
    """An optional bias [N] checked (KernelInputError) -> ``{"bias": bias}`` or ``{}``, for a launcher's tensors."""
    if bias is None:
        return {}
    check_tensor("bias", bias, 1, dtypes)
    check_shape("bias", bias, (n,))
    return {"bias": bias}


def check_same_device(**tensors: torch.Tensor) -> None:
    """Raise KernelInputError unless every tensor lives on one device."""
    if len({t.device for t in tensors.values()}) > 1:
        where = ", ".join(f"{n}={t.device}" for n, t in tensors.items())
        raise KernelInputError(f"all tensors must be on one device, got {where}")


def check_same_dtype(**tensors: torch.Tensor) -> None:
    """Raise KernelInputError unless every tensor has one dtype."""
    if len({t.dtype for t in tensors.values()}) > 1:
        what = ", ".join(f"{n}={t.dtype}" for n, t in tensors.items())
        raise KernelInputError(f"tensors must share one dtype, got {what}")


def check_cache_pair(k_cache: object, v_cache: object) -> tuple[int, int, int, int]:
    """Check the paged K/V pools [NB, BS, Hkv, D] (16/32-bit float or fp8 e4m3) and return (NB, BS, Hkv, D)."""
    check_tensor("k_cache", k_cache, 4, KV_DTYPES)
    check_tensor("v_cache", v_cache, 4, KV_DTYPES)
    check_shape("v_cache", v_cache, tuple(k_cache.shape))
    check_same_dtype(k_cache=k_cache, v_cache=v_cache)
    nb, bs, hkv, d = k_cache.shape
    if min(nb, bs, hkv, d) <= 0:
        raise KernelInputError(f"k_cache must have no empty dim, got shape {tuple(k_cache.shape)}")
    return nb, bs, hkv, d


def check_out(out: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """Return `out` checked to match `like` (shape, dtype, device, unit last stride), or a new empty one."""
    if out is None:
        return torch.empty_like(like)
    check_tensor("out", out, like.dim(), (like.dtype,))
    check_shape("out", out, tuple(like.shape))
    check_same_device(out=out, q=like)
    return out


def check_heads(hq: int, hkv: int) -> int:
    """Return the GQA group size Hq / Hkv, checking that it divides."""
    if hq % hkv != 0:
        raise KernelInputError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    return hq // hkv


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (and >= 1)."""
    return 1 << max(0, (int(n) - 1).bit_length())


def cdiv(a: int, b: int) -> int:
    """Ceiling division."""
    return -(-a // b)


@functools.lru_cache(maxsize=16)
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (132 on an H200; 132 assumed for CPU/interpreter)."""
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot input precision: exact fp32 products for fp32 inputs (tests), native for 16-bit ones."""
    return "ieee" if dtype == torch.float32 else "tf32"
