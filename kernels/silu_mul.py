"""SwiGLU activation of a fused gate/up projection: out = silu(gate) * up in one pass.

Layouts: gate_up [T, 2I] (gate in columns [0, I), up in [I, 2I), as a fused gate/up projection writes
them); out [T, I]. Grid: (T, cdiv(I, BLOCK)) — one program does BLOCK columns of one row, in fp32, with
one rounding to the input dtype (torch's unfused ``F.silu(g) * u`` rounds twice in bf16; the two agree to
bf16 precision).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import _pdl
from ._common import (
    FLOAT_DTYPES,
    HAS_TRITON,
    Backend,
    cdiv,
    check_same_device,
    check_shape,
    check_tensor,
    tl,
    triton,
    use_triton,
)
from .errors import KernelInputError

__all__ = ["silu_mul", "silu_mul_reference"]


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """Torch reference of :func:`silu_mul` (fp32 math, one rounding)."""
    i = gate_up.shape[1] // 2
    g, u = gate_up[:, :i].float(), gate_up[:, i:].float()
    return (F.silu(g) * u).to(gate_up.dtype)


if HAS_TRITON:
    from ._pdl import pdl_wait

    @triton.jit
    def _silu_mul_kernel(x_ptr, o_ptr, s_x, s_o, N, BLOCK: tl.constexpr, PDL: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < N
        pdl_wait(PDL)
        g = tl.load(x_ptr + row * s_x + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + row * s_x + N + cols, mask=mask, other=0.0).to(tl.float32)
        out = g / (1.0 + tl.exp(-g)) * u
        tl.store(o_ptr + row * s_o + cols, out.to(o_ptr.dtype.element_ty), mask=mask)


def silu_mul(
    gate_up: torch.Tensor, *, out: torch.Tensor | None = None, backend: Backend = "auto"
) -> torch.Tensor:
    """silu(gate) * up of a fused gate/up projection.

    Args:
        gate_up: [T, 2I] (fp16, bf16 or fp32), gate first.
        out: optional [T, I] result buffer of gate_up's dtype.
        backend: "auto" (Triton on CUDA tensors when it imports), "triton" or "torch".

    Returns:
        [T, I] in gate_up's dtype.
    """
    check_tensor("gate_up", gate_up, 2, FLOAT_DTYPES)
    t, two_i = gate_up.shape
    if two_i % 2:
        raise KernelInputError(f"gate_up must have an even number of columns, got {two_i}")
    i = two_i // 2
    if out is None:
        out = gate_up.new_empty((t, i))
    else:
        check_tensor("out", out, 2, (gate_up.dtype,))
        check_shape("out", out, (t, i))
        check_same_device(out=out, gate_up=gate_up)
    if t and use_triton(backend, gate_up, out):
        block, pdl = 1024, _pdl.pdl_launch(gate_up)
        _silu_mul_kernel[(t, cdiv(i, block))](gate_up, out, gate_up.stride(0), out.stride(0), i,
                                             BLOCK=block, PDL=pdl, num_warps=4, **_pdl.launch_options(pdl))
        return out
    return out.copy_(silu_mul_reference(gate_up))
