"""The decode fusions (issue 19.2) against their torch references: GEMVs with an RMSNorm or SiLU·mul
prologue (bf16 ``gemv`` and int4 ``gemv_int4_w32``) and RoPE + K/V store in one launch.

Runs on CUDA (marked gpu), or on CPU under Triton's interpreter (``TRITON_INTERPRET=1``); the reference
cases (torch path, argument errors) run everywhere.
"""

from __future__ import annotations

import pytest
import torch

from kernels import (
    GemvInt4W32Tuning,
    GemvTuning,
    KernelInputError,
    gemv_int4_w32_reference,
    gemv_int4_w32_rms_norm,
    gemv_int4_w32_silu_mul,
    gemv_reference,
    gemv_rms_norm,
    gemv_rms_norm_reference,
    gemv_silu_mul,
    gemv_silu_mul_reference,
    repack_int4_w32,
    rms_norm_reference,
    rope_reference,
    rope_store_kv,
    rope_store_kv_reference,
    silu_mul_reference,
)
from kernels._common import HAS_TRITON, _interpreting
from kernels.gemv_int4 import pack_int4_rows

INTERPRET = HAS_TRITON and _interpreting()
CAN_TRITON = HAS_TRITON and (torch.cuda.is_available() or INTERPRET)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def triton_test(fn):
    """Skip without Triton on CUDA (or its interpreter); mark gpu unless interpreting."""
    fn = pytest.mark.skipif(not CAN_TRITON, reason="needs triton and CUDA (or TRITON_INTERPRET=1)")(fn)
    return fn if INTERPRET else pytest.mark.gpu(fn)


# numpy has no bf16: under the interpreter fp16 stands in for it
LOW = torch.float16 if INTERPRET else torch.bfloat16


def _rand(*shape, gen, scale=1.0, dtype=LOW):
    return (torch.randn(*shape, generator=gen) * scale).to(DEVICE, dtype)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def _int4(n: int, k: int, group: int, gen):
    u = torch.randint(0, 16, (n, k), generator=gen)
    scale = (torch.rand(n, k // group, generator=gen) * 0.02).half()
    offset = (-scale.float() * 7.5).half()  # centred weights, as RTN of a zero-mean matrix gives
    q32, so = repack_int4_w32(pack_int4_rows(u), scale, offset)
    return q32.to(DEVICE), so.to(DEVICE)


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("n,k,bias", [(96, 256, False), (50, 320, True)])  # 50, 320: masked tails
@pytest.mark.parametrize("tune", [GemvTuning(2, 128, 4, 2), GemvTuning(8, 1024, 4, 3)])
@pytest.mark.parametrize("rows", [1, 3])
@triton_test
def test_gemv_rms_norm_matches_reference(with_residual, n, k, bias, tune, rows):
    gen = torch.Generator().manual_seed(n + k + rows)
    x, res = _rand(rows, k, gen=gen), _rand(rows, k, gen=gen)
    g, w = _rand(k, gen=gen, scale=0.2).add(1.0), _rand(n, k, gen=gen, scale=k ** -0.5)
    b = _rand(n, gen=gen) if bias else None
    residual = res if with_residual else None
    y, h = gemv_rms_norm(x, g, 1e-5, w, b, residual=residual, tuning=tune, backend="triton")
    y_ref, h_ref = gemv_rms_norm_reference(x, g, 1e-5, w, b, residual)
    assert torch.equal(h, h_ref)  # the residual stream is bit-exact (same add, same rounding)
    assert _rel(y, y_ref) < 1e-2, _rel(y, y_ref)


@pytest.mark.parametrize("n,i,tune", [(64, 256, None), (40, 320, GemvTuning(4, 128, 4, 2))])
@triton_test
def test_gemv_silu_mul_matches_reference(n, i, tune):
    gen = torch.Generator().manual_seed(n + i)
    gate_up, w = _rand(2, 2 * i, gen=gen, scale=2.0), _rand(n, i, gen=gen, scale=i ** -0.5)
    y = gemv_silu_mul(gate_up, w, tuning=tune, backend="triton")
    assert _rel(y, gemv_silu_mul_reference(gate_up, w)) < 1e-2


@pytest.mark.parametrize("x_per_row", [False, True])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("n,k,groups", [(32, 512, 8), (20, 384, 8)])  # 20, 384: masked tails
@triton_test
def test_int4_w32_rms_norm_matches_reference(x_per_row, with_residual, n, k, groups):
    gen = torch.Generator().manual_seed(n * k)
    q32, so = _int4(n, k, 32, gen)
    x, res = _rand(2, k, gen=gen), _rand(2, k, gen=gen)
    g = _rand(k, gen=gen, scale=0.2).add(1.0)
    residual = res if with_residual else None
    tune = GemvInt4W32Tuning(block_n=4, groups=groups, x_per_row=x_per_row)
    y, h = gemv_int4_w32_rms_norm(x, g, 1e-5, q32, so, residual=residual, tuning=tune, backend="triton")
    h_ref = x if residual is None else x + residual
    y_ref = gemv_int4_w32_reference(rms_norm_reference(h_ref, g, 1e-5), q32, so)
    assert torch.equal(h, h_ref)
    assert _rel(y, y_ref) < 1e-2, _rel(y, y_ref)


@pytest.mark.parametrize("x_per_row", [False, True])
@triton_test
def test_int4_w32_silu_mul_matches_reference(x_per_row):
    gen = torch.Generator().manual_seed(7)
    n, i = 24, 256
    q32, so = _int4(n, i, 32, gen)
    gate_up = _rand(1, 2 * i, gen=gen, scale=2.0)
    tune = GemvInt4W32Tuning(block_n=8, groups=4, x_per_row=x_per_row)
    y = gemv_int4_w32_silu_mul(gate_up, q32, so, tuning=tune, backend="triton")
    assert _rel(y, gemv_int4_w32_reference(silu_mul_reference(gate_up), q32, so)) < 1e-2


def _cache(nb, bs, hkv, d, dtype):
    return (torch.full((nb, bs, hkv, d), float("nan"), dtype=dtype, device=DEVICE),
            torch.full((nb, bs, hkv, d), float("nan"), dtype=dtype, device=DEVICE))


@pytest.mark.parametrize("hq,hkv,d", [(14, 2, 64), (9, 3, 64), (8, 2, 128)])
@triton_test
def test_rope_store_kv_matches_rope_then_store(hq, hkv, d):
    gen = torch.Generator().manual_seed(hq * d)
    t, nb, bs = 5, 6, 4
    qkv = _rand(t, (hq + 2 * hkv) * d, gen=gen)
    pos = torch.tensor([0, 3, 17, 100, 2047], dtype=torch.float32)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    ang = torch.cat([pos[:, None] * inv[None, :]] * 2, dim=1)
    cos, sin = ang.cos().to(DEVICE), ang.sin().to(DEVICE)
    slots = torch.tensor([5, -1, 0, 23, 9], dtype=torch.int64, device=DEVICE)  # one padding token
    kc, vc = _cache(nb, bs, hkv, d, LOW)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    q = rope_store_kv(qkv, hq, hkv, cos, sin, kc, vc, slots, backend="triton")
    q_ref = rope_store_kv_reference(qkv, hq, hkv, cos, sin, kc_ref, vc_ref, slots)
    assert q.shape == (t, hq, d) and torch.allclose(q.float(), q_ref.float(), atol=1e-2, rtol=1e-2)
    assert torch.allclose(kc.float(), kc_ref.float(), atol=1e-2, rtol=1e-2, equal_nan=True)
    assert torch.equal(vc.nan_to_num(0.0), vc_ref.nan_to_num(0.0))  # v is copied, not computed
    assert int(kc.isnan().any(-1).any(-1).flatten().logical_not().sum()) == 4  # 4 slots written, no more


def test_reference_paths_agree_with_the_unfused_ops():
    """Without Triton (CPU) the launchers run their references, which are the unfused ops."""
    gen = torch.Generator().manual_seed(0)
    x, res, g = torch.randn(1, 64, generator=gen), torch.randn(1, 64, generator=gen), torch.rand(64, generator=gen)
    w = torch.randn(16, 64, generator=gen)
    y, h = gemv_rms_norm(x, g, 1e-6, w, residual=res, backend="torch")
    assert torch.equal(h, x + res)
    assert torch.allclose(y, gemv_reference(rms_norm_reference(x + res, g, 1e-6), w))
    gate_up = torch.randn(1, 128, generator=gen)
    assert torch.allclose(gemv_silu_mul(gate_up, w, backend="torch"), gemv_reference(silu_mul_reference(gate_up), w))
    qkv = torch.randn(2, 6 * 8, generator=gen)  # Hq 4, Hkv 1, D 8
    cos, sin = torch.ones(2, 8), torch.zeros(2, 8)
    kc, vc = torch.zeros(2, 2, 1, 8), torch.zeros(2, 2, 1, 8)
    q = rope_store_kv(qkv, 4, 1, cos, sin, kc, vc, torch.tensor([1, 2]), backend="torch")
    assert torch.equal(q, rope_reference(qkv[:, :32].view(2, 4, 8), qkv[:, 32:40].view(2, 1, 8), cos, sin)[0])
    assert torch.equal(kc[0, 1, 0], qkv[0, 32:40]) and torch.equal(vc[1, 0, 0], qkv[1, 40:48])


def test_bad_arguments_are_typed_errors():
    x, w = torch.zeros(1, 64), torch.zeros(16, 64)
    with pytest.raises(KernelInputError):
        gemv_rms_norm(x, torch.zeros(32), 1e-6, w)  # gain of the wrong width
    with pytest.raises(KernelInputError):
        gemv_rms_norm(x, torch.zeros(64), 1e-6, w, residual=torch.zeros(1, 64, dtype=torch.float16))
    with pytest.raises(KernelInputError):
        gemv_silu_mul(torch.zeros(1, 127), w)
    with pytest.raises(KernelInputError):
        rope_store_kv(torch.zeros(2, 48), 4, 2, torch.ones(2, 8), torch.zeros(2, 8), torch.zeros(2, 2, 1, 8),
                      torch.zeros(2, 2, 1, 8), torch.tensor([0, 1]))  # Hkv 2 but the cache has 1
