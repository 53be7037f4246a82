"""The torch references (the CPU engine's attention) against a dense float64 oracle."""

from __future__ import annotations

import pytest
import torch

from kernels import paged_decode_attention, paged_prefill_attention, store_kv
from tests.kernels.paged_case import dense_attention, make_paged_case, rel_err

POISON = 3e4  # finite garbage in unowned cache slots: any leak through the mask shows
SHAPES = [(9, 3, 64), (14, 2, 64), (4, 4, 32), (8, 1, 16)]  # (Hq, Hkv, D): SmolLM2, Qwen2.5, MHA, MQA


@pytest.mark.parametrize("hq,hkv,d", SHAPES)
@pytest.mark.parametrize("bs", [16, 4])
def test_decode_matches_dense(hq, hkv, d, bs):
    gen = torch.Generator().manual_seed(hq * 100 + bs)
    lens = [1, 5, 16, 37, 64]
    case = make_paged_case(lens, hkv, d, bs, torch.float32, "cpu", gen, poison=POISON)
    q = torch.randn(len(lens), hq, d, generator=gen)
    out = paged_decode_attention(q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, d**-0.5)
    assert out.shape == q.shape and out.dtype == q.dtype
    for b, n in enumerate(lens):
        ref = dense_attention(q[b : b + 1], case.k_seqs[b], case.v_seqs[b], d**-0.5)[0]
        assert rel_err(out[b], ref) < 1e-5, (b, n)


@pytest.mark.parametrize("hq,hkv,d", SHAPES)
def test_prefill_matches_dense_with_prefix(hq, hkv, d):
    gen = torch.Generator().manual_seed(hq)
    ctx = [7, 40, 33, 1, 16]
    q_lens = [7, 12, 1, 1, 0]  # full prompt, chunk after a prefix, decode-like row, empty slot
    case = make_paged_case(ctx, hkv, d, 16, torch.float32, "cpu", gen, poison=POISON)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(int(cu[-1]), hq, d, generator=gen)
    out = paged_prefill_attention(q, case.k_cache, case.v_cache, case.block_tables, cu, case.context_lens,
                                  0.3)
    for b in range(len(ctx)):
        lo, hi = int(cu[b]), int(cu[b + 1])
        if hi > lo:
            ref = dense_attention(q[lo:hi], case.k_seqs[b], case.v_seqs[b], 0.3)
            assert rel_err(out[lo:hi], ref) < 1e-5, b


def test_prefill_one_row_equals_decode():
    gen = torch.Generator().manual_seed(7)
    lens = [3, 17, 50]
    case = make_paged_case(lens, 2, 32, 8, torch.float32, "cpu", gen, poison=POISON)
    q = torch.randn(3, 6, 32, generator=gen)
    cu = torch.arange(4, dtype=torch.int32)
    args = (case.k_cache, case.v_cache, case.block_tables)
    dec = paged_decode_attention(q, *args, case.context_lens, 0.2)
    pre = paged_prefill_attention(q, *args, cu, case.context_lens, 0.2)
    torch.testing.assert_close(dec, pre, rtol=1e-5, atol=1e-6)


def test_store_kv_writes_slots_and_skips_padding():
    gen = torch.Generator().manual_seed(1)
    nb, bs, hkv, d = 5, 4, 2, 8
    k_cache = torch.full((nb, bs, hkv, d), float("nan"))
    v_cache = torch.full((nb, bs, hkv, d), float("nan"))
    k, v = torch.randn(4, hkv, d, generator=gen), torch.randn(4, hkv, d, generator=gen)
    slots = torch.tensor([13, -1, 0, 19], dtype=torch.int64)
    store_kv(k, v, k_cache, v_cache, slots)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(k_cache[s // bs, s % bs], k[t]) and torch.equal(v_cache[s // bs, s % bs], v[t])
    written = torch.zeros(nb * bs, dtype=torch.bool)
    written[[13, 0, 19]] = True
    assert torch.isnan(k_cache.view(nb * bs, -1)[~written]).all()  # nothing else touched
    assert not torch.isnan(k_cache.view(nb * bs, -1)[written]).any()


def test_store_kv_accepts_strided_views():
    """k/v sliced out of a fused qkv projection (row stride > Hkv * D) are stored correctly."""
    gen = torch.Generator().manual_seed(2)
    qkv = torch.randn(3, 4 + 2 + 2, 16, generator=gen)
    k, v = qkv[:, 4:6], qkv[:, 6:8]
    k_cache, v_cache = torch.zeros(2, 4, 2, 16), torch.zeros(2, 4, 2, 16)
    store_kv(k, v, k_cache, v_cache, torch.tensor([5, 6, 1]))
    assert torch.equal(k_cache[1, 1], k[0]) and torch.equal(v_cache[0, 1], v[2])


def test_bf16_reference_accumulates_in_fp32():
    gen = torch.Generator().manual_seed(3)
    case = make_paged_case([300], 3, 64, 16, torch.bfloat16, "cpu", gen, poison=POISON)
    q = torch.randn(1, 9, 64, generator=gen).bfloat16()
    out = paged_decode_attention(q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, 0.125)
    assert out.dtype == torch.bfloat16
    ref = dense_attention(q, case.k_seqs[0], case.v_seqs[0], 0.125)
    assert rel_err(out, ref) < 1e-2
