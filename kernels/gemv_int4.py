"""Weight-only int4 skinny GEMM for decode: y = x @ W^T (+ bias), W group-wise 4-bit, bandwidth bound.

W is stored as GGUF Q4_1 / the CPU path's ``int4`` arithmetic (``engine/quant.py``): per group of
``group_size`` input columns one (scale, offset), ``w[n, k] = scale[n, g] * u[n, k] + offset[n, g]``,
``u`` in 0..15, ``g = k // group_size``. A batch-1 decode step reads every weight byte once, so 4-bit
weights with fp16 group scales (0.5 + 4/group bytes per weight: 0.625 at group 32) move 3.2x fewer bytes
than bf16.

GPU layout (:func:`pack_int4_rows`): ``qweight [N, K/2]`` uint8, byte ``j`` of row ``n`` holds column
``2j`` in its low nibble and ``2j + 1`` in its high nibble (rows contiguous: one program streams its rows
with unit stride); ``scale``/``offset`` ``[N, K/group]`` fp16 or bf16. Grid ``(cdiv(N, BLOCK_N), M)``; a
program sums ``u_lo x_even + u_hi x_odd`` within each group of a K step, then applies the group's scale
and offset once: ``acc[n, g] += scale * sum(u x) + offset * sum(x)`` (one scale load per group, not per
weight), and reduces ``acc`` once at the end. The Triton path needs a power-of-two group size.
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

__all__ = ["GemvInt4Tuning", "dequantize_int4_rows", "gemv_int4", "gemv_int4_reference", "pack_int4_rows"]

SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclasses.dataclass(frozen=True)
class GemvInt4Tuning:
    """Launch parameters: output rows per program, input columns per loop step, warps, stages."""

    block_n: int = 4
    block_k: int = 512
    num_warps: int = 4
    num_stages: int = 3


def pack_int4_rows(u: torch.Tensor) -> torch.Tensor:
    """u [N, K] integers in 0..15 -> qweight [N, K/2] uint8 (column 2j low nibble, 2j + 1 high)."""
    if u.dim() != 2 or u.shape[1] % 2:
        raise KernelInputError(f"u must be [N, K] with K even, got {tuple(u.shape)}")
    u8 = u.to(torch.uint8)
    return (u8[:, 0::2] | (u8[:, 1::2] << 4)).contiguous()


def dequantize_int4_rows(qweight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """The fp32 weight [N, K] of the GPU layout (exactly ``scale * u + offset``)."""
    n, half = qweight.shape
    u = torch.stack([qweight & 15, qweight >> 4], dim=-1).reshape(n, 2 * half).float()
    group = 2 * half // scale.shape[1]
    u = u.view(n, scale.shape[1], group)
    return torch.addcmul(offset.float()[..., None], scale.float()[..., None], u).view(n, 2 * half)


def gemv_int4_reference(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
    """Torch reference of :func:`gemv_int4` (dequantize to fp32, fp32 product, one rounding)."""
    b = None if bias is None else bias.float()
    return F.linear(x.float(), dequantize_int4_rows(qweight, scale, offset), b).to(x.dtype)


if HAS_TRITON:

    @triton.jit
    def _gemv_int4_kernel(
        x_ptr, q_ptr, s_ptr, o_ptr, b_ptr, y_ptr, N, K, s_xm, s_qn, s_sn, s_ym,
        GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        NG: tl.constexpr = BLOCK_K // GROUP      # groups per K step
        HALF: tl.constexpr = GROUP // 2          # bytes per group
        m = tl.program_id(1).to(tl.int64)
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        rows64 = rows.to(tl.int64)
        q_rows = q_ptr + rows64[:, None] * s_qn
        s_rows = s_ptr + rows64[:, None] * s_sn
        o_rows = o_ptr + rows64[:, None] * s_sn
        acc = tl.zeros([BLOCK_N, NG], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            j = k0 // 2 + tl.arange(0, BLOCK_K // 2)       # byte index: columns 2j, 2j + 1
            col_ok = 2 * j < K
            byte = tl.load(q_rows + j[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0,
                           eviction_policy="evict_first")  # each weight byte is read once
            xe = tl.load(x_ptr + m * s_xm + 2 * j, mask=col_ok, other=0.0).to(tl.float32)
            xo = tl.load(x_ptr + m * s_xm + 2 * j + 1, mask=col_ok, other=0.0).to(tl.float32)
            prod = (byte & 15).to(tl.float32) * xe[None, :] + (byte >> 4).to(tl.float32) * xo[None, :]
            # one scale and offset per group, not per weight: sum u*x and x within each group first
            dot = tl.sum(tl.reshape(prod, [BLOCK_N, NG, HALF]), axis=2)          # [BLOCK_N, NG]
            xsum = tl.sum(tl.reshape(xe + xo, [NG, HALF]), axis=1)               # [NG]
            gi = k0 // GROUP + tl.arange(0, NG)
            g_mask = row_ok[:, None] & (gi < K // GROUP)[None, :]
            sc = tl.load(s_rows + gi[None, :], mask=g_mask, other=0.0).to(tl.float32)
            of = tl.load(o_rows + gi[None, :], mask=g_mask, other=0.0).to(tl.float32)
            acc += sc * dot + of * xsum[None, :]
        y = tl.sum(acc, axis=1)
        if HAS_BIAS:
            y += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + m * s_ym + rows, y.to(y_ptr.dtype.element_ty), mask=row_ok)


def _check(x, qweight, scale, offset, bias) -> tuple[int, int, int, int]:
    check_tensor("x", x, 2, FLOAT_DTYPES)
    check_tensor("qweight", qweight, 2, (torch.uint8,))
    check_tensor("scale", scale, 2, SCALE_DTYPES)
    check_tensor("offset", offset, 2, SCALE_DTYPES)
    m, k = x.shape
    n = qweight.shape[0]
    check_shape("qweight", qweight, (n, k // 2))
    if k % 2 or scale.shape[1] == 0 or k % scale.shape[1] or (k // scale.shape[1]) % 2:
        raise KernelInputError(f"K={k} must be even and a multiple of an even group size "
                               f"(scale has {scale.shape[1]} groups)")
    check_shape("scale", scale, (n, scale.shape[1]))
    check_shape("offset", offset, tuple(scale.shape))
    if offset.stride() != scale.stride():
        raise KernelInputError(f"offset strides {offset.stride()} differ from scale strides {scale.stride()}")
    check_same_device(x=x, qweight=qweight, scale=scale, offset=offset, **check_bias(bias, n, FLOAT_DTYPES))
    return m, n, k, k // scale.shape[1]


def gemv_int4(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    tuning: GemvInt4Tuning | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """x @ W^T + bias for a few rows of x, W in the group-wise int4 GPU layout.

    Args:
        x: [M, K] activations (fp16, bf16 or fp32), unit stride in K.
        qweight: [N, K/2] uint8 (:func:`pack_int4_rows`).
        scale, offset: [N, K/group] (fp16, bf16 or fp32): ``w = scale * u + offset`` per group.
        bias: optional [N].
        out: optional [M, N] result buffer in x's dtype.
        tuning: launch parameters (Triton only).
        backend: "auto" (Triton on CUDA tensors when it imports), "triton" or "torch".

    Returns:
        [M, N] in x's dtype.
    """
    m, n, k, group = _check(x, qweight, scale, offset, bias)
    if out is None:
        out = x.new_empty((m, n))
    else:
        check_tensor("out", out, 2, (x.dtype,))
        check_shape("out", out, (m, n))
    tensors = [x, qweight, scale, offset] + ([bias] if bias is not None else [])
    pow2 = group & (group - 1) == 0  # the kernel reshapes K steps into [groups, group]
    if not (m and use_triton(backend, *tensors)) or (not pow2 and backend != "triton"):
        return out.copy_(gemv_int4_reference(x, qweight, scale, offset, bias))
    if not pow2:
        raise KernelInputError(f"the Triton kernel needs a power-of-two group size, got {group}")
    tune = tuning or GemvInt4Tuning()
    block_k = max(tune.block_k, group)  # whole groups per K step
    _gemv_int4_kernel[(cdiv(n, tune.block_n), m)](
        x, qweight, scale, offset, bias if bias is not None else scale, out, n, k,
        x.stride(0), qweight.stride(0), scale.stride(0), out.stride(0),
        GROUP=group, HAS_BIAS=bias is not None, BLOCK_N=tune.block_n, BLOCK_K=block_k,
        num_warps=tune.num_warps, num_stages=tune.num_stages,
    )
    return out
