"""Paged attention on CPU (fp32): per-step plans built once, shared by every layer.

A step's attention metadata (which pool rows each query reads, the padding mask, the prefill chunks'
context) is the same in all layers; only the pools differ. :func:`plan_step` turns the step's
:class:`~engine.kv_cache.AttentionMetadata` into index tensors once, and each layer then runs a few
large torch ops over them:

* decodes: the rows are sorted by context length and cut into groups (:func:`group_by_length`) so a
  short context is not padded to the longest one. Per group, one ``index_select`` gathers the group's K
  straight into the layout ``[Hkv * B, L, D]`` (head-major, so the scores are one ``baddbmm`` over
  contiguous memory, padding mask included), then a softmax; the probability-weighted sum of V rows is an
  ``embedding_bag`` straight over the pool (no V copy: 3x faster than gather + ``bmm``). The G query
  heads of a KV head are the G rows of one product (GQA packing, no K/V repeat).
* prefill chunks: torch's SDPA (its CPU flash kernel) per sequence; a chunk that is its sequence's whole
  context attends to its own k/v (``is_causal``, no gather), one behind earlier context (chunked
  prefill, prefix-cache hit) gathers the context from the pool with a bottom-right causal mask.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:  # kv_cache imports this module
    from engine.kv_cache import AttentionMetadata

# Fixed cost of one extra decode group, in gathered (row, position) units: ~90 us of per-op overhead
# against ~0.3 us per gathered position per layer on this model (measured on a 2-core EPYC).
GROUP_COST = 300


@dataclasses.dataclass
class DecodeGroup:
    """Decode rows of similar context length, padded to the group's longest.

    Attributes:
        rows: [Bg] int64 rows of the step's decode queries in this group.
        index: [Hkv * Bg * L] int64 rows of a pool viewed as [NB * BS * Hkv, D], ordered (head, row, pos).
        mask: [Hkv * Bg, 1, L] fp additive mask: 0 inside each context, -inf in the padding.
        length: L, the group's longest context.
        bag_index: [Hkv * Bg * G * L] int64 ``index`` repeated for each of the G query heads of a KV
            head: one embedding bag per (head, row, query head).
        bag_offsets: [Hkv * Bg * G] int64 start of each bag (multiples of L).
    """

    rows: torch.Tensor
    index: torch.Tensor
    mask: torch.Tensor
    length: int
    bag_index: torch.Tensor
    bag_offsets: torch.Tensor


@dataclasses.dataclass
class PrefillChunk:
    """One prefill chunk: query rows [lo, hi) of the prefill part, context of ``ctx`` tokens.

    ``slots`` [ctx] int64 (pool slots of positions 0..ctx-1) and ``mask`` [hi-lo, ctx] bool are set only
    when the chunk has earlier context; otherwise it attends to its own k/v.
    """

    lo: int
    hi: int
    ctx: int
    slots: torch.Tensor | None = None
    mask: torch.Tensor | None = None


@dataclasses.dataclass
class StepPlan:
    """All per-step attention indices of the CPU path."""

    decode: list[DecodeGroup]
    decode_order: torch.Tensor | None   # [num_decode] rows group after group (None: one group, in order)
    prefill: list[PrefillChunk]


def group_by_length(lens: list[int], cost: int = GROUP_COST) -> list[list[int]]:
    """Partition row ids into groups minimising sum(rows * longest) + cost per group.

    Rows are sorted by length; the optimal cut of a sorted list into runs is a small dynamic program
    (O(B^2), B = decode rows of the step).
    """
    order = sorted(range(len(lens)), key=lens.__getitem__)
    srt = [lens[i] for i in order]
    best = [0] + [0] * len(srt)      # best[j]: cost of the first j sorted rows
    cut = [0] * (len(srt) + 1)
    for j in range(1, len(srt) + 1):
        best[j], cut[j] = min((best[i] + (j - i) * srt[j - 1] + cost, i) for i in range(j))
    groups, j = [], len(srt)
    while j:
        groups.append(order[cut[j]:j])
        j = cut[j]
    return groups[::-1]


def plan_step(meta: AttentionMetadata, block_size: int, num_kv_heads: int, num_rows: int, group_size: int,
              group_cost: int = GROUP_COST) -> StepPlan:
    """Build the step's plan from its metadata (``num_rows`` = T, ``group_size`` = Hq / Hkv)."""
    decode, order = [], None
    if meta.num_decode:
        lens = meta.decode_context_lens.tolist()
        groups = [sorted(g) for g in group_by_length(lens, group_cost)]
        decode = [_decode_group(meta.decode_block_tables, lens, g, block_size, num_kv_heads, group_size)
                  for g in groups]
        if len(groups) > 1:
            order = torch.tensor([r for g in groups for r in g])
    prefill = []
    if num_rows > meta.num_decode:
        cu = meta.prefill_cu_seqlens_q.tolist()
        ctxs = meta.prefill_context_lens.tolist()
        for b, ctx in enumerate(ctxs):
            prefill.append(_prefill_chunk(meta.prefill_block_tables[b], cu[b], cu[b + 1], ctx, block_size))
    return StepPlan(decode, order, prefill)


def _decode_group(tables: torch.Tensor, lens: list[int], rows: list[int], block_size: int,
                  hkv: int, grp: int) -> DecodeGroup:
    length = max(lens[r] for r in rows)
    rows_t = torch.tensor(rows)
    pos = torch.arange(length)
    blocks = tables[rows_t][:, pos // block_size].long()                     # [Bg, L]
    valid = pos[None, :] < torch.tensor([lens[r] for r in rows])[:, None]   # [Bg, L]
    slots = (blocks * block_size + pos % block_size).masked_fill(~valid, 0)  # padding reads slot 0
    index = (slots[None] * hkv + torch.arange(hkv)[:, None, None]).reshape(-1)
    mask = torch.zeros(len(rows), 1, length).masked_fill(~valid[:, None, :], float("-inf"))
    bags = hkv * len(rows) * grp
    bag_index = index.view(hkv * len(rows), 1, length).expand(-1, grp, -1).reshape(-1)
    return DecodeGroup(rows_t, index, mask.repeat(hkv, 1, 1), length, bag_index,
                       torch.arange(0, bags * length, length))


def _prefill_chunk(table: torch.Tensor, lo: int, hi: int, ctx: int, block_size: int) -> PrefillChunk:
    chunk = PrefillChunk(lo, hi, ctx)
    if ctx > hi - lo:  # earlier context in the pool
        pos = torch.arange(ctx)
        chunk.slots = table[pos // block_size].long() * block_size + pos % block_size
        chunk.mask = torch.ones(hi - lo, ctx, dtype=torch.bool).tril(ctx - (hi - lo))
    return chunk


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: StepPlan,
                     scale: float) -> torch.Tensor:
    """q [B, Hq, D]; caches [NB, BS, Hkv, D] -> [B, Hq, D] (rows in q's order)."""
    d, hkv = q.shape[2], k_cache.shape[2]
    kflat, vflat = k_cache.view(-1, d), v_cache.view(-1, d)  # [NB * BS * Hkv, D]
    if plan.decode_order is None:  # one group holding every row in order
        return _decode_group_attention(q, kflat, vflat, plan.decode[0], hkv, scale)
    outs = [_decode_group_attention(q.index_select(0, g.rows), kflat, vflat, g, hkv, scale)
            for g in plan.decode]
    return torch.empty_like(q).index_copy_(0, plan.decode_order, torch.cat(outs))


def _decode_group_attention(q: torch.Tensor, kflat: torch.Tensor, vflat: torch.Tensor, g: DecodeGroup,
                            hkv: int, scale: float) -> torch.Tensor:
    bg, hq, d = q.shape
    grp = hq // hkv
    qh = q.view(bg, hkv, grp, d).transpose(0, 1).reshape(hkv * bg, grp, d)  # [Hkv*Bg, G, D]
    k = kflat.index_select(0, g.index).view(hkv * bg, g.length, d)           # [Hkv*Bg, L, D]
    mask = g.mask if g.mask.dtype == qh.dtype else g.mask.to(qh.dtype)      # the plan's is fp32 (bf16 models)
    probs = torch.baddbmm(mask, qh, k.transpose(1, 2), alpha=scale).softmax(-1)  # [Hkv*Bg, G, L]
    # probs @ V without gathering V: one weighted bag of pool rows per (head, row, query head)
    out = F.embedding_bag(g.bag_index, vflat, g.bag_offsets, mode="sum",
                          per_sample_weights=probs.view(-1))                 # [Hkv*Bg*G, D]
    return out.view(hkv, bg, grp, d).transpose(0, 1).reshape(bg, hq, d)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, plan: StepPlan, scale: float) -> torch.Tensor:
    """q [P, Hq, D], k/v [P, Hkv, D] (this step's prefill rows, already stored) -> [P, Hq, D]."""
    out = torch.empty_like(q)
    pool_k = k_cache.view(-1, *k_cache.shape[2:])  # [NB * BS, Hkv, D]
    pool_v = v_cache.view(-1, *v_cache.shape[2:])
    for c in plan.prefill:
        if c.hi == c.lo:
            continue
        if c.slots is None:
            kc, vc = k[c.lo:c.hi], v[c.lo:c.hi]
        else:
            kc, vc = pool_k.index_select(0, c.slots), pool_v.index_select(0, c.slots)
        out[c.lo:c.hi] = _sdpa_gqa(q[c.lo:c.hi], kc, vc, c.mask, scale)
    return out


def _sdpa_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
              scale: float) -> torch.Tensor:
    """q [Lq, Hq, D], k/v [L, Hkv, D] -> [Lq, Hq, D]; causal when mask is None (then Lq == L).

    Batch = KV head, heads = its G query heads, K/V broadcast by a stride-0 expand: this 4-D, no-repeat
    layout is what torch's CPU flash kernel takes (``enable_gqa`` falls back to the slower math path).
    """
    lq, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    qh = q.transpose(0, 1).view(hkv, g, lq, d)                    # [Hkv, G, Lq, D]
    kh = k.transpose(0, 1)[:, None].expand(hkv, g, k.shape[0], d)  # [Hkv, G, L, D] (no copy)
    vh = v.transpose(0, 1)[:, None].expand(hkv, g, v.shape[0], d)
    o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, is_causal=mask is None, scale=scale)
    return o.reshape(hq, lq, d).transpose(0, 1)
