"""gemv_int4_w32: the interleaved layout holds exactly the byte layout's weights, the torch reference is
the dequantized product, bad arguments are typed errors, and the Triton kernel (CUDA, or Triton's
interpreter) matches the reference on fresh random inputs with every output written."""

from __future__ import annotations

import os

import pytest
import torch

from kernels import KernelInputError
from kernels._common import HAS_TRITON
from kernels.gemv_int4 import dequantize_int4_rows, gemv_int4_reference, pack_int4_rows
from kernels.gemv_int4_w32 import (
    _SPLIT_BUFFERS,
    GemvInt4W32Tuning,
    dequantize_int4_w32,
    gemv_int4_w32,
    gemv_int4_w32_reference,
    gemv_int4_w32_rms_norm,
    gemv_int4_w32_silu_mul,
    repack_int4_w32,
    set_tuning_int4_w32,
    split_k_plan,
    tuning_int4_w32,
)
from kernels.silu_mul import silu_mul_reference

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
CAN_TRITON = HAS_TRITON and (torch.cuda.is_available() or INTERPRET)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def byte_layout(n: int, k: int, group: int, seed: int, dtype=torch.float16):
    """(qweight, scale, offset) in kernels.gemv_int4's byte layout, random nibbles and group scales."""
    g = torch.Generator().manual_seed(seed)
    u = torch.randint(0, 16, (n, k), generator=g)
    scale = (torch.rand(n, k // group, generator=g) * 0.01).to(dtype)
    offset = (torch.randn(n, k // group, generator=g) * 0.05).to(dtype)
    return pack_int4_rows(u), scale, offset


@pytest.mark.parametrize("group", [16, 32, 64, 128])
def test_w32_layout_holds_the_byte_layouts_weights(group):
    q, s, o = byte_layout(24, 256, group, seed=group)
    q32, so = repack_int4_w32(q, s, o)
    assert q32.shape == (24, 32) and q32.dtype == torch.int32 and so.shape == (24, 256 // group, 2)
    assert torch.equal(dequantize_int4_w32(q32, so), dequantize_int4_rows(q, s, o))


def test_nibbles_are_interleaved_within_a_group():
    """Column i * W + w of a group sits in nibble i of its word w (W = group / 8 words)."""
    u = torch.zeros(1, 32, dtype=torch.long)
    u[0, 1 * 4 + 2] = 9                     # nibble 1 of word 2
    q32, _ = repack_int4_w32(pack_int4_rows(u), torch.ones(1, 1).half(), torch.zeros(1, 1).half())
    assert q32.tolist() == [[0, 0, 9 << 4, 0]]


def test_reference_is_the_dequantized_product():
    q, s, o = byte_layout(64, 128, 32, seed=3)
    q32, so = repack_int4_w32(q, s, o)
    x, bias = torch.randn(3, 128), torch.randn(64)
    torch.testing.assert_close(gemv_int4_w32(x, q32, so, bias, backend="torch"),
                               gemv_int4_reference(x, q, s, o, bias))
    torch.testing.assert_close(gemv_int4_w32_reference(x, q32, so), x @ dequantize_int4_rows(q, s, o).T)


def test_bad_arguments_are_typed_errors():
    q32, so = repack_int4_w32(*byte_layout(64, 128, 32, seed=4))
    x = torch.randn(1, 128)
    with pytest.raises(KernelInputError, match="qweight"):
        gemv_int4_w32(x, q32.to(torch.int64), so)
    with pytest.raises(KernelInputError, match="shape"):
        gemv_int4_w32(torch.randn(1, 64), q32, so)
    with pytest.raises(KernelInputError, match="group"):
        gemv_int4_w32(x, q32, so[:, :3].contiguous())      # 128 columns in 3 groups
    with pytest.raises(KernelInputError, match="contiguous"):
        gemv_int4_w32(x, q32, so.transpose(0, 1).contiguous().transpose(0, 1))
    with pytest.raises(KernelInputError, match="group size"):
        repack_int4_w32(*byte_layout(8, 48, 24, seed=5))   # 3 words a group: not a power of two
    with pytest.raises(KernelInputError, match="powers of two"):
        gemv_int4_w32(x, q32, so, tuning=GemvInt4W32Tuning(groups=3), backend="torch")


def test_default_tuning_fills_the_chip():
    assert tuning_int4_w32(2048, 2048, 32).block_n == 4       # o of a 1B model: 512 programs
    assert tuning_int4_w32(128256, 2048, 32).block_n == 16    # the head: 4 rows per thread
    assert tuning_int4_w32(64, 576, 32).groups == 32          # 18 groups -> one masked step of 32
    mine = GemvInt4W32Tuning(2, 8, 2, 3)
    set_tuning_int4_w32(64, 576, 32, mine)                    # a measured launch wins over the default
    try:
        assert tuning_int4_w32(64, 576, 32) == mine and tuning_int4_w32(64, 576, 16) != mine
    finally:
        set_tuning_int4_w32(64, 576, 32, None)
    assert tuning_int4_w32(64, 576, 32).groups == 32


@pytest.mark.skipif(not CAN_TRITON, reason="needs CUDA (or TRITON_INTERPRET=1)")
@pytest.mark.gpu
@pytest.mark.parametrize(("n", "k", "group"), [(64, 128, 32), (200, 576, 32), (96, 2048, 64), (40, 512, 16)])
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_matches_reference(n, k, group, m, dtype):
    q, s, o = byte_layout(n, k, group, seed=n + k + m)
    q32, so = (t.to(DEVICE) for t in repack_int4_w32(q, s, o))
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    bias = torch.randn(n, device=DEVICE).to(dtype)
    ref = gemv_int4_w32_reference(x.double().to(dtype), q32, so, bias).double()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for tune in (None, GemvInt4W32Tuning(block_n=16, groups=2, num_warps=4), GemvInt4W32Tuning(1, 64, 2),
                 GemvInt4W32Tuning(8, 2, 4, x_per_row=True), GemvInt4W32Tuning(4, 64, 4, x_per_row=True),
                 GemvInt4W32Tuning(8, 2, 4, prefetch=True), GemvInt4W32Tuning(16, 4, 4, x_per_row=True, prefetch=True),
                 GemvInt4W32Tuning(4, 64, 4, prefetch=True), GemvInt4W32Tuning(8, 2, 4, split_k=4),
                 GemvInt4W32Tuning(16, 4, 4, prefetch=True, split_k=3), GemvInt4W32Tuning(4, 2, 4, split_k=64),
                 GemvInt4W32Tuning(8, 4, 4, x_per_row=True, split_k=2),
                 GemvInt4W32Tuning(8, 2, 4, mantissa_unpack=True),
                 GemvInt4W32Tuning(4, 64, 4, x_per_row=True, mantissa_unpack=True),
                 GemvInt4W32Tuning(16, 4, 4, prefetch=True, split_k=3, mantissa_unpack=True)):
        out = torch.full((m, n), float("nan"), device=DEVICE, dtype=dtype)   # poisoned: all must be written
        got = gemv_int4_w32(x, q32, so, bias, out=out, tuning=tune, backend="triton").double()
        assert torch.isfinite(got).all()
        assert ((got - ref).norm() / ref.norm()).item() < tol


def test_split_k_plan_has_whole_steps_and_no_empty_split():
    assert split_k_plan(64, GemvInt4W32Tuning(groups=16, split_k=4)) == (4, 16)   # 4 steps, one each
    assert split_k_plan(64, GemvInt4W32Tuning(groups=16, split_k=3)) == (2, 32)   # 4 steps in 2 + 2
    assert split_k_plan(64, GemvInt4W32Tuning(groups=64, split_k=8)) == (1, 64)   # one step: no split
    assert split_k_plan(18, GemvInt4W32Tuning(groups=4, split_k=8)) == (5, 4)     # 5 steps, the last masked
    with pytest.raises(KernelInputError, match="split_k"):
        gemv_int4_w32(torch.randn(1, 128), *repack_int4_w32(*byte_layout(8, 128, 32, seed=6)),
                      tuning=GemvInt4W32Tuning(split_k=0), backend="torch")


@pytest.mark.skipif(not CAN_TRITON, reason="needs CUDA (or TRITON_INTERPRET=1)")
@pytest.mark.gpu
@pytest.mark.parametrize("split", [2, 5])
def test_split_k_relaunches_and_silu_prologue_match_reference(split):
    """The counters are back at zero after each launch, so a second launch (a graph replay) is right too; the
    SiLU prologue splits like the plain kernel; the RMSNorm prologue refuses a split."""
    n, k, group = 72, 640, 32
    q32, so = (t.to(DEVICE) for t in repack_int4_w32(*byte_layout(n, k, group, seed=split)))
    tune = GemvInt4W32Tuning(8, 4, 4, split_k=split)
    for _ in range(2):
        x = torch.randn(2, k, device=DEVICE)
        got = gemv_int4_w32(x, q32, so, tuning=tune, backend="triton")
        torch.testing.assert_close(got, gemv_int4_w32_reference(x, q32, so), rtol=1e-5, atol=1e-5)
        assert all(int(cnt.abs().sum()) == 0 for _, cnt in _SPLIT_BUFFERS.values())
    gate_up = torch.randn(1, 2 * k, device=DEVICE)
    torch.testing.assert_close(gemv_int4_w32_silu_mul(gate_up, q32, so, tuning=tune, backend="triton"),
                               gemv_int4_w32_reference(silu_mul_reference(gate_up), q32, so), rtol=1e-5, atol=1e-5)
    with pytest.raises(KernelInputError, match="split_k"):
        gemv_int4_w32_rms_norm(torch.randn(1, k, device=DEVICE), torch.ones(k, device=DEVICE), 1e-6, q32, so,
                               tuning=tune, backend="triton")


@pytest.mark.skipif(not CAN_TRITON, reason="needs CUDA (or TRITON_INTERPRET=1)")
@pytest.mark.gpu
def test_mantissa_unpack_reads_every_nibble_position():
    """One weight at a time in each of a word's 8 nibbles, u = 15 (the top bit of nibble 7 is the word's sign
    bit): the in-place read must give exactly that weight's x, scaled, for every position."""
    n, k = 8, 256
    u = torch.zeros(n, k, dtype=torch.long)
    for r in range(n):  # row r: nibble r of word 1 of group 0 (column r * W + 1), W = 4 words at group 32
        u[r, r * 4 + 1] = 15
    q32, so = repack_int4_w32(pack_int4_rows(u), torch.ones(n, k // 32).half(), torch.zeros(n, k // 32).half())
    x = torch.randn(1, k, device=DEVICE)
    got = gemv_int4_w32(x, q32.to(DEVICE), so.to(DEVICE), tuning=GemvInt4W32Tuning(8, 8, 4, mantissa_unpack=True),
                        backend="triton")
    torch.testing.assert_close(got[0], 15 * x[0, torch.arange(n, device=DEVICE) * 4 + 1], rtol=1e-6, atol=1e-6)
