"""Paged prefill attention over a varlen batch of query chunks (chunked prefill, prefix-cache aware).

Layouts: q [T, Hq, D] with sequence b owning rows cu_seqlens_q[b]:cu_seqlens_q[b+1] (q_len_b rows);
k_cache, v_cache [NB, BS, Hkv, D]; block_tables [B, max_blocks] int32; context_lens [B] int32 counts all
cached tokens of b including this chunk, whose K/V are already stored, so the chunk's rows sit at positions
context_lens[b] - q_len_b ... context_lens[b] - 1 (a prefix-cache hit or an earlier chunk just means
context_lens[b] > q_len_b); causal; out [T, Hq, D].

Triton scheme: grid (cdiv(max_q_len * G, BLOCK_M), B, Hkv). A program owns BLOCK_M rows of the flattened
(token, group-head) axis of one KV head — row r is token r // G, query head h * G + r % G — so each K/V
tile it reads serves all G heads (GQA packing). It walks the context in tiles of BLOCK_N tokens up to the
causal limit of its last row, gathering each tile through the block table, with an fp32 online softmax.
fp8 pools (``kernels.kv_quant``): tiles are converted to q's dtype, the program's KV head's K scale joins the
softmax scale and its V scale multiplies the output.
"""

from __future__ import annotations

import dataclasses

import torch

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
    tl,
    triton,
    use_triton,
)
from .errors import KernelInputError
from .kv_quant import check_kv_scales, dequantize_kv
from .paged_decode import gather_kv

__all__ = ["PrefillTuning", "paged_prefill_attention", "paged_prefill_attention_reference"]



@dataclasses.dataclass(frozen=True)
class PrefillTuning:
    """Launch parameters of the prefill kernel (defaults picked by a sweep on an H200, docs/kernels.md).

    Attributes:
        block_m: flattened (token, head) rows per program.
        block_n: context tokens per K/V tile.
        num_warps: warps per program.
        num_stages: software-pipelining depth of the K/V loop (None: Triton's default).
    """

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int | None = 2


def _check_lengths(cu: torch.Tensor, ctx: torch.Tensor, t: int, max_ctx: int) -> None:
    """Value checks of the reference (cheap on CPU): monotone cu_seqlens, q_len <= context <= capacity."""
    if int(cu[0]) != 0 or int(cu[-1]) != t:
        raise KernelInputError(f"cu_seqlens_q must start at 0 and end at T={t}, got {cu.tolist()}")
    q_lens = cu[1:] - cu[:-1]
    if bool((q_lens < 0).any()):
        raise KernelInputError("cu_seqlens_q must be non-decreasing")
    if bool((ctx < q_lens).any()) or bool((ctx > max_ctx).any()):
        raise KernelInputError(f"context_lens must lie in [q_len, max_blocks * BS = {max_ctx}]")


def _attend_one(q, k, v, ctx: int, scale: float) -> torch.Tensor:
    """q [Lq, Hq, D] at positions ctx-Lq..ctx-1, k/v [ctx, Hkv, D] -> [Lq, Hq, D] fp32, causal."""
    lq, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    qf = q.float().view(lq, hkv, g, d).permute(1, 2, 0, 3).reshape(hkv, g * lq, d)  # [Hkv, G*Lq, D]
    scores = torch.matmul(qf, k.float().permute(1, 2, 0)) * scale  # [Hkv, G*Lq, ctx]
    pos = torch.arange(ctx - lq, ctx, device=q.device).repeat(g)  # row (g, i) sits at ctx - Lq + i
    allowed = torch.arange(ctx, device=q.device)[None, :] <= pos[:, None]  # [G*Lq, ctx]
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    out = torch.matmul(probs, v.float().permute(1, 0, 2))  # [Hkv, G*Lq, D]
    return out.view(hkv, g, lq, d).permute(2, 0, 1, 3).reshape(lq, hq, d)


def paged_prefill_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Torch reference of :func:`paged_prefill_attention`: per sequence, gather (dequantized by the
    per-KV-head scales of fp8 pools), masked fp32 softmax."""
    bs = k_cache.shape[1]
    cu, ctx = cu_seqlens_q.cpu().long(), context_lens.cpu().long()
    _check_lengths(cu, ctx, q.shape[0], block_tables.shape[1] * bs)
    out = torch.empty_like(q)
    for b in range(ctx.shape[0]):  # one sequence at a time: contexts differ in length
        lo, hi, n = int(cu[b]), int(cu[b + 1]), int(ctx[b])
        if hi == lo:
            continue
        nblk = cdiv(n, bs)
        used = torch.tensor([nblk], device=block_tables.device)
        k = dequantize_kv(gather_kv(k_cache, block_tables[b : b + 1], nblk, used)[0, :n], k_scale)  # [ctx, Hkv, D]
        v = dequantize_kv(gather_kv(v_cache, block_tables[b : b + 1], nblk, used)[0, :n], v_scale)
        out[lo:hi] = _attend_one(q[lo:hi], k, v, n, scale).to(q.dtype)
    return out


if HAS_TRITON:

    @triton.jit(do_not_specialize=["s_btb", "max_blocks"])  # the step's table width: see _decode_partition_kernel
    def _prefill_kernel(
        q_ptr, kc_ptr, vc_ptr, bt_ptr, cu_ptr, ctx_ptr, out_ptr, ks_ptr, vs_ptr,
        sm_scale_log2,
        s_qt, s_qh, s_kcb, s_kcs, s_kch, s_vcb, s_vcs, s_vch, s_btb, s_ot, s_oh,
        max_blocks, G, D,
        BS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
        DOT_PREC: tl.constexpr, QUANT: tl.constexpr,
    ):
        tile = tl.program_id(0)
        b = tl.program_id(1)
        h = tl.program_id(2)
        if QUANT:  # fp8 pools: this KV head's K scale joins the softmax scale, its V scale the output
            sm_scale_log2 = sm_scale_log2 * tl.load(ks_ptr + h)
        q_start = tl.load(cu_ptr + b)
        q_len = tl.load(cu_ptr + b + 1) - q_start
        ctx = tl.minimum(tl.load(ctx_ptr + b), max_blocks * BS)  # never index past the table
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        tok = rows // G
        heads = h * G + rows % G
        rmask = tok < q_len
        pos = ctx - q_len + tok  # absolute position of each row's token
        dd = tl.arange(0, BLOCK_D)
        dmask = dd < D
        qrow = (q_start + tok).to(tl.int64)
        q = tl.load(q_ptr + qrow[:, None] * s_qt + heads[:, None] * s_qh + dd[None, :],
                    mask=rmask[:, None] & dmask[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
        last_tok = tl.minimum(tile * BLOCK_M + BLOCK_M - 1, q_len * G - 1) // G
        kv_end = tl.minimum(ctx, ctx - q_len + last_tok + 1)  # causal limit of the tile's last row
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for n0 in range(0, kv_end, BLOCK_N):
            offs = n0 + tl.arange(0, BLOCK_N)
            nmask = offs < kv_end
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
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * sm_scale_log2  # [BLOCK_M, BLOCK_N]
            allowed = nmask[None, :] & (offs[None, :] <= pos[:, None])
            qk = tl.where(allowed, qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
            alpha = tl.exp2(m_i - m_use)
            p = tl.exp2(qk - m_use[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
            m_i = m_new
        o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        if QUANT:
            o = o * tl.load(vs_ptr + h)
        tl.store(out_ptr + qrow[:, None] * s_ot + heads[:, None] * s_oh + dd[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & dmask[None, :])


def _paged_prefill_triton(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, max_q, out,
                          tuning: PrefillTuning = PrefillTuning(), k_scale=None, v_scale=None):
    hq, d = q.shape[1:]
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    g = hq // hkv
    b = context_lens.shape[0]
    grid = (cdiv(max_q * g, tuning.block_m), b, hkv)
    extra = {} if tuning.num_stages is None else {"num_stages": tuning.num_stages}
    quant = k_scale is not None
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, out,
        k_scale if quant else context_lens, v_scale if quant else context_lens,
        scale * 1.4426950408889634,  # log2(e): the kernel uses exp2
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1),
        block_tables.shape[1], g, d,
        BS=bs, BLOCK_M=tuning.block_m, BLOCK_D=next_pow2(d), BLOCK_N=tuning.block_n,
        DOT_PREC=dot_precision(q.dtype), QUANT=quant, num_warps=tuning.num_warps, **extra,
    )
    return out


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    max_seqlen_q: int | None = None,
    out: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Causal attention of a varlen batch of query chunks over their paged contexts.

    Args:
        q: [T, Hq, D] queries of all sequences, concatenated (same dtype as the caches unless they are fp8).
        k_cache, v_cache: [NB, BS, Hkv, D] paged pools (or fp8 e4m3 ones) holding every context token, this
            chunk's included.
        block_tables: [B, max_blocks] int32 block ids.
        cu_seqlens_q: [B + 1] int32 row offsets of each sequence's queries in q (0 first, T last).
        context_lens: [B] int32 cached tokens per sequence (>= its query count, <= max_blocks * BS).
        scale: softmax scale, usually D ** -0.5.
        max_seqlen_q: longest query chunk (Triton grid); None reads it from cu_seqlens_q (a host sync).
        out: optional preallocated result, q's shape and dtype (static buffers for CUDA graphs).
        k_scale, v_scale: [Hkv] fp32 per-KV-head scales, with fp8 pools only (value = stored * scale).
        backend: "auto" (Triton on CUDA tensors when it imports), "triton" or "torch".

    Returns:
        out [T, Hq, D] in q's dtype (fp32 accumulation).

    Raises:
        KernelInputError: a dtype, shape, stride or device mismatch (and, on the torch path, bad lengths).
    """
    nb, bs, hkv, d = check_cache_pair(k_cache, v_cache)
    check_tensor("q", q, 3, FLOAT_DTYPES)
    check_tensor("block_tables", block_tables, 2, (torch.int32,))
    check_tensor("cu_seqlens_q", cu_seqlens_q, 1, (torch.int32,))
    check_tensor("context_lens", context_lens, 1, (torch.int32,))
    t, hq = q.shape[:2]
    b = context_lens.shape[0]
    check_shape("q", q, (t, hq, d))
    check_heads(hq, hkv)
    check_shape("block_tables", block_tables, (b, block_tables.shape[1]))
    check_shape("cu_seqlens_q", cu_seqlens_q, (b + 1,))
    if not check_kv_scales(k_cache, k_scale, v_scale):
        check_same_dtype(q=q, k_cache=k_cache)
    check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                      cu_seqlens_q=cu_seqlens_q, context_lens=context_lens)
    out = check_out(out, q)
    if t == 0 or b == 0:
        return out
    if use_triton(backend, q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens):
        if max_seqlen_q is None:
            max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
        return _paged_prefill_triton(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens,
                                     float(scale), max_seqlen_q, out, k_scale=k_scale, v_scale=v_scale)
    ref = paged_prefill_attention_reference(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens,
                                            float(scale), k_scale, v_scale)
    return out.copy_(ref)
