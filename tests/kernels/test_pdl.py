"""Programmatic dependent launch (kernels._pdl): the switch, and every PDL kernel gives the plain launch's result.

* CPU: the switch, and that CPU tensors never launch with PDL.
* Triton's interpreter (``TRITON_INTERPRET=1``): the PDL code paths (the first K step's weights loaded before
  the wait, the rest in the loop) with the wait made a no-op (the interpreter runs programs one at a time, so
  there is nothing to wait for): equal to the plain launch and to the torch reference.
* CUDA (marked gpu; PDL itself needs compute capability 9.0): each kernel launched with PDL, and a chain of
  layer-like launches captured in a CUDA graph and replayed on fresh inputs, equal to plain launches — a
  kernel reading its input before the previous kernel wrote it would read the previous replay's values.
"""

from __future__ import annotations

import os

import pytest
import torch

import kernels
from kernels import _pdl
from kernels._common import HAS_TRITON
from kernels.gemv_int4 import pack_int4_rows
from tests.kernels.paged_case import make_paged_case

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
ON_CUDA = torch.cuda.is_available()
SM90 = ON_CUDA and torch.cuda.get_device_capability()[0] >= 9
DEVICE = "cuda" if ON_CUDA else "cpu"
B = {"backend": "triton"} if ON_CUDA or INTERPRET else {}  # CPU tensors take the torch path under "auto"
EPS = 1e-6


@pytest.fixture(autouse=True)
def _pdl_off_after():
    yield
    kernels.set_pdl(False)


@pytest.fixture
def pdl_on(monkeypatch):
    """A callable that switches PDL on or off for the launches after it. In the interpreter it forces the PDL
    code path on CPU tensors, with the grid-dependency calls made counters (asserted > 0 by _both)."""
    if INTERPRET:
        import triton.language.extra.cuda as tlcuda

        state = {"on": False, "waits": 0}
        monkeypatch.setattr(tlcuda, "gdc_wait", lambda: state.update(waits=state["waits"] + 1))
        monkeypatch.setattr(tlcuda, "gdc_launch_dependents", lambda: None)
        monkeypatch.setattr(_pdl, "pdl_launch", lambda t: state["on"])
        monkeypatch.setattr(_pdl, "launch_options", lambda pdl: {})

        def switch(on: bool) -> int:
            state["on"] = on
            return state["waits"]
        return switch
    if not SM90:
        pytest.skip("PDL needs compute capability 9.0 (or TRITON_INTERPRET=1)")

    def switch_cuda(on: bool) -> None:
        kernels.set_pdl(on)
    return switch_cuda


needs_triton = pytest.mark.skipif(not (HAS_TRITON and (ON_CUDA or INTERPRET)),
                                  reason="needs triton and CUDA (or TRITON_INTERPRET=1)")


def test_switch_and_cpu_tensors():
    assert not kernels.pdl_enabled()
    kernels.set_pdl(True)
    assert kernels.pdl_enabled()
    assert not _pdl.pdl_launch(torch.zeros(1))          # CPU tensors: never
    assert _pdl.launch_options(True) == {"launch_pdl": True} and _pdl.launch_options(False) == {}
    kernels.set_pdl(False)
    assert not kernels.pdl_enabled()


def _int4(n: int, k: int, group: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    u = torch.randint(0, 16, (n, k), generator=g)
    scale = (torch.rand(n, k // group, generator=g) * 0.01).half()
    offset = (torch.randn(n, k // group, generator=g) * 0.05).half()
    return tuple(t.to(DEVICE) for t in kernels.repack_int4_w32(pack_int4_rows(u), scale, offset))


def _both(pdl_on, fn):
    """fn() with PDL off, then on: both results (tuples of tensors)."""
    out = []
    for on in (False, True):
        pdl_on(on)
        res = fn()
        out.append(tuple(t.clone() for t in (res if isinstance(res, tuple) else (res,))))
    waits = pdl_on(False)
    assert waits is None or waits > 0  # the interpreter ran the PDL code path
    return out


def _same(a, b, tol: float = 1e-5):
    """PDL changes when a kernel runs, not its arithmetic: equal results (to a rounding, should a compiler
    contract the peeled first step differently); a read before the previous kernel's write is off by O(1)."""
    for x, y in zip(a, b, strict=True):
        assert x.shape == y.shape and torch.isfinite(y).all()
        if not torch.equal(x, y):
            assert float((x.double() - y.double()).norm() / x.double().norm().clamp_min(1e-30)) < tol


@needs_triton
@pytest.mark.parametrize("k", [200, 1024])  # 4 masked K steps / 2 even ones of 512
def test_gemv_with_pdl(pdl_on, k):
    torch.manual_seed(k)
    n = 48
    x, r = torch.randn(1, k, device=DEVICE), torch.randn(1, k, device=DEVICE)
    w, g = torch.randn(n, k, device=DEVICE) * 0.05, torch.rand(k, device=DEVICE) + 0.5
    gu = torch.randn(1, 2 * k, device=DEVICE)
    wd = torch.randn(n, k, device=DEVICE) * 0.05
    tune = kernels.GemvTuning(block_n=4, block_k=64 if k == 200 else 512)
    off, on = _both(pdl_on, lambda: (
        kernels.gemv(x, w, tuning=tune, **B),
        *kernels.gemv_rms_norm(x, g, EPS, w, residual=r, tuning=tune, **B),
        kernels.gemv_silu_mul(gu, wd, tuning=tune, **B)))
    _same(off, on)
    torch.testing.assert_close(on[0], kernels.gemv_reference(x, w), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(on[1], kernels.gemv_rms_norm_reference(x, g, EPS, w, residual=r)[0], rtol=1e-4,
                               atol=1e-4)
    torch.testing.assert_close(on[3], kernels.gemv_silu_mul_reference(gu, wd), rtol=1e-4, atol=1e-4)


@needs_triton
@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("x_per_row", [False, True])
@pytest.mark.parametrize("groups", [4, 16])  # K = 512: 4 K steps / the whole K in the first (pre-wait) step
@pytest.mark.parametrize("k", [512, 576])    # 576: 18 groups, masked last steps (prefetch re-reads the last)
def test_gemv_int4_w32_with_pdl(pdl_on, x_per_row, groups, prefetch, k):
    torch.manual_seed(groups)
    n = 40
    q32, so = _int4(n, k, 32, seed=groups)
    x, r, g = torch.randn(1, k, device=DEVICE), torch.randn(1, k, device=DEVICE), torch.rand(k, device=DEVICE) + 0.5
    tune = kernels.GemvInt4W32Tuning(block_n=8, groups=groups, num_warps=4, x_per_row=x_per_row,
                                     prefetch=prefetch)
    off, on = _both(pdl_on, lambda: (
        kernels.gemv_int4_w32(x, q32, so, tuning=tune, **B),
        *kernels.gemv_int4_w32_rms_norm(x, g, EPS, q32, so, residual=r, tuning=tune, **B)))
    _same(off, on)
    torch.testing.assert_close(on[0], kernels.gemv_int4_w32_reference(x, q32, so), rtol=1e-4, atol=1e-4)
    ref = kernels.gemv_int4_w32_reference(kernels.rms_norm_reference(x + r, g, EPS), q32, so)
    torch.testing.assert_close(on[1], ref, rtol=1e-4, atol=1e-4)


@needs_triton
@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize(("groups", "split"), [(4, 2), (2, 3)])  # K = 576, 18 groups: 5 / 9 steps, masked last
def test_gemv_int4_w32_split_k_with_pdl(pdl_on, groups, split, prefetch):
    """Split K with PDL: each split loads its own first step before the wait; plain and SiLU·mul launches."""
    torch.manual_seed(split)
    n, k = 40, 576
    q32, so = _int4(n, k, 32, seed=split)
    x, gu = torch.randn(1, k, device=DEVICE), torch.randn(1, 2 * k, device=DEVICE)
    tune = kernels.GemvInt4W32Tuning(block_n=8, groups=groups, prefetch=prefetch, split_k=split,
                                     mantissa_unpack=prefetch)  # the in-place nibbles with the prefetch
    off, on = _both(pdl_on, lambda: (kernels.gemv_int4_w32(x, q32, so, tuning=tune, **B),
                                     kernels.gemv_int4_w32_silu_mul(gu, q32, so, tuning=tune, **B)))
    _same(off, on)
    torch.testing.assert_close(on[0], kernels.gemv_int4_w32_reference(x, q32, so), rtol=1e-4, atol=1e-4)
    ref = kernels.gemv_int4_w32_reference(kernels.silu_mul_reference(gu), q32, so)
    torch.testing.assert_close(on[1], ref, rtol=1e-4, atol=1e-4)


@needs_triton
def test_norm_silu_rope_store_attention_with_pdl(pdl_on):
    torch.manual_seed(0)
    hq, hkv, d, t = 4, 2, 16, 3
    x, r, g = torch.randn(t, 96, device=DEVICE), torch.randn(t, 96, device=DEVICE), torch.rand(96, device=DEVICE)
    gu = torch.randn(t, 2 * 80, device=DEVICE)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, device=DEVICE)
    ang = torch.randn(t, d // 2, device=DEVICE)
    cos, sin = torch.cos(ang).repeat(1, 2), torch.sin(ang).repeat(1, 2)
    case = make_paged_case([5, 40, 17], hkv, d, 8, torch.float32, DEVICE, torch.Generator().manual_seed(1),
                           poison=0.0)
    slots = torch.tensor([3, -1, 20], device=DEVICE)

    def run():
        kc, vc = case.k_cache.clone(), case.v_cache.clone()
        q = kernels.rope_store_kv(qkv, hq, hkv, cos, sin, kc, vc, slots, **B)
        att = kernels.paged_decode_attention(q, kc, vc, case.block_tables, case.context_lens, d ** -0.5,
                                             partition_size=16, **B)
        return (kernels.rms_norm(x, g, EPS, **B), *kernels.add_rms_norm(x, r, g, EPS, **B),
                kernels.silu_mul(gu, **B), q, kc, vc, att)

    off, on = _both(pdl_on, run)
    _same(off, on)
    torch.testing.assert_close(on[0], kernels.rms_norm_reference(x, g, EPS))
    torch.testing.assert_close(on[3], kernels.silu_mul_reference(gu))
    att_ref = kernels.paged_decode_attention_reference(on[4], on[5], on[6], case.block_tables, case.context_lens,
                                                       d ** -0.5)
    torch.testing.assert_close(on[7], att_ref, rtol=1e-4, atol=1e-4)


def _layers(h, r, weights, eps=EPS):
    """A decode-like chain: add + RMSNorm -> gate/up GEMV -> SiLU·mul -> int4 down GEMV, per layer."""
    for g, w_gu, q32, so in weights:
        x, r = kernels.add_rms_norm(h, r, g, eps)
        h = kernels.gemv_int4_w32(kernels.silu_mul(kernels.gemv(x, w_gu)), q32, so)
    return kernels.rms_norm(h + r, weights[0][0], eps)


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="PDL needs CUDA with compute capability 9.0")
def test_pdl_chain_in_a_cuda_graph_equals_plain_launches():
    torch.manual_seed(2)
    k, i, depth = 1024, 2048, 12
    weights = [(torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5,
                (torch.randn(2 * i, k, device="cuda") * 0.03).bfloat16(), *_int4(k, i, 32, seed=j))
               for j in range(depth)]
    inputs = [(torch.randn(1, k, device="cuda").bfloat16(), torch.randn(1, k, device="cuda").bfloat16())
              for _ in range(4)]
    want = [_layers(h, r, weights) for h, r in inputs]                 # plain launches
    kernels.set_pdl(True)
    for (h, r), ref in zip(inputs, want, strict=True):                 # eager, with PDL
        _same((ref,), (_layers(h, r, weights),), 1e-2)
    h_in, r_in = inputs[0][0].clone(), inputs[0][1].clone()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        _layers(h_in, r_in, weights)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _layers(h_in, r_in, weights)
    for _ in range(3):
        for (h, r), ref in zip(inputs, want, strict=True):
            h_in.copy_(h)
            r_in.copy_(r)
            graph.replay()
            _same((ref,), (out,), 1e-2)
