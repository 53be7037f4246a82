"""Triton kernels against the torch reference on upcast inputs.

Runs on CUDA (marked gpu), or on CPU under Triton's interpreter: ``TRITON_INTERPRET=1 pytest
tests/kernels/test_triton.py`` with triton installed. Inputs are fresh random data, unowned cache slots
hold NaN, and outputs are poisoned with NaN before each launch, so an unwritten element or a stray read fails.
"""

from __future__ import annotations

import pytest
import torch

from kernels import (
    GemvTuning,
    add_rms_norm,
    gemv,
    paged_decode_attention,
    paged_decode_attention_reference,
    paged_prefill_attention,
    paged_prefill_attention_reference,
    rms_norm,
    rms_norm_reference,
    rope,
    rope_reference,
    silu_mul,
    store_kv,
)
from kernels._common import HAS_TRITON, _interpreting
from tests.kernels.paged_case import make_paged_case, rel_err

INTERPRET = HAS_TRITON and _interpreting()
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [
    pytest.mark.skipif(not (HAS_TRITON and (torch.cuda.is_available() or INTERPRET)),
                       reason="needs triton and CUDA (or TRITON_INTERPRET=1)"),
    *([] if INTERPRET else [pytest.mark.gpu]),
]
MODELS = {  # (Hq, Hkv, D)
    "smollm2": (9, 3, 64), "qwen2.5-0.5b": (14, 2, 64), "llama-3.2-1b": (32, 8, 64), "d128": (8, 2, 128),
}
# Triton's interpreter gets tl.dot wrong on bf16 (numpy has no bf16): there fp16 stands in for it
LOW = torch.float16 if INTERPRET else torch.bfloat16
DTYPES = [torch.float16, torch.float32] if INTERPRET else [torch.bfloat16, torch.float16, torch.float32]
TOL = {torch.bfloat16: 1e-2, torch.float16: 1e-2, torch.float32: 1e-4}


def _upcast(case):
    """The caches in fp32 for the reference, NaN poison zeroed (the kernels run on the poisoned ones)."""
    return case.k_cache.float().nan_to_num(0.0), case.v_cache.float().nan_to_num(0.0)


def _decode_check(lens, model, dtype, bs, partition, seed):
    hq, hkv, d = MODELS[model]
    gen = torch.Generator().manual_seed(seed)
    case = make_paged_case(lens, hkv, d, bs, dtype, DEVICE, gen, extra_table_cols=2)
    q = torch.randn(len(lens), hq, d, generator=gen).to(DEVICE, dtype)
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, d**-0.5,
                           partition_size=partition, out=out, backend="triton")
    ref = paged_decode_attention_reference(q.float(), *_upcast(case), case.block_tables, case.context_lens,
                                           d**-0.5)
    assert not torch.isnan(out).any()
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_single_pass(model, dtype):
    _decode_check([1, 15, 16, 17, 100], model, dtype, 16, 4096, seed=1)


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("partition", [64, 128, None])
def test_decode_split_k(model, partition):
    lens = [1, 64, 0, 129, 700] if INTERPRET else [1, 64, 0, 129, 700, 4096, 3001]  # 0: an idle slot
    _decode_check(lens, model, LOW, 16, partition, seed=2)


@pytest.mark.parametrize("bs", [8, 32])
def test_decode_other_block_sizes(bs):
    _decode_check([5, 200, 63], "smollm2", LOW, bs, 64, seed=3)


def _prefill_check(ctx, q_lens, model, dtype, bs, seed):
    hq, hkv, d = MODELS[model]
    gen = torch.Generator().manual_seed(seed)
    case = make_paged_case(ctx, hkv, d, bs, dtype, DEVICE, gen)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    q = torch.randn(int(cu[-1]), hq, d, generator=gen).to(DEVICE, dtype)
    out = torch.full_like(q, float("nan"))
    paged_prefill_attention(q, case.k_cache, case.v_cache, case.block_tables, cu, case.context_lens,
                            d**-0.5, out=out, backend="triton")
    ref = paged_prefill_attention_reference(q.float(), *_upcast(case), case.block_tables, cu,
                                            case.context_lens, d**-0.5)
    assert not torch.isnan(out).any()
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_varlen_chunked(model, dtype):
    # full prompts, chunks after a cached prefix, single rows, an empty slot
    ctx = [37, 200, 130, 1, 64, 5]
    q_lens = [37, 70, 1, 1, 0, 5]
    _prefill_check(ctx, q_lens, model, dtype, 16, seed=4)


@pytest.mark.skipif(INTERPRET, reason="too slow for the interpreter")
@pytest.mark.parametrize("model", list(MODELS))
def test_prefill_long(model):
    _prefill_check([2048, 1500, 4096], [2048, 300, 1000], model, LOW, 16, seed=5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv(dtype):
    gen = torch.Generator().manual_seed(6)
    nb, bs, hkv, d = 9, 16, 3, 64
    k_cache = torch.full((nb, bs, hkv, d), float("nan"), dtype=dtype, device=DEVICE)
    v_cache = torch.full_like(k_cache, float("nan"))
    qkv = torch.randn(40, 9 + 2 * hkv, d, generator=gen).to(DEVICE, dtype)
    k, v = qkv[:, 9 : 9 + hkv], qkv[:, 9 + hkv :]  # strided views, as sliced from a fused projection
    slots = torch.randperm(nb * bs, generator=gen)[:40]
    slots[::7] = -1
    slots = slots.to(DEVICE)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    store_kv(k, v, k_cache, v_cache, slots, backend="triton")
    store_kv(k, v, ref_k, ref_v, slots, backend="torch")
    assert torch.equal(k_cache.nan_to_num(7.0), ref_k.nan_to_num(7.0))
    assert torch.equal(v_cache.nan_to_num(7.0), ref_v.nan_to_num(7.0))
    assert int((~torch.isnan(k_cache[..., 0, 0])).sum()) == int((slots >= 0).sum())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [576, 896, 2048])
def test_rms_norm_and_add(dtype, hidden):
    gen = torch.Generator().manual_seed(hidden)
    x = torch.randn(33, hidden, generator=gen).to(DEVICE, dtype)
    r = torch.randn(33, hidden, generator=gen).to(DEVICE, dtype)
    w = torch.randn(hidden, generator=gen).to(DEVICE, dtype)
    out = rms_norm(x, w, 1e-5, backend="triton")
    assert rel_err(out, rms_norm_reference(x.float(), w.float(), 1e-5)) < TOL[dtype]
    normed, h = add_rms_norm(x, r, w, 1e-5, backend="triton")
    assert torch.equal(h, x + r)
    assert rel_err(normed, rms_norm_reference(h.float(), w.float(), 1e-5)) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("model", ["smollm2", "llama-3.2-1b", "d128"])
def test_rope(dtype, model):
    hq, hkv, d = MODELS[model]
    gen = torch.Generator().manual_seed(hq)
    qkv = torch.randn(21, hq + 2 * hkv, d, generator=gen).to(DEVICE, dtype)
    q, k = qkv[:, :hq], qkv[:, hq : hq + hkv]  # strided views, as sliced from a fused projection
    ang = torch.rand(21, d // 2, generator=gen) * 100
    cos, sin = torch.cat([ang.cos()] * 2, -1).to(DEVICE), torch.cat([ang.sin()] * 2, -1).to(DEVICE)
    qr, kr = rope(q, k, cos, sin, backend="triton")
    rq, rk = rope_reference(q.float(), k.float(), cos, sin)
    assert rel_err(qr, rq) < TOL[dtype] and rel_err(kr, rk) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [1536, 4864, 8192])
def test_silu_mul(dtype, inter):
    gen = torch.Generator().manual_seed(inter)
    gate_up = (torch.randn(19, 2 * inter, generator=gen) * 3).to(DEVICE, dtype)
    out = torch.full((19, inter), float("nan"), dtype=dtype, device=DEVICE)
    silu_mul(gate_up, out=out, backend="triton")
    g, u = gate_up[:, :inter].double(), gate_up[:, inter:].double()
    assert not torch.isnan(out).any()
    assert rel_err(out, torch.nn.functional.silu(g) * u) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k,bias,m", [(1152, 896, True, 1), (896, 4864, False, 1), (100, 70, True, 3),
                                        (2048, 2048, False, 2)])
def test_gemv(dtype, n, k, bias, m):
    gen = torch.Generator().manual_seed(n + k)
    x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(DEVICE, dtype)
    b = torch.randn(n, generator=gen).to(DEVICE, dtype) if bias else None
    out = torch.full((m, n), float("nan"), dtype=dtype, device=DEVICE)
    gemv(x, w, b, out=out, backend="triton")
    ref = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    assert not torch.isnan(out).any()
    assert rel_err(out, ref) < TOL[dtype]
    for tune in (GemvTuning(1, 256, 4, 1), GemvTuning(16, 512, 8, 3)):
        assert rel_err(gemv(x, w, b, tuning=tune, backend="triton"), ref) < TOL[dtype]
