"""kernels.cpu: the native Q4_1 / Q8_0 (and fp32) few-row products equal their torch references (dequantized weight
times the kernels' int8-per-block activations) to float rounding, the layouts round-trip, bad arguments
are errors (not crashes), and the engine's quantized layers use the kernels from GGUF blocks (numbers
tracking the fp32 product) and fall back to torch's kernel where they are not available."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

import kernels.cpu as native
from engine import quant as Q
from kernels.errors import KernelInputError

needs_native = pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.unavailable_reason()}")


def q4_1_weight(n: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    u = torch.randint(0, 16, (n, k), generator=g)
    d = (torch.rand(n, k // 32, generator=g) * 0.01).half()
    m = (-torch.rand(n, k // 32, generator=g) * 0.05).half()
    return u, native.q4_1_from_u(u), d, m


def test_q4_1_layout_round_trips_and_matches_gguf_byte_order():
    u, qs, _, _ = q4_1_weight(5, 96)
    assert torch.equal(native.q4_1_to_u(qs), u.to(torch.uint8))
    assert qs[0, 0].item() == u[0, 0].item() | (u[0, 16].item() << 4)   # byte j: weights j and j + 16


@needs_native
@pytest.mark.parametrize("n,k,m", [(1, 32, 1), (7, 96, 1), (64, 288, 3), (33, 1536, 16)])
def test_q4_1_equals_its_reference(n, k, m):
    _, qs, d, mn = q4_1_weight(n, k, seed=n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k))
    x[0, :32] = 0                                                       # an all-zero activation block
    out, ref = native.q4_1_mm(x, qs, d, mn), native.q4_1_mm_ref(x, qs, d, mn)
    assert out.shape == (m, n)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@needs_native
@pytest.mark.parametrize("n,k,m", [(1, 32, 1), (9, 160, 2), (50, 576, 16)])
def test_q8_0_equals_its_reference(n, k, m):
    g = torch.Generator().manual_seed(n)
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)   # -128 is never stored by Q8_0
    d = (torch.rand(n, k // 32, generator=g) * 0.01).half()
    x = torch.randn(m, k, generator=g)
    out, ref = native.q8_0_mm(x, q, d), native.q8_0_mm_ref(x, q, d)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@needs_native
@pytest.mark.parametrize("n,k,m", [(1, 8, 1), (5, 37, 1), (48, 576, 1), (17, 1536, 3)])
def test_f32_equals_torch_to_float_rounding(n, k, m):
    """fp32 few-row product over [N, K] as stored: K not a multiple of 32 (or 8) takes the scalar tail."""
    g = torch.Generator().manual_seed(n * k)
    w, x = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g)
    out, ref = native.f32_mm(x, w), (x.double() @ w.double().T).float()
    assert out.shape == (m, n)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * k ** 0.5)
    if n > 1:                                                    # each output row reads its own weight row
        torch.testing.assert_close(native.f32_mm(x, w.roll(1, 0)), out.roll(1, 1), rtol=0, atol=0)


@needs_native
def test_activation_quantization_is_round_to_nearest_per_block():
    x = torch.randn(2, 64)
    qx, dx, sx = native.quantize_q8(x)
    blocks = x.view(2, 2, 32)
    torch.testing.assert_close(dx, blocks.abs().amax(-1) / 127)
    assert torch.equal(qx.view(2, 2, 32).float(), torch.round(blocks / dx[..., None]))
    torch.testing.assert_close(sx, dx * qx.view(2, 2, 32).float().sum(-1))


@needs_native
def test_bad_arguments_raise_instead_of_crashing():
    _, qs, d, m = q4_1_weight(4, 64)
    with pytest.raises(KernelInputError, match="columns"):
        native.q4_1_mm(torch.randn(1, 32), qs, d, m)
    with pytest.raises(KernelInputError, match="float16"):
        native.q4_1_mm(torch.randn(1, 64), qs, d.float(), m)
    with pytest.raises(KernelInputError, match="int8"):
        native.q8_0_mm(torch.randn(1, 64), qs, d)
    with pytest.raises(KernelInputError, match="columns"):
        native.f32_mm(torch.randn(1, 63), torch.randn(4, 64))
    with pytest.raises(KernelInputError, match="float32"):
        native.f32_mm(torch.randn(1, 64), torch.randn(4, 64).half())
    with pytest.raises(KernelInputError, match="contiguous"):
        native.f32_mm(torch.randn(1, 64), torch.randn(64, 4).T)


@needs_native
def test_the_extension_checks_its_operands_too():
    """The C++ checks behind the Python ones (a caller of torch.ops directly): a RuntimeError, not a crash."""
    _, qs, d, m = q4_1_weight(4, 64)
    with pytest.raises(RuntimeError, match="columns"):
        torch.ops.cipherlm_cpu.q4_1_mm(torch.randn(1, 32), qs, d, m)
    with pytest.raises(RuntimeError, match="contiguous"):
        torch.ops.cipherlm_cpu.f32_mm(torch.randn(1, 64), torch.randn(64, 4).T)


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setenv("CIPHERLM_NATIVE", "0")
    assert native._build() == "disabled by CIPHERLM_NATIVE=0"


@needs_native
@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_gguf_layers_run_natively_and_track_the_dequantized_product(kind):
    w = np.random.default_rng(0).standard_normal((128, 256)).astype(np.float32) * 0.1
    raw = torch.from_numpy(quants.quantize(w, getattr(GGMLQuantizationType, kind)))
    lin = Q.GGUF_DECODERS[kind](raw)
    dense = lin.dequantize()
    x = torch.randn(3, 256)
    y = lin(x)
    assert lin._native_fn, "the native kernel was not used"
    xq = native._dequant_x(x)[0]                                     # the kernel's int8 activations
    torch.testing.assert_close(y, xq @ dense.T, rtol=1e-5, atol=1e-5 * y.abs().max().item())
    ref = x @ dense.T                                                # fp32 activations: int8 rounding only
    assert (y - ref).abs().max() <= 2e-2 * ref.abs().max()
    big = torch.randn(Q.KERNEL_MAX_ROWS + 1, 256)                    # prefill rows: the exact fp32 GEMM
    torch.testing.assert_close(lin(big), big @ dense.T, rtol=1e-6, atol=1e-6)
    # between: Q4_1 past NATIVE_MAX_ROWS on torch's bf16 kernel, Q8_0 on the native kernel up to KERNEL_MAX_ROWS
    mid = torch.randn(Q.KERNEL_MAX_ROWS, 256)
    if kind == "Q4_1":
        assert torch.equal(lin(mid), lin._kernel(mid.to(torch.bfloat16)).float())
    else:
        assert torch.equal(lin(mid), lin._native()(mid))


def test_layers_fall_back_to_torch_where_not_eligible():
    lin = Q.quantize_int4(torch.randn(64, 128) * 0.1, 64)            # groups of 64: not a GGUF block
    x = torch.randn(1, 128)
    y = lin(x)
    assert lin._native_fn is False
    ref = x @ lin.dequantize().T
    assert (y - ref).abs().max() <= 1e-2 * ref.abs().max()
