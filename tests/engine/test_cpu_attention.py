"""The CPU attention path (engine.cpu_attention) against the kernels' torch references."""

from __future__ import annotations

import random

import pytest
import torch

import kernels
from engine.cpu_attention import decode_attention, group_by_length, plan_step, prefill_attention
from engine.kv_cache import AttentionMetadata

HQ, HKV, D, BS, NB = 6, 2, 16, 4, 64


def _pool_and_tables(ctx: list[int], seed: int):
    """Random K/V pools and block tables (blocks shuffled over the pool) for contexts `ctx`."""
    g = torch.Generator().manual_seed(seed)
    kc, vc = torch.randn(NB, BS, HKV, D, generator=g), torch.randn(NB, BS, HKV, D, generator=g)
    free = list(range(NB))
    random.Random(seed).shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // BS))] for n in ctx]
    width = max(len(t) for t in tables)
    return kc, vc, torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)


def test_group_by_length_is_a_partition_and_splits_far_lengths():
    lens = [300, 5, 290, 7, 6, 310]
    groups = group_by_length(lens, cost=50)
    assert sorted(r for g in groups for r in g) == list(range(len(lens)))
    assert {frozenset(g) for g in groups} == {frozenset({1, 3, 4}), frozenset({0, 2, 5})}
    assert group_by_length(lens, cost=10**9) == [sorted(range(6), key=lens.__getitem__)]


@pytest.mark.parametrize("group_cost", [0, 8, 10**9])
def test_decode_matches_reference(group_cost):
    ctx = [1, 37, 5, 16, 29, 3, 40]
    kc, vc, tables = _pool_and_tables(ctx, seed=0)
    q = torch.randn(len(ctx), HQ, D, generator=torch.Generator().manual_seed(1))
    lens = torch.tensor(ctx, dtype=torch.int32)
    meta = AttentionMetadata(slot_mapping=torch.zeros(len(ctx), dtype=torch.long), num_decode=len(ctx),
                             decode_block_tables=tables, decode_context_lens=lens)
    plan = plan_step(meta, BS, HKV, len(ctx), HQ // HKV, group_cost)
    assert (len(plan.decode) > 1) == (group_cost < 10**9)
    got = decode_attention(q, kc, vc, plan, D ** -0.5)
    ref = kernels.paged_decode_attention_reference(q, kc, vc, tables, lens, D ** -0.5)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_decode_runs_in_bf16():
    """A bf16 CPU engine (EngineConfig.dtype) decodes several rows: the plan's fp32 mask meets bf16 q/K."""
    ctx = [3, 29, 12]
    kc, vc, tables = _pool_and_tables(ctx, seed=2)
    q = torch.randn(len(ctx), HQ, D, generator=torch.Generator().manual_seed(3))
    lens = torch.tensor(ctx, dtype=torch.int32)
    meta = AttentionMetadata(slot_mapping=torch.zeros(len(ctx), dtype=torch.long), num_decode=len(ctx),
                             decode_block_tables=tables, decode_context_lens=lens)
    plan = plan_step(meta, BS, HKV, len(ctx), HQ // HKV, 10**9)
    got = decode_attention(q.bfloat16(), kc.bfloat16(), vc.bfloat16(), plan, D ** -0.5)
    ref = kernels.paged_decode_attention_reference(q, kc, vc, tables, lens, D ** -0.5)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), ref, rtol=3e-2, atol=3e-2)


def test_prefill_with_and_without_earlier_context_matches_reference():
    q_lens, ctx = [9, 4, 13], [9, 22, 13]  # the second chunk sits behind 18 earlier tokens
    kc, vc, tables = _pool_and_tables(ctx, seed=2)
    g = torch.Generator().manual_seed(3)
    t = sum(q_lens)
    q = torch.randn(t, HQ, D, generator=g)
    cu = [0, 9, 13, 26]
    # this step's k/v are the pool's entries at the chunks' own positions (stored before attention)
    rows = [(b, p) for b, (n, c) in enumerate(zip(q_lens, ctx, strict=True)) for p in range(c - n, c)]
    k = torch.stack([kc[tables[b, p // BS], p % BS] for b, p in rows])
    v = torch.stack([vc[tables[b, p // BS], p % BS] for b, p in rows])
    meta = AttentionMetadata(slot_mapping=torch.zeros(t, dtype=torch.long), num_decode=0,
                             prefill_block_tables=tables, prefill_cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
                             prefill_context_lens=torch.tensor(ctx, dtype=torch.int32), prefill_max_q=13)
    plan = plan_step(meta, BS, HKV, t, HQ // HKV)
    assert [c.slots is None for c in plan.prefill] == [True, False, True]
    got = prefill_attention(q, k, v, kc, vc, plan, D ** -0.5)
    ref = kernels.paged_prefill_attention_reference(q, kc, vc, tables, meta.prefill_cu_seqlens_q,
                                                    meta.prefill_context_lens, D ** -0.5)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
