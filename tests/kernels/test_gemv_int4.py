"""gemv_int4: the GPU layout round-trips the CPU path's int4 weights exactly, the torch reference is the
dequantized product, bad arguments are typed errors, and the Triton kernel (CUDA, or Triton's
interpreter) matches the reference."""

from __future__ import annotations

import os

import pytest
import torch

from engine.quant import quantize_int4, unpack_int4
from kernels import KernelInputError
from kernels._common import HAS_TRITON
from kernels.gemv_int4 import (
    GemvInt4Tuning,
    dequantize_int4_rows,
    gemv_int4,
    gemv_int4_reference,
    pack_int4_rows,
)

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
CAN_TRITON = HAS_TRITON and (torch.cuda.is_available() or INTERPRET)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def quantized(n: int, k: int, group: int = 32, seed: int = 0, dtype=torch.float16):
    """(qweight, scale, offset) of a random [n, k] weight, through the CPU path's RTN quantizer."""
    g = torch.Generator().manual_seed(seed)
    rows = -(-n // 64) * 64  # the CPU packing takes rows in blocks of 64: quantize more, keep n
    plane = quantize_int4(torch.randn(rows, k, generator=g) * 0.05, group).planes[0]
    return (pack_int4_rows(unpack_int4(plane.packed)[:n]), plane.scale[:n].to(dtype).contiguous(),
            plane.offset[:n].to(dtype).contiguous())


def test_gpu_layout_dequantizes_exactly_as_the_cpu_layout():
    w = torch.randn(128, 256, generator=torch.Generator().manual_seed(1))
    layer = quantize_int4(w, 32)
    plane = layer.planes[0]
    q = pack_int4_rows(unpack_int4(plane.packed))
    assert q.shape == (128, 128) and q.dtype == torch.uint8
    assert torch.equal(dequantize_int4_rows(q, plane.scale, plane.offset), layer.dequantize())


def test_reference_is_the_dequantized_product():
    q, s, o = quantized(64, 128)
    x = torch.randn(3, 128)
    bias = torch.randn(64)
    w = dequantize_int4_rows(q, s, o)
    torch.testing.assert_close(gemv_int4(x, q, s, o, bias, backend="torch"), x @ w.T + bias)
    torch.testing.assert_close(gemv_int4_reference(x, q, s, o), x @ w.T)


def test_bad_arguments_are_typed_errors():
    q, s, o = quantized(64, 128)
    x = torch.randn(1, 128)
    with pytest.raises(KernelInputError, match="qweight"):
        gemv_int4(x, q.to(torch.int32), s, o)
    with pytest.raises(KernelInputError, match="shape"):
        gemv_int4(torch.randn(1, 64), q, s, o)
    with pytest.raises(KernelInputError, match="offset"):
        gemv_int4(x, q, s, o[:, :2])
    with pytest.raises(KernelInputError, match="group"):
        gemv_int4(x, q, s[:, :3].contiguous(), o[:, :3].contiguous())


@pytest.mark.skipif(not CAN_TRITON, reason="needs CUDA (or TRITON_INTERPRET=1)")
@pytest.mark.gpu
@pytest.mark.parametrize(("n", "k", "group"), [(64, 128, 32), (200, 576, 32), (96, 2048, 64)])
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_matches_reference(n, k, group, m, dtype):
    q, s, o = (t.to(DEVICE) for t in quantized(n, k, group, seed=n + k))
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    bias = torch.randn(n, device=DEVICE).to(dtype)
    ref = gemv_int4_reference(x, q, s, o, bias).float()
    for tune in (None, GemvInt4Tuning(block_n=8, block_k=256, num_warps=4)):
        got = gemv_int4(x, q, s, o, bias, tuning=tune, backend="triton").float()
        assert ((got - ref).norm() / ref.norm()).item() < 1e-2
