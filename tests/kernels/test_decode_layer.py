"""The fused decode-layer kernels (kernels.decode_layer) against their torch references.

Runs on CUDA (marked gpu), or on CPU under Triton's interpreter (``TRITON_INTERPRET=1``; fp16 stands in for
bf16 there); the reference and argument cases run everywhere. Each kernel case runs 16-bit and int4 (w32)
weights, masked row and column tails, several rows, and the PDL code path (the wait made a counter in the
interpreter).
"""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels import (
    DecodeLayerTuning,
    KernelInputError,
    _pdl,
    add_rms_norm_reference,
    gemv_add_residual,
    gemv_add_residual_reference,
    gemv_reference,
    norm_gate_up_silu,
    norm_gate_up_silu_reference,
    norm_qkv_rope_store,
    norm_qkv_rope_store_reference,
    repack_int4_w32,
    rms_norm_reference,
    rope_store_kv_reference,
    silu_mul_reference,
)
from kernels._common import HAS_TRITON, _interpreting
from kernels.gemv_int4 import pack_int4_rows

INTERPRET = HAS_TRITON and _interpreting()
CAN_TRITON = HAS_TRITON and (torch.cuda.is_available() or INTERPRET)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LOW = torch.float16 if INTERPRET else torch.bfloat16  # numpy has no bf16


def triton_test(fn):
    """Skip without Triton on CUDA (or its interpreter); mark gpu unless interpreting."""
    fn = pytest.mark.skipif(not CAN_TRITON, reason="needs triton and CUDA (or TRITON_INTERPRET=1)")(fn)
    return fn if INTERPRET else pytest.mark.gpu(fn)


@pytest.fixture(params=[False, True], ids=["plain", "pdl"])
def pdl(request, monkeypatch):
    """Both launch paths; PDL in the interpreter: the grid-dependency calls counted (the count is returned)."""
    waits = {"n": 0}
    if request.param:
        if INTERPRET:
            import triton.language.extra.cuda as tlcuda

            monkeypatch.setattr(tlcuda, "gdc_wait", lambda: waits.update(n=waits["n"] + 1))
            monkeypatch.setattr(tlcuda, "gdc_launch_dependents", lambda: None)
            monkeypatch.setattr(_pdl, "pdl_launch", lambda t: True)
            monkeypatch.setattr(_pdl, "launch_options", lambda on: {})
        elif torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9:
            kernels.set_pdl(True)
        else:
            pytest.skip("PDL needs compute capability 9.0 (or TRITON_INTERPRET=1)")
    yield waits
    kernels.set_pdl(False)
    if request.param and INTERPRET:
        assert waits["n"] > 0  # the PDL path ran


def _rand(*shape, gen, scale=1.0, dtype=LOW):
    return (torch.randn(*shape, generator=gen) * scale).to(DEVICE, dtype)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def _weight(n: int, k: int, int4: bool, gen, dtype=LOW):
    """(weight, scale_offset): 16-bit [N, K] or int4 w32 (group 32, centred as RTN of a zero-mean matrix)."""
    if not int4:
        return _rand(n, k, gen=gen, scale=k ** -0.5, dtype=dtype), None
    u = torch.randint(0, 16, (n, k), generator=gen)
    scale = (torch.rand(n, k // 32, generator=gen) * 0.5 * k ** -0.5 + 0.01).half()
    offset = (-scale.float() * 7.5).half()
    q32, so = repack_int4_w32(pack_int4_rows(u), scale, offset)
    return q32.to(DEVICE), so.to(DEVICE)


TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}

# (N, K, tuning): tails in rows (N not a multiple of 2 block_n) and in K (K not a multiple of block_k)
SHAPES = [(64, 256, None), (50, 320, DecodeLayerTuning(2, 128, 4, prefetch=False)),
          (24, 384, DecodeLayerTuning(4, 8, 4))]


@pytest.mark.parametrize("int4", [False, True], ids=["16bit", "int4"])
@pytest.mark.parametrize("n,k,tune", SHAPES)
@pytest.mark.parametrize("rows", [1, 3])
@triton_test
def test_gemv_add_residual_matches_reference(int4, n, k, tune, rows, pdl):
    gen = torch.Generator().manual_seed(n + k + rows)
    w, so = _weight(n, k, int4, gen)
    x, res = _rand(rows, k, gen=gen), _rand(rows, n, gen=gen)
    want = gemv_add_residual_reference(x, w, res.clone(), so)
    got = res.clone()
    out = gemv_add_residual(x, w, got, so, tuning=tune, backend="triton")
    assert out.data_ptr() == got.data_ptr()  # in place
    assert _rel(got, want) < TOL[LOW], _rel(got, want)
    # at most one rounding step apart anywhere (the product's summation order differs)
    assert torch.allclose(got.float(), want.float(), rtol=2 ** -7, atol=1e-2)


@pytest.mark.parametrize("int4", [False, True], ids=["16bit", "int4"])
@pytest.mark.parametrize("n,k,tune", SHAPES)
@pytest.mark.parametrize("rows", [1, 2])
@triton_test
def test_norm_gate_up_silu_matches_reference(int4, n, k, tune, rows, pdl):
    gen = torch.Generator().manual_seed(3 * n + k + rows)
    w, so = _weight(n, k, int4, gen)
    h, g = _rand(rows, k, gen=gen, scale=3.0), _rand(k, gen=gen, scale=0.2).add(1.0)
    got = norm_gate_up_silu(h, g, 1e-5, w, so, tuning=tune, backend="triton")
    want = norm_gate_up_silu_reference(h, g, 1e-5, w, so)
    assert got.shape == (rows, n // 2)
    assert _rel(got, want) < 2 * TOL[LOW], _rel(got, want)


def _rope_tables(positions: list[int], d: int):
    pos = torch.tensor(positions, dtype=torch.float32)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    ang = torch.cat([pos[:, None] * inv[None, :]] * 2, dim=1)
    return ang.cos().to(DEVICE), ang.sin().to(DEVICE)


@pytest.mark.parametrize("int4", [False, True], ids=["16bit", "int4"])
@pytest.mark.parametrize("hq,hkv,d,tune", [(6, 2, 64, None), (4, 2, 16, DecodeLayerTuning(8, 128, 4)),
                                          (3, 1, 32, DecodeLayerTuning(2, 64, 2))])
@pytest.mark.parametrize("bias", [False, True])
@triton_test
def test_norm_qkv_rope_store_matches_reference(int4, hq, hkv, d, tune, bias, pdl):
    gen = torch.Generator().manual_seed(hq * d + bias)
    k, t, nb, bs = 128, 3, 4, 4
    n = (hq + 2 * hkv) * d
    w, so = _weight(n, k, int4, gen)
    b = _rand(n, gen=gen, scale=0.5) if bias else None
    h, g = _rand(t, k, gen=gen, scale=2.0), _rand(k, gen=gen, scale=0.2).add(1.0)
    cos, sin = _rope_tables([0, 17, 300], d)
    slots = torch.tensor([5, -1, 14], dtype=torch.int64, device=DEVICE)  # one padding token
    kc = torch.full((nb, bs, hkv, d), float("nan"), dtype=LOW, device=DEVICE)
    vc = kc.clone()
    kc_ref, vc_ref = kc.clone(), vc.clone()
    q = norm_qkv_rope_store(h, g, 1e-5, w, b, hq, hkv, cos, sin, kc, vc, slots, so, tuning=tune, backend="triton")
    q_ref = norm_qkv_rope_store_reference(h, g, 1e-5, w, b, hq, hkv, cos, sin, kc_ref, vc_ref, slots, so)
    assert q.shape == (t, hq, d)
    assert _rel(q, q_ref) < 2 * TOL[LOW], _rel(q, q_ref)
    assert torch.equal(kc.isnan(), kc_ref.isnan()) and torch.equal(vc.isnan(), vc_ref.isnan())
    assert int((~kc.isnan()).any(-1).any(-1).sum()) == 2  # slots 5 and 14, not the padding token's
    assert _rel(kc.nan_to_num(0), kc_ref.nan_to_num(0)) < 2 * TOL[LOW]
    assert _rel(vc.nan_to_num(0), vc_ref.nan_to_num(0)) < 2 * TOL[LOW]


@triton_test
def test_fp32_layer_chain_is_close_to_the_unfused_ops():
    """fp32 weights and activations: a whole fused layer's kernels agree with the unfused ops to ~1e-6."""
    gen = torch.Generator().manual_seed(11)
    hq, hkv, d, hidden, inter = 4, 2, 16, 64, 96
    f32 = torch.float32
    wqkv, _ = _weight((hq + 2 * hkv) * d, hidden, False, gen, f32)
    wo, _ = _weight(hidden, hq * d, False, gen, f32)
    wgu, _ = _weight(2 * inter, hidden, False, gen, f32)
    wd, _ = _weight(hidden, inter, False, gen, f32)
    g1, g2 = _rand(hidden, gen=gen, dtype=f32).add(1.0), _rand(hidden, gen=gen, dtype=f32).add(1.0)
    h = _rand(1, hidden, gen=gen, dtype=f32)
    cos, sin = _rope_tables([9], d)
    slots = torch.tensor([6], dtype=torch.int64, device=DEVICE)
    kc = torch.zeros(2, 4, hkv, d, device=DEVICE)
    vc, kc_ref, vc_ref = kc.clone(), kc.clone(), kc.clone()
    # fused
    q = norm_qkv_rope_store(h, g1, 1e-6, wqkv, None, hq, hkv, cos, sin, kc, vc, slots, backend="triton")
    resid = h.clone()
    gemv_add_residual(q.view(1, -1), wo, resid, backend="triton")
    act = norm_gate_up_silu(resid, g2, 1e-6, wgu, backend="triton")
    gemv_add_residual(act, wd, resid, backend="triton")
    # unfused (the old path's ops)
    qkv = gemv_reference(rms_norm_reference(h, g1, 1e-6), wqkv)
    q_ref = rope_store_kv_reference(qkv, hq, hkv, cos, sin, kc_ref, vc_ref, slots)
    x, r = add_rms_norm_reference(gemv_reference(q_ref.view(1, -1), wo), h, g2, 1e-6)
    out_ref = gemv_reference(silu_mul_reference(gemv_reference(x, wgu)), wd) + r
    torch.testing.assert_close(q, q_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kc, kc_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(vc, vc_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(resid, out_ref, rtol=1e-5, atol=1e-5)


def test_references_are_the_unfused_ops():
    """The torch paths (CPU) are the old path's ops: the residual add rounds like add_rms_norm's."""
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(1, 64, generator=gen).half(), torch.randn(32, 64, generator=gen).half()
    res = torch.randn(1, 32, generator=gen).half()
    got = gemv_add_residual(x, w, res.clone(), backend="torch")
    _, want = add_rms_norm_reference(gemv_reference(x, w), res, torch.ones(32, dtype=torch.half), 1e-6)
    assert torch.equal(got, want)
    h, g = torch.randn(2, 64, generator=gen), torch.rand(64, generator=gen)
    wgu = torch.randn(64, 64, generator=gen)
    assert torch.equal(norm_gate_up_silu(h, g, 1e-6, wgu, backend="torch"),
                       silu_mul_reference(gemv_reference(rms_norm_reference(h, g, 1e-6), wgu)))


def test_bad_arguments_are_typed_errors():
    h, w = torch.zeros(1, 64), torch.zeros(16, 64)
    with pytest.raises(KernelInputError):
        gemv_add_residual(h, w, torch.zeros(1, 8))                       # residual of the wrong width
    with pytest.raises(KernelInputError):
        gemv_add_residual(h, w, torch.zeros(1, 16, dtype=torch.float16))  # dtype mismatch
    with pytest.raises(KernelInputError):
        norm_gate_up_silu(h, torch.zeros(32), 1e-6, w)                   # gain of the wrong width
    with pytest.raises(KernelInputError):
        norm_gate_up_silu(h, torch.zeros(64), 1e-6, torch.zeros(15, 64))  # odd gate/up rows
    cos, sin, slots = torch.ones(1, 8), torch.zeros(1, 8), torch.zeros(1, dtype=torch.int64)
    kc = torch.zeros(2, 2, 1, 8)
    with pytest.raises(KernelInputError):  # 16 rows are not (Hq + 2 Hkv) * D = 48
        norm_qkv_rope_store(h, torch.ones(64), 1e-6, w, None, 4, 1, cos, sin, kc, kc.clone(), slots)
    with pytest.raises(KernelInputError):  # fp8 pools are the unfused path's
        norm_qkv_rope_store(h, torch.ones(64), 1e-6, torch.zeros(48, 64), None, 4, 1, cos, sin,
                            kc.to(torch.float8_e4m3fn), kc.to(torch.float8_e4m3fn), slots)
