"""gemv_fp8: the torch reference is the product with the dequantized weight, bad arguments are typed
errors, and the Triton kernel (CUDA, or Triton's interpreter) matches the reference on fresh random inputs
with every output written."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from kernels import KernelInputError
from kernels._common import HAS_TRITON
from kernels.gemv_fp8 import (
    FP8_DTYPE,
    GemvFp8Tuning,
    dequantize_fp8_rows,
    gemv_fp8,
    gemv_fp8_reference,
    set_tuning_fp8,
    tuning_fp8,
)

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
CAN_TRITON = HAS_TRITON and (torch.cuda.is_available() or INTERPRET)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def fp8_weight(n: int, k: int, seed: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Random e4m3 weights over their whole range (subnormals to 448) and positive row scales."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.logspace(-3, 2, k)[torch.randperm(k, generator=g)]
    scale = torch.rand(n, generator=g) * 0.01 + 1e-3
    return w.clamp(-448, 448).to(FP8_DTYPE).to(device), scale.to(device)


def test_reference_is_the_dequantized_product():
    w, s = fp8_weight(48, 96, seed=1)
    x, bias = torch.randn(3, 96), torch.randn(48)
    deq = dequantize_fp8_rows(w, s)
    assert torch.equal(deq, w.float() * s[:, None])
    torch.testing.assert_close(gemv_fp8(x, w, s, bias, backend="torch"), F.linear(x, deq, bias))
    torch.testing.assert_close(gemv_fp8_reference(x, w, s), x @ deq.T)


def test_bad_arguments_are_typed_errors():
    w, s = fp8_weight(64, 128, seed=2)
    x = torch.randn(1, 128)
    with pytest.raises(KernelInputError, match="weight"):
        gemv_fp8(x, w.float(), s)                                  # not e4m3
    with pytest.raises(KernelInputError, match="scale"):
        gemv_fp8(x, w, s[:32])
    with pytest.raises(KernelInputError, match="scale"):
        gemv_fp8(x, w, s.double())
    with pytest.raises(KernelInputError, match="K=128"):
        gemv_fp8(torch.randn(1, 64), w, s)
    with pytest.raises(KernelInputError, match="bias"):
        gemv_fp8(x, w, s, torch.randn(64).half())                  # bias of another dtype than x
    with pytest.raises(KernelInputError, match="stride"):
        gemv_fp8(x, w.t().contiguous().t(), s)
    with pytest.raises(KernelInputError, match="backend"):
        gemv_fp8(x, w, s, backend="cuda")


def test_recorded_tuning_wins_over_the_default():
    mine = GemvFp8Tuning(8, 512, 8, 2)
    set_tuning_fp8(64, 576, mine)
    try:
        assert tuning_fp8(64, 576) == mine and tuning_fp8(64, 512) == GemvFp8Tuning()
    finally:
        set_tuning_fp8(64, 576, None)
    assert tuning_fp8(64, 576) == GemvFp8Tuning()


@pytest.mark.skipif(not CAN_TRITON, reason="needs CUDA (or TRITON_INTERPRET=1)")
@pytest.mark.parametrize(("n", "k"), [(64, 128), (200, 576), (40, 1000)])
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_matches_reference(n, k, m, dtype):
    """Masked (N or K off the tile) and unmasked shapes, each tuning; fp32: to summation order."""
    w, s = fp8_weight(n, k, seed=n + k + m, device=DEVICE)
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    bias = torch.randn(n, device=DEVICE).to(dtype)
    ref = F.linear(x.double(), dequantize_fp8_rows(w, s).double(), bias.double())
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for tune in (None, GemvFp8Tuning(block_n=8, block_k=128), GemvFp8Tuning(1, 64, 2, 2)):
        out = torch.full((m, n), float("nan"), device=DEVICE, dtype=dtype)   # poisoned: all must be written
        got = gemv_fp8(x, w, s, bias, out=out, tuning=tune, backend="triton").double()
        assert torch.isfinite(got).all()
        assert ((got - ref).norm() / ref.norm()).item() < tol


@pytest.mark.gpu
@pytest.mark.parametrize(("n", "k"), [(3072, 2048), (2048, 8192), (1152, 896)])  # Llama-1B qkv / down, Qwen qkv
def test_triton_matches_reference_on_model_shapes(n, k):
    w, s = fp8_weight(n, k, seed=n, device="cuda")
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    ref = gemv_fp8_reference(x.float(), w, s).double()
    out = torch.full((1, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    got = gemv_fp8(x, w, s, out=out).double()
    assert torch.isfinite(got).all()
    assert ((got - ref).norm() / ref.norm()).item() < 1e-2
