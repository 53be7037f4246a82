"""Runs one scheduled step on the model: flat batch in, logits of the sampling rows out.

The batch is flat (``input_ids [T]``, ``positions [T]``): single-token decodes first, then every
sequence with several query tokens (prefill chunks, and verify steps that score draft tokens behind a
context) through the varlen path. A sequence may yield several logits rows (``ScheduledSeq.num_logits_rows``:
the last rows of its query). On GPU the weights and KV cache are bf16, the forward is the fused one of
``engine.fused`` and decode-only steps replay CUDA graphs captured for
batch buckets (1, 2, 4, 8, 16, 24, 32, ... up to ``cuda_graph_max_batch``); on CPU everything is fp32
and eager.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from engine.config import ModelConfig
from engine.cpu_linear import fuse_projections, pack_linears
from engine.engine_config import EngineConfig
from engine.fused import fuse_for_cuda
from engine.kv_cache import AttentionMetadata, PagedAttention, PagedKVCache, blocks_for_budget, blocks_for_gpu
from engine.model import LlamaForCausalLM, rope_inv_freq
from engine.scheduler import ScheduledSeq, SchedulerOutput

log = logging.getLogger(__name__)


@dataclasses.dataclass
class StepInputs:
    """A built batch: model inputs, attention metadata and which rows yield logits."""

    input_ids: torch.Tensor       # [T] int64
    positions: torch.Tensor       # [T] int64
    meta: AttentionMetadata
    logits_rows: torch.Tensor     # [R] int64 rows whose logits are sampled
    sampling: list[ScheduledSeq]  # the sequences that yield rows, in row order (num_logits_rows each)


def graph_buckets(max_batch: int) -> list[int]:
    """Decode batch sizes that get a CUDA graph (vLLM's: 1, 2, 4, then multiples of 8)."""
    sizes = [b for b in (1, 2, 4) if b <= max_batch] + list(range(8, max_batch + 1, 8))
    return sizes if sizes[-1] == max_batch else sizes + [max_batch]


class ModelRunner:
    """Owns the model on its device, the KV pool and the CUDA graphs."""

    def __init__(self, model: LlamaForCausalLM, config: EngineConfig, max_model_len: int) -> None:
        self.config = config
        self.device = torch.device(config.resolved_device())
        self.dtype = config.resolved_dtype()
        self.model_config: ModelConfig = model.config
        self.model = model.to(device=self.device, dtype=self.dtype).eval()
        # RoPE frequencies stay fp32: bf16 would put angles off by radians at positions in the thousands
        self.model.rotary.inv_freq = rope_inv_freq(model.config).to(self.device)
        if self.is_cuda:  # fused QKV / gate-up weights and Triton norm/RoPE/SwiGLU kernels (engine.fused)
            int4 = config.weight_group_size if config.cuda_weight_format == "int4" else None
            self.model = fuse_for_cuda(self.model, int4_group=int4)
        elif config.cpu_packed_weights:  # oneDNN-packed linears: no per-call weight re-pack (engine.cpu_linear)
            pack_linears(self.model, one_row_copies=config.cpu_one_row_weights)
        if not self.is_cuda and config.cpu_fused_projections:  # one q/k/v and one gate/up product per layer
            fuse_projections(self.model)
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = -(-max_model_len // self.block_size)
        self.kv: PagedKVCache | None = None
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._max_graph = 0

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    # ---- KV pool ----------------------------------------------------------------------------------
    def init_kv_cache(self) -> int:
        """Size (after a warm-up pass on GPU) and allocate the KV pool; return its number of blocks."""
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            num_blocks = cfg.num_kv_blocks
        elif self.is_cuda:
            self._warm_up()
            num_blocks = blocks_for_gpu(self.model_config, self.block_size, self.dtype, self.device,
                                        cfg.gpu_memory_utilization)
        else:
            num_blocks = blocks_for_budget(self.model_config, self.block_size, self.dtype, cfg.kv_cache_bytes)
        if num_blocks < 2:
            raise MemoryError(f"no room for a KV cache: {num_blocks} blocks fit")
        self.kv = PagedKVCache(self.model_config, num_blocks, self.block_size, self.dtype, self.device)
        if self.is_cuda and cfg.cuda_graphs:
            self._capture_graphs(min(cfg.cuda_graph_max_batch, cfg.max_num_seqs))
        return num_blocks

    @torch.inference_mode()
    def _warm_up(self) -> None:
        """A forward of a full token budget on a scratch pool, so the peak activation memory is known."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        t = self.config.max_num_batched_tokens
        seq_len = min(t, self.max_model_len)
        nseq = -(-t // seq_len)
        per_seq = -(-seq_len // self.block_size)
        scratch = PagedKVCache(self.model_config, nseq * per_seq, self.block_size, self.dtype, self.device)
        lens = [min(seq_len, t - i * seq_len) for i in range(nseq)]
        tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(nseq)]
        ids, pos, slots = [], [], []
        for n, table in zip(lens, tables, strict=False):
            ids += [0] * n
            pos += list(range(n))
            slots += [table[p // self.block_size] * self.block_size + p % self.block_size for p in range(n)]
        meta = self._meta(slots, 0, [], [], tables, [0] + _cumsum(lens), lens)
        h = self.model(self._t(ids), self._t(pos), PagedAttention(scratch, meta, self.model_config.head_dim))
        self.model.logits(h[: self.config.max_num_seqs])
        del scratch, h
        torch.cuda.synchronize(self.device)

    # ---- batch building ---------------------------------------------------------------------------
    def prepare(self, sched: SchedulerOutput) -> StepInputs:
        """Build the flat batch: single-token decodes first, then multi-token queries (varlen)."""
        decodes = [s for s in sched.scheduled if s.num_query_tokens == 1]
        prefills = [s for s in sched.scheduled if s.num_query_tokens != 1]
        ids, pos, slots, rows, sampling = [], [], [], [], []
        for s in decodes + prefills:
            ids += s.query_token_ids()
            pos += range(s.start, s.start + s.num_query_tokens)
            slots += self._slots(s)
            if s.num_logits_rows:
                rows += range(len(ids) - s.num_logits_rows, len(ids))
                sampling.append(s)
        meta = self._meta(
            slots, len(decodes),
            [s.seq.block_table for s in decodes], [s.start + 1 for s in decodes],
            [s.seq.block_table for s in prefills], [0] + _cumsum([s.num_query_tokens for s in prefills]),
            [s.start + s.num_query_tokens for s in prefills])
        return StepInputs(self._t(ids), self._t(pos), meta, self._t(rows), sampling)

    def _slots(self, s: ScheduledSeq) -> list[int]:
        bs, table = self.block_size, s.seq.block_table
        return [table[p // bs] * bs + p % bs for p in range(s.start, s.start + s.num_query_tokens)]

    def _meta(self, slots, num_decode, d_tables, d_lens, p_tables, p_cu, p_lens) -> AttentionMetadata:
        meta = AttentionMetadata(slot_mapping=self._t(slots), num_decode=num_decode)
        if num_decode:
            meta.decode_block_tables = self._tables(d_tables)
            meta.decode_context_lens = self._t(d_lens, torch.int32)
        if p_tables:
            meta.prefill_block_tables = self._tables(p_tables)
            meta.prefill_cu_seqlens_q = self._t(p_cu, torch.int32)
            meta.prefill_context_lens = self._t(p_lens, torch.int32)
            meta.prefill_max_q = max(b - a for a, b in zip(p_cu, p_cu[1:], strict=False))
        return meta

    def _tables(self, tables: list[list[int]]) -> torch.Tensor:
        """Block tables padded with 0 to the longest: [B, max_blocks] int32."""
        width = max(len(t) for t in tables)
        return self._t([t + [0] * (width - len(t)) for t in tables], torch.int32)

    def _t(self, data, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        t = torch.tensor(data, dtype=dtype)
        return t.to(self.device, non_blocking=True) if self.is_cuda else t

    # ---- execution --------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> tuple[torch.Tensor, list[ScheduledSeq]]:
        """Run the step; return logits [R, V] (fp32) of the sampling rows and their sequences."""
        assert self.kv is not None, "init_kv_cache() first"
        self.kv.copy_blocks(sched.copies)
        n = len(sched.scheduled)
        if self._graphs and n <= self._max_graph and all(s.num_query_tokens == 1 for s in sched.scheduled):
            return self._run_graph(sched.scheduled)
        inputs = self.prepare(sched)
        backend = PagedAttention(self.kv, inputs.meta, self.model_config.head_dim,
                                 cpu_decode=not self.is_cuda)
        h = self.model(inputs.input_ids, inputs.positions, backend)       # [T, hidden]
        return self.model.logits(h[inputs.logits_rows]), inputs.sampling  # [R, V]

    # ---- CUDA graphs ------------------------------------------------------------------------------
    # Decode inputs live in two device buffers, filled from two pinned host mirrors with one copy each
    # (under gVisor every CUDA call costs ~0.1 ms, so a step makes as few as possible):
    #   buf64 [3, B]: input ids, positions, slots;  buf32 [B + B * W]: context lens, block tables [B, W].
    @torch.inference_mode()
    def _capture_graphs(self, max_batch: int) -> None:
        """Capture decode steps for every bucket, largest first, sharing one memory pool."""
        dev, w = self.device, self.max_blocks_per_seq
        self._buf64 = torch.zeros(3, max_batch, dtype=torch.int64, device=dev)
        self._buf32 = torch.zeros(max_batch * (1 + w), dtype=torch.int32, device=dev)
        self._host64 = torch.zeros(3, max_batch, dtype=torch.int64).pin_memory()
        self._host32 = torch.zeros(max_batch * (1 + w), dtype=torch.int32).pin_memory()
        self._np64, self._np32 = self._host64.numpy(), self._host32.numpy()
        ids, pos, slots = self._buf64
        lens, tables = self._buf32[:max_batch], self._buf32[max_batch:].view(max_batch, w)
        slots.fill_(-1)
        lens.fill_(1)
        pool = None
        try:
            for b in reversed(graph_buckets(max_batch)):
                meta = AttentionMetadata(slots[:b], b, tables[:b], lens[:b])
                backend = PagedAttention(self.kv, meta, self.model_config.head_dim)
                self.model.logits(self.model(ids[:b], pos[:b], backend))  # warm up (Triton JIT)
                torch.cuda.synchronize(dev)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self.model.logits(self.model(ids[:b], pos[:b], backend))
                pool = graph.pool()
                self._graphs[b] = (graph, out)
        except RuntimeError as exc:  # a kernel that syncs with the host cannot be captured
            log.warning("CUDA graph capture failed, decoding eagerly: %s", exc)
            self._graphs.clear()
        self._max_graph = max(self._graphs, default=0)

    def _run_graph(self, scheduled: list[ScheduledSeq]) -> tuple[torch.Tensor, list[ScheduledSeq]]:
        """A decode-only step through the smallest captured bucket that holds it."""
        n = len(scheduled)
        b = min(k for k in self._graphs if k >= n)
        bs, w, maxb = self.block_size, self.max_blocks_per_seq, self._host64.shape[1]
        h64, h32 = self._np64, self._np32
        for i, s in enumerate(scheduled):
            table, p = s.seq.block_table, s.start
            h64[0, i], h64[1, i] = s.seq.token_ids[p], p
            h64[2, i] = table[p // bs] * bs + p % bs
            h32[i] = p + 1
            h32[maxb + i * w: maxb + i * w + len(table)] = table
        h64[2, n:b] = -1          # padding rows write nothing and read one (harmless) slot
        h32[n:b] = 1
        self._buf64.copy_(self._host64, non_blocking=True)
        used = maxb + b * w
        self._buf32[:used].copy_(self._host32[:used], non_blocking=True)
        graph, out = self._graphs[b]
        graph.replay()
        sampling = [s for s in scheduled if s.samples]
        if len(sampling) == n:
            return out[:n], sampling
        if not sampling:  # no token is read back this step: sync so the pinned mirrors can be refilled
            torch.cuda.current_stream(self.device).synchronize()
        rows = [i for i, s in enumerate(scheduled) if s.samples]
        return out[torch.tensor(rows, device=self.device)], sampling


def _cumsum(xs: list[int]) -> list[int]:
    out, total = [], 0
    for x in xs:
        total += x
        out.append(total)
    return out
