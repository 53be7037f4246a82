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

from . import _pdl, _prologue
from ._common import (
    FLOAT_DTYPES,
    HAS_TRITON,
    Backend,
    cdiv,
    check_bias,
    check_same_device,
    check_same_dtype,
    check_shape,
    check_tensor,
    tl,
    triton,
    use_triton,
)
from .errors import KernelInputError
from .rms_norm import rms_norm_reference
from .silu_mul import silu_mul_reference

if HAS_TRITON:
    from ._pdl import pdl_wait
    from ._prologue import prologue_load

__all__ = ["GemvTuning", "gemv", "gemv_reference", "gemv_rms_norm", "gemv_rms_norm_reference", "gemv_silu_mul",
           "gemv_silu_mul_reference"]


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


# the SiLU prologue runs one exp per input column per program: fewer, taller programs than the plain GEMV
SILU_TUNING = GemvTuning(block_n=8)


def gemv_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Torch reference of :func:`gemv` (fp32 math, one rounding)."""
    b = None if bias is None else bias.float()
    return F.linear(x.float(), weight.float(), b).to(x.dtype)


if HAS_TRITON:

    @triton.jit
    def _gemv_step(acc, ss, w, x_ptr, r_ptr, g_ptr, h_ptr, m, s_xm, s_rm, s_hm, cols, col_ok, K,
                   PROLOGUE: tl.constexpr, NORM: tl.constexpr):
        """One K step: x's columns (through the prologue) times the step's weight tile w [BLOCK_N, BLOCK_K]."""
        x, sq = prologue_load(x_ptr + m * s_xm, r_ptr + m * s_rm, g_ptr, h_ptr + m * s_hm, cols, col_ok,
                              K, tl.where(tl.program_id(0) == 0, K, 0), PROLOGUE, True)
        if NORM:
            ss += sq * sq
        acc += w.to(tl.float32) * x[None, :]
        return acc, ss

    @triton.jit
    def _gemv_kernel(
        x_ptr, w_ptr, b_ptr, y_ptr, r_ptr, g_ptr, h_ptr, N, K, s_xm, s_wn, s_ym, s_rm, s_hm, eps,
        HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PROLOGUE: tl.constexpr,
        NORM: tl.constexpr, PDL: tl.constexpr,
    ):
        # PROLOGUE (kernels._prologue): 0 none; 1/2 RMSNorm (NORM; 2: of x + residual, h written); 3 SiLU·mul
        m = tl.program_id(1).to(tl.int64)
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        w_rows = w_ptr + rows.to(tl.int64)[:, None] * s_wn
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        ss = tl.zeros([BLOCK_K], dtype=tl.float32)  # the norm's sum of squares (NORM prologues)
        k_first = 0
        if PDL:  # the first step's weights load before the wait (no kernel writes them), the rest after it
            cols = tl.arange(0, BLOCK_K)
            col_ok = cols < K
            w = tl.load(w_rows + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0,
                        eviction_policy="evict_first")
            pdl_wait(PDL)
            acc, ss = _gemv_step(acc, ss, w, x_ptr, r_ptr, g_ptr, h_ptr, m, s_xm, s_rm, s_hm, cols, col_ok, K,
                                 PROLOGUE, NORM)
            k_first = BLOCK_K
        for k0 in range(k_first, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            col_ok = cols < K
            w = tl.load(w_rows + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0,
                        eviction_policy="evict_first")  # each weight byte is read once: keep L2 for x
            acc, ss = _gemv_step(acc, ss, w, x_ptr, r_ptr, g_ptr, h_ptr, m, s_xm, s_rm, s_hm, cols, col_ok, K,
                                 PROLOGUE, NORM)
        y = tl.sum(acc, axis=1)
        if NORM:
            y *= tl.rsqrt(tl.sum(ss, 0) / K + eps)
        if HAS_BIAS:
            y += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + m * s_ym + rows, y.to(y_ptr.dtype.element_ty), mask=row_ok)


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[int, int, int]:
    """Check a GEMV's operands (x [M, K], weight [N, K], bias [N]: one dtype and device); return M, N, K."""
    check_tensor("x", x, 2, FLOAT_DTYPES)
    check_tensor("weight", weight, 2, FLOAT_DTYPES)
    m, k = x.shape
    n = weight.shape[0]
    check_shape("weight", weight, (n, k))
    tensors = dict(x=x, weight=weight, **check_bias(bias, n, FLOAT_DTYPES))
    check_same_dtype(**tensors)
    check_same_device(**tensors)
    return m, n, k


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
    m, n, _ = _check(x, weight, bias)
    if out is None:
        out = x.new_empty((m, n))
    else:
        check_tensor("out", out, 2, (x.dtype,))
        check_shape("out", out, (m, n))
    if not (m and use_triton(backend, x, weight, *([bias] if bias is not None else []))):
        return out.copy_(gemv_reference(x, weight, bias))
    _launch(x, weight, bias, out, tuning or GemvTuning())
    return out


def _launch(x, weight, bias, out, tune: GemvTuning, prologue: int = _prologue.NONE, residual=None,
            gain=None, h_out=None, eps: float = 0.0) -> None:
    """The kernel over x [M, K] (SILU: gate/up [M, 2K]) and weight [N, K] -> out [M, N]."""
    n, k = weight.shape
    pdl = _pdl.pdl_launch(x)
    r = residual if residual is not None else x
    h = h_out if h_out is not None else out
    _gemv_kernel[(cdiv(n, tune.block_n), x.shape[0])](
        x, weight, bias if bias is not None else weight, out, r, gain if gain is not None else weight, h,
        n, k, x.stride(0), weight.stride(0), out.stride(0), r.stride(0), h.stride(0), float(eps),
        HAS_BIAS=bias is not None, BLOCK_N=tune.block_n, BLOCK_K=tune.block_k, PROLOGUE=prologue,
        NORM=prologue in (_prologue.NORM, _prologue.ADD_NORM), PDL=pdl,
        num_warps=tune.num_warps, num_stages=tune.num_stages, **_pdl.launch_options(pdl),
    )


# ---- GEMVs with a fused prologue (kernels._prologue): RMSNorm before qkv / gate_up, SiLU·mul before down ----

def gemv_rms_norm_reference(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                            bias: torch.Tensor | None = None, residual: torch.Tensor | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of :func:`gemv_rms_norm`: the unfused (add_)rms_norm then the GEMV."""
    h = x if residual is None else x + residual
    return gemv_reference(rms_norm_reference(h, norm_weight, eps), weight, bias), h


def gemv_silu_mul_reference(gate_up: torch.Tensor, weight: torch.Tensor,
                            bias: torch.Tensor | None = None) -> torch.Tensor:
    """Torch reference of :func:`gemv_silu_mul`: the unfused silu_mul then the GEMV."""
    return gemv_reference(silu_mul_reference(gate_up), weight, bias)


def check_norm_args(x: torch.Tensor, norm_weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    """The prologue's own arguments: gain [K] and residual [M, K] of x's dtype and device."""
    check_tensor("norm_weight", norm_weight, 1, FLOAT_DTYPES)
    check_shape("norm_weight", norm_weight, (x.shape[1],))
    check_same_device(x=x, norm_weight=norm_weight)
    if residual is not None:
        check_tensor("residual", residual, 2, FLOAT_DTYPES)
        check_shape("residual", residual, tuple(x.shape))
        check_same_dtype(x=x, residual=residual)
        check_same_device(x=x, residual=residual)


def gemv_rms_norm(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    residual: torch.Tensor | None = None,
    tuning: GemvTuning | None = None,
    backend: Backend = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """rms_norm(h) @ weight^T + bias with h = x (+ residual), in one launch.

    Args:
        x: [M, K] activations; residual: optional [M, K] of x's dtype, added first (the residual stream).
        norm_weight: [K] RMSNorm gain; eps: added to the mean square.
        weight: [N, K] of x's dtype; bias: optional [N].
        tuning, backend: as :func:`gemv`.

    Returns:
        (y [M, N], h [M, K]): h is the new residual stream (x itself when no residual is given).
    """
    check_norm_args(x, norm_weight, residual)
    m, n, _ = _check(x, weight, bias)
    tensors = [x, weight, norm_weight] + [t for t in (bias, residual) if t is not None]
    if not (m and use_triton(backend, *tensors)):
        return gemv_rms_norm_reference(x, norm_weight, eps, weight, bias, residual)
    out = x.new_empty((m, n))
    h = torch.empty_like(x) if residual is not None else x
    kind = _prologue.ADD_NORM if residual is not None else _prologue.NORM
    tune = tuning or _prologue.tuned("gemv", kind, n, x.shape[1]) or GemvTuning()
    _launch(x, weight, bias, out, tune, kind, residual, norm_weight, h, eps)
    return out, h


def gemv_silu_mul(
    gate_up: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    tuning: GemvTuning | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """silu(gate) * up @ weight^T + bias in one launch (the down projection of a SwiGLU MLP).

    Args:
        gate_up: [M, 2I] fused gate/up rows, gate first; weight: [N, I] of its dtype; bias: optional [N].
        tuning: launch parameters (default: :data:`SILU_TUNING`); backend: as :func:`gemv`.

    Returns:
        [M, N] in gate_up's dtype.
    """
    check_tensor("gate_up", gate_up, 2, FLOAT_DTYPES)
    m, two_i = gate_up.shape
    if two_i % 2:
        raise KernelInputError(f"gate_up must have an even number of columns, got {two_i}")
    _, n, _ = _check(gate_up[:, :two_i // 2], weight, bias)  # [M, I]: the GEMV's input
    tensors = [gate_up, weight] + ([bias] if bias is not None else [])
    if not (m and use_triton(backend, *tensors)):
        return gemv_silu_mul_reference(gate_up, weight, bias)
    out = gate_up.new_empty((m, n))
    tune = tuning or _prologue.tuned("gemv", _prologue.SILU, n, two_i // 2) or SILU_TUNING
    _launch(gate_up, weight, bias, out, tune, _prologue.SILU)
    return out
