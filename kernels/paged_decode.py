"""Paged decode attention: one new query per sequence over its cached context (flash-decoding).

Layouts: q [B, Hq, D]; k_cache, v_cache [NB, BS, Hkv, D]; block_tables [B, max_blocks] int32 (entries past
a sequence's last block are ignored and may hold anything, e.g. -1); context_lens [B] int32, counting the
new token whose K/V is already stored; out [B, Hq, D]. Cache slots past a context are never used, but the
torch reference needs them finite (zero-initialised pools, as the engine allocates, are).

Triton scheme:
* GQA packing: program (b, h, s) loads the G = Hq / Hkv query heads of KV head h as one [G, D] tile
  (padded to 16 rows for tl.dot), so each K/V tile is read from HBM once for all G heads.
* Split-K: the context is cut into partitions of ``partition_size`` tokens; grid (B, Hkv, num_splits).
  Each program runs an online softmax (fp32, exp2) over its partition and, when there is more than one
  split, writes its normalized partial output [B, Hq, S, D] and log2-sum-exp [B, Hq, S] (fp32); a second
  kernel, grid (B, Hq), merges the partitions of a row. With one split the first kernel writes ``out``.
* fp8 pools (``kernels.kv_quant``): K/V tiles are converted to q's dtype before the products; the program's
  KV head has one K scale, folded into the softmax scale, and one V scale, applied to its output.
* The grid depends only on shapes (max_blocks * BS bounds the context), never on context_lens' values,
  so the launch needs no host sync and can be captured in a CUDA graph; partitions past a sequence's
  context exit at once.
"""

from __future__ import annotations

import dataclasses

import torch

from . import _pdl
from ._common import (
    FLOAT_DTYPES,
    HAS_TRITON,
    Backend,
    cdiv,
    check_cache_pair,
    check_heads,
    check_out,
    check_same_device,
    check_same_dtype,
    check_shape,
    check_tensor,
    dot_precision,
    next_pow2,
    num_sms,
    tl,
    triton,
    use_triton,
)
from .errors import KernelInputError
from .kv_quant import check_kv_scales, dequantize_kv

__all__ = ["DecodeTuning", "gather_kv", "paged_decode_attention", "paged_decode_attention_reference"]



@dataclasses.dataclass(frozen=True)
class DecodeTuning:
    """Launch parameters of the decode kernels (defaults picked by a sweep on an H200, docs/kernels.md).

    Attributes:
        block_n: tokens per K/V tile inside a partition.
        num_warps: warps of the partition kernel.
        programs_per_sm: split the context until B * Hkv * splits reaches this many programs per SM.
        min_partition: never split finer than this many tokens.
    """

    block_n: int = 128
    num_warps: int = 4
    programs_per_sm: int = 4
    min_partition: int = 128


def gather_kv(
    cache: torch.Tensor, block_tables: torch.Tensor, num_blocks: int, used_blocks: torch.Tensor
) -> torch.Tensor:
    """Gather each sequence's first `num_blocks` blocks: cache [NB, BS, Hkv, D] -> [B, num_blocks*BS, Hkv, D].

    `used_blocks` [B] says how many table entries each sequence really uses; the others are read as
    block 0 (their tokens are masked by the caller), so padding entries such as -1 are harmless.
    """
    nb, dtype = cache.shape[0], cache.dtype
    if cache.element_size() == 1:  # fp8: gather the bytes (index kernels do not all take float8)
        cache = cache.view(torch.uint8)
    tables = block_tables[:, :num_blocks].long()
    used = torch.arange(num_blocks, device=tables.device)[None, :] < used_blocks[:, None]
    bad = used & ((tables < 0) | (tables >= nb))
    if bool(bad.any()):
        raise KernelInputError(f"block_tables holds a block id outside [0, {nb}) in a used entry")
    tables = torch.where(used, tables, 0)
    b = tables.shape[0]
    rows = cache.reshape(nb, -1).index_select(0, tables.flatten())  # whole blocks: faster than cache[tables]
    return rows.view(b, num_blocks * cache.shape[1], *cache.shape[2:]).view(dtype)


def paged_decode_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Torch reference of :func:`paged_decode_attention`: gather the blocks (dequantized by the per-KV-head
    scales of fp8 pools), masked softmax in fp32."""
    b, hq, d = q.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    g = hq // hkv
    ctx = context_lens.long()
    max_ctx = int(ctx.max()) if b else 0
    if max_ctx == 0:
        return torch.zeros_like(q)
    nblk = cdiv(max_ctx, bs)
    if nblk > block_tables.shape[1]:
        raise KernelInputError(
            f"context of {max_ctx} tokens needs {nblk} blocks > max_blocks {block_tables.shape[1]}")
    used = (ctx + bs - 1) // bs
    k = dequantize_kv(gather_kv(k_cache, block_tables, nblk, used), k_scale)  # [B, L, Hkv, D] fp32, a copy
    v = dequantize_kv(gather_kv(v_cache, block_tables, nblk, used), v_scale)
    # slots past a context get probability 0; they must hold finite values (the engine's pools are
    # zero-initialised), since 0 * NaN would leak into the sum. The Triton kernels never load them.
    invalid = torch.arange(nblk * bs, device=q.device)[None, :] >= ctx[:, None]  # [B, L]
    qf = q.float().view(b, hkv, g, d)  # [B, Hkv, G, D]
    out = torch.empty(b, hkv, g, d, dtype=torch.float32, device=q.device)
    for h in range(hkv):  # per KV head: bmm reads the strided [B, L, D] views without a transposing copy
        scores = torch.bmm(qf[:, h], k[:, :, h].transpose(1, 2))  # [B, G, L]
        scores.mul_(scale).masked_fill_(invalid[:, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0)  # a 0-token context attends to nothing
        out[:, h] = torch.bmm(probs, v[:, :, h])  # [B, G, D]
    return out.view(b, hq, d).to(q.dtype)


if HAS_TRITON:
    from ._pdl import pdl_wait

    @triton.jit
    def online_softmax_step(q, k, v, nmask, m_i, l_i, acc, sm_scale_log2, DOT_PREC: tl.constexpr):
        """One K/V tile of a decode query group's online softmax (fp32, exp2): q [G, D], k and v [N, D] in q's
        dtype, ``nmask`` [N] the tile's tokens in range; the running max, sum and output -> their updates."""
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * sm_scale_log2  # [G, N]
        qk = tl.where(nmask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        return m_new, l_i, acc

    # The arguments that follow a step's batch and block-table width (the partition, the splits, the table's
    # width and stride) are plain runtime values, not specialised on: an eager step of any shape then reuses the
    # variants compiled at start-up (warm-up pass, graph capture) instead of compiling new ones on a server's
    # first traffic (docs/benchmarks.md, session 24: 13 partition and 10 reduce variants had been compiled).
    @triton.jit(do_not_specialize=["s_btb", "max_blocks", "NUM_SPLITS", "PARTITION"])
    def _decode_partition_kernel(
        q_ptr, kc_ptr, vc_ptr, bt_ptr, ctx_ptr, out_ptr, part_out_ptr, part_lse_ptr, ks_ptr, vs_ptr,
        sm_scale_log2,
        s_qb, s_qh, s_kcb, s_kcs, s_kch, s_vcb, s_vcs, s_vch, s_btb, s_ob, s_oh,
        max_blocks, G, D, HQ, NUM_SPLITS, PARTITION,
        BS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, DOT_PREC: tl.constexpr, QUANT: tl.constexpr,
        PDL: tl.constexpr,
    ):
        b = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.program_id(2)
        pdl_wait(PDL)
        if QUANT:  # fp8 pools: this KV head's K scale joins the softmax scale, its V scale the output
            sm_scale_log2 = sm_scale_log2 * tl.load(ks_ptr + h)
        ctx = tl.minimum(tl.load(ctx_ptr + b), max_blocks * BS)  # never index past the table
        start = s * PARTITION
        end = tl.minimum(start + PARTITION, ctx)
        g = tl.arange(0, BLOCK_G)
        dd = tl.arange(0, BLOCK_D)
        gmask = g < G
        dmask = dd < D
        heads = h * G + g  # query heads of this KV head
        q = tl.load(q_ptr + b.to(tl.int64) * s_qb + heads[:, None] * s_qh + dd[None, :],
                    mask=gmask[:, None] & dmask[None, :], other=0.0)  # [BLOCK_G, BLOCK_D]
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for n0 in range(start, end, BLOCK_N):
            offs = n0 + tl.arange(0, BLOCK_N)
            nmask = offs < end
            blk = tl.load(bt_ptr + b.to(tl.int64) * s_btb + offs // BS, mask=nmask, other=0).to(tl.int64)
            within = offs % BS
            kv_mask = nmask[:, None] & dmask[None, :]
            k = tl.load(kc_ptr + blk[:, None] * s_kcb + within[:, None] * s_kcs + h * s_kch + dd[None, :],
                        mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
            v = tl.load(vc_ptr + blk[:, None] * s_vcb + within[:, None] * s_vcs + h * s_vch + dd[None, :],
                        mask=kv_mask, other=0.0)
            if QUANT:  # fp8 -> q's dtype is exact
                k = k.to(q.dtype)
                v = v.to(q.dtype)
            m_i, l_i, acc = online_softmax_step(q, k, v, nmask, m_i, l_i, acc, sm_scale_log2, DOT_PREC)
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)  # an empty partition contributes nothing
        o = acc / l_safe[:, None]
        if QUANT:
            o = o * tl.load(vs_ptr + h)
        out_rows = G  # query heads this program writes to `out` (masks built from vectors: see store_kv)
        if SPLIT:
            # a context within one partition is finished here; the reduce kernel skips that sequence
            single = tl.cdiv(ctx, PARTITION) <= 1
            part_rows = tl.where(single, 0, G)
            out_rows = tl.where(single & (s == 0), G, 0)
            row = (b.to(tl.int64) * HQ + heads) * NUM_SPLITS + s  # [BLOCK_G]
            lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
            tl.store(part_lse_ptr + row, lse, mask=g < part_rows)
            tl.store(part_out_ptr + row[:, None] * D + dd[None, :], o,
                     mask=(g < part_rows)[:, None] & dmask[None, :])
        tl.store(out_ptr + b.to(tl.int64) * s_ob + heads[:, None] * s_oh + dd[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=(g < out_rows)[:, None] & dmask[None, :])

    @triton.jit(do_not_specialize=["max_blocks", "NUM_SPLITS", "PARTITION"])
    def _decode_reduce_kernel(
        part_out_ptr, part_lse_ptr, ctx_ptr, out_ptr,
        s_ob, s_oh, max_blocks, D, HQ, NUM_SPLITS, PARTITION,
        BS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
        PDL: tl.constexpr,
    ):
        b = tl.program_id(0)
        hq = tl.program_id(1)
        pdl_wait(PDL)
        ctx = tl.minimum(tl.load(ctx_ptr + b), max_blocks * BS)
        n_valid = tl.cdiv(ctx, PARTITION)  # partitions that saw at least one token
        n_valid = tl.where(n_valid > 1, n_valid, 0)  # 0 or 1: the partition kernel wrote `out` itself
        dd = tl.arange(0, BLOCK_D)
        dmask = dd < D
        base = (b.to(tl.int64) * HQ + hq) * NUM_SPLITS
        m = tl.full([1], float("-inf"), tl.float32)
        denom = tl.zeros([1], tl.float32)
        acc = tl.zeros([BLOCK_D], tl.float32)
        for s0 in range(0, n_valid, BLOCK_S):
            sp = s0 + tl.arange(0, BLOCK_S)
            smask = sp < n_valid
            lse = tl.load(part_lse_ptr + base + sp, mask=smask, other=float("-inf"))  # [BLOCK_S]
            o = tl.load(part_out_ptr + (base + sp)[:, None] * D + dd[None, :],
                        mask=smask[:, None] & dmask[None, :], other=0.0)  # [BLOCK_S, BLOCK_D]
            m_new = tl.maximum(m, tl.max(lse, 0))
            alpha = tl.exp2(m - m_new)
            w = tl.where(smask, tl.exp2(lse - m_new), 0.0)
            denom = denom * alpha + tl.sum(w, 0)
            acc = acc * alpha + tl.sum(w[:, None] * o, 0)
            m = m_new
        denom = tl.where(denom > 0.0, denom, 1.0)
        tl.store(out_ptr + b.to(tl.int64) * s_ob + hq * s_oh + dd, (acc / denom).to(out_ptr.dtype.element_ty),
                 mask=dd < tl.where(n_valid > 0, D, 0))


REDUCE_BLOCK_S = 16  # partitions the merge kernel reads per loop step (one value: one compiled variant)


def plan_partition(batch: int, num_kv_heads: int, max_context: int, sms: int, tuning: DecodeTuning) -> int:
    """Tokens per split-K partition: split until the grid has about `programs_per_sm` programs per SM."""
    splits_wanted = cdiv(tuning.programs_per_sm * sms, max(1, batch * num_kv_heads))
    part = next_pow2(cdiv(max_context, splits_wanted))
    return max(tuning.min_partition, part)


def _paged_decode_triton(q, k_cache, v_cache, block_tables, context_lens, scale, partition_size, out,
                         tuning: DecodeTuning = DecodeTuning(), k_scale=None, v_scale=None):
    b, hq, d = q.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    g = hq // hkv
    max_blocks = block_tables.shape[1]
    max_ctx = max_blocks * bs
    part = partition_size or plan_partition(b, hkv, max_ctx, num_sms(q.device), tuning)
    block_n = tuning.block_n if part >= tuning.block_n else max(16, next_pow2(part))  # tl.dot needs >= 16
    part = cdiv(part, block_n) * block_n
    num_splits = cdiv(max_ctx, part)
    split = num_splits > 1
    if split:
        part_out = torch.empty((b, hq, num_splits, d), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((b, hq, num_splits), dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused
    block_d = next_pow2(d)
    quant = k_scale is not None
    pdl = _pdl.pdl_launch(q)
    _decode_partition_kernel[(b, hkv, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, part_out, part_lse,
        k_scale if quant else context_lens, v_scale if quant else context_lens,
        scale * 1.4426950408889634,  # log2(e): the kernel uses exp2
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1),
        max_blocks, g, d, hq, num_splits, part,
        BS=bs, BLOCK_G=max(16, next_pow2(g)), BLOCK_D=block_d, BLOCK_N=block_n,
        SPLIT=split, DOT_PREC=dot_precision(q.dtype), QUANT=quant, PDL=pdl, num_warps=tuning.num_warps,
        **_pdl.launch_options(pdl),
    )
    if split:
        _decode_reduce_kernel[(b, hq)](
            part_out, part_lse, context_lens, out, out.stride(0), out.stride(1),
            max_blocks, d, hq, num_splits, part,
            BS=bs, BLOCK_S=REDUCE_BLOCK_S, BLOCK_D=block_d, PDL=pdl,
            num_warps=2, **_pdl.launch_options(pdl),
        )
    return out


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    partition_size: int | None = None,
    out: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Attention of one query per sequence over its paged context.

    Args:
        q: [B, Hq, D] queries (fp16, bf16 or fp32; same dtype as the caches unless they are fp8).
        k_cache, v_cache: [NB, BS, Hkv, D] paged pools (or fp8 e4m3 ones); Hq must be a multiple of Hkv.
        block_tables: [B, max_blocks] int32 block ids; entries past a sequence's blocks are ignored.
        context_lens: [B] int32 tokens to attend to (the new token included, its K/V already stored).
        scale: softmax scale, usually D ** -0.5.
        partition_size: split-K partition in tokens (Triton only); None picks one from the shapes.
        out: optional preallocated result, q's shape and dtype (static buffers for CUDA graphs).
        k_scale, v_scale: [Hkv] fp32 per-KV-head scales, with fp8 pools only (value = stored * scale).
        backend: "auto" (Triton on CUDA tensors when it imports), "triton" or "torch".

    Returns:
        out [B, Hq, D] in q's dtype (fp32 accumulation); a 0-token context gives zeros.

    Raises:
        KernelInputError: a dtype, shape, stride or device mismatch.
    """
    nb, bs, hkv, d = check_cache_pair(k_cache, v_cache)
    check_tensor("q", q, 3, FLOAT_DTYPES)
    check_tensor("block_tables", block_tables, 2, (torch.int32,))
    check_tensor("context_lens", context_lens, 1, (torch.int32,))
    b, hq = q.shape[:2]
    check_shape("q", q, (b, hq, d))
    check_heads(hq, hkv)
    check_shape("block_tables", block_tables, (b, block_tables.shape[1]))
    check_shape("context_lens", context_lens, (b,))
    if not check_kv_scales(k_cache, k_scale, v_scale):
        check_same_dtype(q=q, k_cache=k_cache)
    check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                      context_lens=context_lens)
    if partition_size is not None and partition_size <= 0:
        raise KernelInputError(f"partition_size must be positive, got {partition_size}")
    out = check_out(out, q)
    if b == 0 or block_tables.shape[1] == 0:
        return out.zero_()
    if use_triton(backend, q, k_cache, v_cache, block_tables, context_lens):
        return _paged_decode_triton(q, k_cache, v_cache, block_tables, context_lens, float(scale),
                                    partition_size, out, k_scale=k_scale, v_scale=v_scale)
    ref = paged_decode_attention_reference(q, k_cache, v_cache, block_tables, context_lens, float(scale),
                                           k_scale, v_scale)
    return out.copy_(ref)
