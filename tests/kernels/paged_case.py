"""Random paged-cache fixtures and a dense float64 oracle shared by the kernel tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PagedCase:
    """Per-sequence contiguous K/V [ctx, Hkv, D] scattered into shuffled blocks of a paged pool."""

    k_cache: torch.Tensor  # [NB, BS, Hkv, D], slots owned by no sequence hold NaN
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [B, max_blocks] int32, padding entries -1
    context_lens: torch.Tensor  # [B] int32
    k_seqs: list[torch.Tensor]
    v_seqs: list[torch.Tensor]


def make_paged_case(
    ctx_lens: list[int], num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
    device: str, gen: torch.Generator, extra_table_cols: int = 1, poison: float = float("nan"),
) -> PagedCase:
    """Build a pool whose blocks are handed out in random order, `poison` wherever no token was written.

    The Triton kernels never load unowned slots, so NaN checks that; the torch reference multiplies them by
    a zero probability, so its tests poison with a large finite value instead.
    """
    need = [-(-n // block_size) for n in ctx_lens]
    nb = sum(need) + 3
    perm = torch.randperm(nb, generator=gen).tolist()
    shape = (nb, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, poison, dtype=dtype, device=device)
    v_cache = torch.full(shape, poison, dtype=dtype, device=device)
    width = max(need, default=0) + extra_table_cols
    tables = torch.full((len(ctx_lens), width), -1, dtype=torch.int32)
    k_seqs, v_seqs = [], []
    for b, n in enumerate(ctx_lens):
        ids = [perm.pop() for _ in range(need[b])]
        tables[b, : need[b]] = torch.tensor(ids, dtype=torch.int32)
        k = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        for t in range(n):
            k_cache[ids[t // block_size], t % block_size] = k[t].to(device)
            v_cache[ids[t // block_size], t % block_size] = v[t].to(device)
        k_seqs.append(k.to(device))
        v_seqs.append(v.to(device))
    ctx = torch.tensor(ctx_lens, dtype=torch.int32, device=device)
    return PagedCase(k_cache, v_cache, tables.to(device), ctx, k_seqs, v_seqs)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """float64 oracle: q [Lq, Hq, D] at the last Lq positions of k/v [ctx, Hkv, D]; causal; GQA by repeat."""
    lq, hq, _ = q.shape
    ctx, hkv, _ = k.shape
    kk = k.double().repeat_interleave(hq // hkv, dim=1)  # query head h uses KV head h // G
    vv = v.double().repeat_interleave(hq // hkv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), kk) * scale
    pos = torch.arange(ctx - lq, ctx, device=q.device)[:, None]
    scores = scores.masked_fill(torch.arange(ctx, device=q.device)[None, :] > pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), vv)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64."""
    return float((out.double() - ref.double()).norm() / ref.double().norm())
