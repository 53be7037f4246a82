"""Runs one scheduled step on the model: flat batch in, logits of the sampling rows out.

The batch is flat (``input_ids [T]``, ``positions [T]``): single-token decodes first, then every
sequence with several query tokens (prefill chunks, and verify steps that score draft tokens behind a
context) through the varlen path. A sequence may yield several logits rows (``ScheduledSeq.num_logits_rows``:
the last rows of its query). On GPU the weights and KV cache are bf16 (the cache fp8 e4m3 with
``EngineConfig.kv_cache_dtype``: scales calibrated in ``init_kv_cache``), the forward is the fused one of
``engine.fused``, decode-only steps replay CUDA graphs captured for batch buckets (1, 2, 4, 8, 16, 24, 32,
... up to ``cuda_graph_max_batch``; buckets up to ``ONE_PASS_MAX_BATCH`` also get a twin whose attention runs
one pass, without the split-K reduce kernel, replayed when every context fits
``EngineConfig.cuda_one_pass_decode_tokens``), steps that mix short prompt chunks into their decodes replay the
same graphs with every prompt token as a decode row of its own (buckets up to ``cuda_graph_max_batch +
cuda_graph_mixed_tokens``: see :meth:`ModelRunner._mixed_bucket`) and verify steps (decodes carrying up to ``k``
drafts each, for the ``k`` of ``EngineConfig.verify_graph_tokens``) replay graphs captured for the buckets up to
the batch that still speculates; other steps run eagerly. On CPU everything is fp32 and eager (fp8 pools: through the
kernels' torch references).
"""

from __future__ import annotations

import bisect
import dataclasses
import logging

import numpy as np
import torch

import kernels
from engine import cpu_decode
from engine.config import ModelConfig
from engine.cpu_linear import fuse_projections, pack_linears
from engine.engine_config import EngineConfig
from engine.fused import fuse_for_cuda
from engine.kv_cache import (
    CALIBRATION_TOKENS,
    AttentionMetadata,
    PagedAttention,
    PagedKVCache,
    blocks_for_budget,
    blocks_for_gpu,
    calibrate_kv_scales,
)
from engine.model import LlamaForCausalLM, rope_inv_freq
from engine.scheduler import ScheduledSeq, SchedulerOutput
from kernels import cpu as native_kernels

log = logging.getLogger(__name__)

# decode buckets up to this batch also get a graph whose attention is one pass per (sequence, KV head) for
# contexts up to EngineConfig.cuda_one_pass_decode_tokens; wider batches already fill the GPU unsplit
ONE_PASS_MAX_BATCH = 8
# decode graphs above cuda_graph_max_batch rows (steps carrying prompt tokens as rows) come this many rows apart
MIXED_BUCKET_STEP = 64
# decode graphs of up to this many rows also take their rows' greedy tokens (argmax) in the graph, where the
# overlapped loop reads them: one launch fewer a step for the host; beyond it the step's own argmax is cheaper
# than one over every row of the bucket in a step that samples otherwise
GREEDY_GRAPH_MAX_BATCH = 8
# a prompt row's attention reads its own context, with no query tile sharing a K/V load as the prefill kernel's
# do: a step's prompt rows may read this many context tokens per prompt token allowed (cuda_graph_mixed_tokens)
# before the step goes to the prefill kernel instead (a late chunk of a long prompt: ~its length per row)
MIXED_MEAN_CONTEXT = 512


@dataclasses.dataclass
class StepInputs:
    """A built batch: model inputs, attention metadata and which rows yield logits."""

    input_ids: torch.Tensor       # [T] int64
    positions: torch.Tensor       # [T] int64
    meta: AttentionMetadata
    logits_rows: torch.Tensor     # [R] int64 rows whose logits are sampled
    sampling: list[ScheduledSeq]  # the sequences that yield rows, in row order (num_logits_rows each)


class LaunchedStep:
    """A step whose greedy tokens were sampled on the device and not yet read back (the overlapped loop).

    ``sampling``: the sequences that yield a token, one row each, in row order; ``rows``: seq_id -> row, where
    the next launch finds the token a placeholder stands for; the tokens are copied into pinned host memory
    behind the step's GPU work, and :meth:`token_ids` waits for that copy alone.
    """

    def __init__(self, sampling: list[ScheduledSeq], tokens: torch.Tensor, event) -> None:
        self.sampling = sampling
        self.rows = {s.seq.seq_id: i for i, s in enumerate(sampling)}
        self._tokens, self._event = tokens, event

    def token_ids(self) -> list[int]:
        """The sampled tokens in row order (blocks until the step's GPU work is done)."""
        if self._event is not None:
            self._event.synchronize()
        return self._tokens.tolist()


def graph_buckets(max_batch: int, mixed_tokens: int = 0) -> list[int]:
    """Row counts that get a decode graph: vLLM's batch sizes 1, 2, 4, then multiples of 8 up to ``max_batch``;
    with ``mixed_tokens``, buckets above it up to ``max_batch + mixed_tokens`` (decodes with prompt tokens as
    rows): every ``MIXED_BUCKET_STEP`` rows for the first 512, then every 4 * ``MIXED_BUCKET_STEP`` (a padding
    of at most ~1/3 of a step's rows past 512)."""
    sizes = [b for b in (1, 2, 4) if b <= max_batch] + list(range(8, max_batch + 1, 8))
    sizes = sizes if sizes[-1] == max_batch else sizes + [max_batch]
    top, b = max_batch + mixed_tokens, max_batch
    while b < top:
        b += MIXED_BUCKET_STEP if b < max_batch + 512 else 4 * MIXED_BUCKET_STEP
        sizes.append(b)
    return sizes


class ModelRunner:
    """Owns the model on its device, the KV pool and the CUDA graphs."""

    def __init__(self, model: LlamaForCausalLM, config: EngineConfig, max_model_len: int) -> None:
        self.config = config
        self.device = torch.device(config.resolved_device())
        self.dtype = config.resolved_dtype()
        self.kv_dtype = config.resolved_kv_cache_dtype()  # the pools' dtype: the model's, or fp8 e4m3
        self.kv_fp8 = self.kv_dtype == torch.float8_e4m3fn
        self.model_config: ModelConfig = model.config
        self.model = model.to(device=self.device, dtype=self.dtype).eval()
        # RoPE frequencies stay fp32: bf16 would put angles off by radians at positions in the thousands
        self.model.rotary.inv_freq = rope_inv_freq(model.config).to(self.device)
        if self.is_cuda:  # fused QKV / gate-up weights and Triton norm/RoPE/SwiGLU kernels (engine.fused)
            kernels.set_pdl(config.cuda_pdl)  # before any launch or graph capture of this runner
            int4 = config.weight_group_size if config.cuda_weight_format == "int4" else None
            self.model = fuse_for_cuda(self.model, int4_group=int4, gemv_prologues=config.cuda_gemv_prologues,
                                       fused_rope_store=config.cuda_fused_rope_store,
                                       fused_layers=config.cuda_fused_decode_layers,
                                       fp8=config.cuda_weight_format == "fp8")
        elif config.cpu_packed_weights:  # oneDNN-packed linears: no per-call weight re-pack (engine.cpu_linear)
            pack_linears(self.model, one_row_copies=config.cpu_one_row_weights,
                         native=config.cpu_native_gemv and native_kernels.available())
        if not self.is_cuda and config.cpu_fused_projections:  # one q/k/v and one gate/up product per layer
            fuse_projections(self.model)
        # batch-1 decode steps: every layer in one native call (engine.cpu_decode, fp32 pools); None: unfused
        self.fused_decode = (cpu_decode.build(self.model, max_model_len)
                             if not self.is_cuda and config.cpu_fused_decode and not self.kv_fp8 else None)
        # the CPU attention path (engine.cpu_attention) reads fp32 pools; fp8 ones take the kernels' references
        self.cpu_attention = not self.is_cuda and not self.kv_fp8
        # fp8 pools: per-(layer, KV head) K and V scales, fixed by a calibration prefill in init_kv_cache
        self.kv_scales: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = -(-max_model_len // self.block_size)
        self.kv: PagedKVCache | None = None
        # (bucket, drafts k) -> graph and its logits [bucket * (k + 1), V] (k = 0: decode batches)
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._verify_cu: dict[int, torch.Tensor] = {}  # k -> constant cu_seqlens of the verify graphs
        # bucket -> decode graph with one-pass attention (no split-K reduce), for contexts <= _one_pass_tokens
        self._one_pass: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # the overlapped loop: the last launched step's greedy tokens on the device (row i: its i-th sampling
        # sequence), which the next launch gathers its placeholder inputs from; pinned read-back buffers, two
        # so that a step's copy never overwrites the one the host has not read yet
        self._sampled: torch.Tensor | None = None
        self._host_tokens: list[torch.Tensor] = []
        self._launches = 0
        bs = self.block_size
        self._one_pass_tokens = min(config.cuda_one_pass_decode_tokens, self.max_blocks_per_seq * bs) // bs * bs
        # decode graphs: the largest batch captured, the prompt tokens a graphed step may carry, the row buckets
        self._graph_max_batch = min(config.cuda_graph_max_batch, config.max_num_seqs)
        self._mixed_tokens = config.cuda_graph_mixed_tokens
        self._decode_buckets = graph_buckets(self._graph_max_batch, self._mixed_tokens)
        self.graph_steps = 0  # steps that replayed a CUDA graph (EngineStats.graph_steps_total)

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    # ---- KV pool ----------------------------------------------------------------------------------
    def init_kv_cache(self) -> int:
        """Size (after a warm-up pass on GPU) and allocate the KV pool; return its number of blocks."""
        cfg = self.config
        if self.kv_fp8:
            tokens = min(self.max_model_len, cfg.max_num_batched_tokens, CALIBRATION_TOKENS)
            self.kv_scales = calibrate_kv_scales(self.model, tokens)
        if cfg.num_kv_blocks is not None:
            num_blocks = cfg.num_kv_blocks
        elif self.is_cuda:
            self._warm_up()
            num_blocks = blocks_for_gpu(self.model_config, self.block_size, self.kv_dtype, self.device,
                                        cfg.gpu_memory_utilization)
        else:
            num_blocks = blocks_for_budget(self.model_config, self.block_size, self.kv_dtype, cfg.kv_cache_bytes)
        if num_blocks < 2:
            raise MemoryError(f"no room for a KV cache: {num_blocks} blocks fit")
        self.kv = self._pool(num_blocks)
        if self.fused_decode is not None:
            self.fused_decode.bind(self.kv)
        if self.is_cuda and cfg.cuda_graphs:
            self._capture_graphs(self._graph_max_batch)
        self._alloc_sampled()
        return num_blocks

    def _alloc_sampled(self) -> None:
        n = self.config.max_num_seqs
        if hasattr(self, "_decode_in"):  # inside the decode graphs' buffer: one gather feeds a graph's ids
            self._sampled = self._decode_in.dev64[_StaticInputs.SAMPLED, :n]
        else:
            self._sampled = torch.zeros(n, dtype=torch.int64, device=self.device)
        if self.is_cuda:  # two of each, used in turn: a launch's are free again once the launch before it resolved
            self._host_tokens = [torch.zeros(n, dtype=torch.int64, pin_memory=True) for _ in range(2)]
            self._events = [torch.cuda.Event() for _ in range(2)]  # created once: not one cudaEventCreate a step

    def _pool(self, num_blocks: int) -> PagedKVCache:
        return PagedKVCache(self.model_config, num_blocks, self.block_size, self.kv_dtype, self.device,
                            self.kv_scales)

    @torch.inference_mode()
    def _warm_up(self) -> None:
        """A forward of a full token budget on a scratch pool, so the peak activation memory is known."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        t = self.config.max_num_batched_tokens
        seq_len = min(t, self.max_model_len)
        nseq = -(-t // seq_len)
        per_seq = -(-seq_len // self.block_size)
        scratch = self._pool(nseq * per_seq)
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
    def prepare(self, sched: SchedulerOutput, feed: LaunchedStep | None = None) -> StepInputs:
        """Build the flat batch: single-token decodes first, then multi-token queries (varlen); decodes whose
        input is a placeholder take the token ``feed`` (the step launched before) sampled on the device."""
        decodes, prefills = [], []
        for s in sched.scheduled:
            (decodes if s.num_tokens == 1 and not s.draft_token_ids else prefills).append(s)
        # decodes: one query token each (the hot path of large batches: comprehensions, no properties)
        bs, seqs, pos = self.block_size, [s.seq for s in decodes], [s.start for s in decodes]
        ids = [q.token_ids[p] for q, p in zip(seqs, pos, strict=True)]
        d_tables = [q.block_table for q in seqs]
        slots = [t[p // bs] * bs + p % bs for t, p in zip(d_tables, pos, strict=True)]
        rows = [i for i, (q, p) in enumerate(zip(seqs, pos, strict=True)) if p + 1 == len(q.token_ids)]  # samples
        sampling = [decodes[i] for i in rows]
        d_lens = [p + 1 for p in pos]
        for s in prefills:
            ids += s.query_token_ids()
            pos += range(s.start, s.start + s.num_query_tokens)
            slots += self._slots(s)
            if s.num_logits_rows:
                rows += range(len(ids) - s.num_logits_rows, len(ids))
                sampling.append(s)
        meta = self._meta(
            slots, len(decodes), d_tables, d_lens,
            [s.seq.block_table for s in prefills], [0] + _cumsum([s.num_query_tokens for s in prefills]),
            [s.start + s.num_query_tokens for s in prefills])
        input_ids = self._t(ids)
        pending = [(i, feed.rows[s.seq.seq_id]) for i, s in enumerate(decodes) if ids[i] < 0] if feed else []
        if pending:
            dst, src = self._t([i for i, _ in pending]), self._t([j for _, j in pending])
            input_ids.index_copy_(0, dst, self._sampled.index_select(0, src))
        assert feed is not None or not ids or min(ids) >= 0, "placeholder input without the step that samples it"
        return StepInputs(input_ids, self._t(pos), meta, self._t(rows), sampling)

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
        out = np.zeros((len(tables), max(map(len, tables))), np.int32)
        for i, t in enumerate(tables):  # a row at a time through numpy: ~2x torch.tensor of padded lists
            out[i, :len(t)] = t
        return self._on_device(torch.from_numpy(out))

    def _t(self, data: list[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
        # through numpy: torch.tensor of a Python list costs ~5x more (~50 vs ~9 µs for 400 ints)
        return self._on_device(torch.from_numpy(np.array(data, _NUMPY[dtype])))

    def _on_device(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device, non_blocking=True) if self.is_cuda else t

    # ---- execution --------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, *, eager: bool = False) -> tuple[torch.Tensor, list[ScheduledSeq]]:
        """Run the step; return logits [R, V] (fp32) of the sampling rows and their sequences.

        A step of decodes only (each with at most ``k`` drafts) replays a captured CUDA graph when one fits;
        ``eager=True`` runs it eagerly all the same (tests and benchmarks compare the two).
        """
        assert self.kv is not None, "init_kv_cache() first"
        self.kv.copy_blocks(sched.copies)
        key = None if eager else self._graph_for(sched.scheduled)
        if key is not None:
            return self._run_graph(sched.scheduled, *key)[:2]
        if self.fused_decode is not None and len(sched.scheduled) == 1 and sched.scheduled[0].num_query_tokens == 1:
            return self._run_fused_decode(sched.scheduled[0])
        inputs = self.prepare(sched)
        backend = PagedAttention(self.kv, inputs.meta, self.model_config.head_dim, cpu_decode=self.cpu_attention)
        h = self.model(inputs.input_ids, inputs.positions, backend)       # [T, hidden]
        return self.model.logits(h[inputs.logits_rows]), inputs.sampling  # [R, V]

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput, prev: LaunchedStep | None) -> LaunchedStep:
        """Run a step of plain greedy sequences (one logits row each) without waiting for it: its argmax stays
        on the device (where the next launch feeds placeholders from) and is copied to pinned memory behind
        the step. ``prev``: the step launched before, whose tokens this one's placeholders stand for."""
        assert self.kv is not None, "init_kv_cache() first"
        self.kv.copy_blocks(sched.copies)
        key = self._graph_for(sched.scheduled)
        greedy = False  # whether the step's greedy tokens are already in _sampled (a decode graph took them)
        if key is not None and key[1] == 0:
            logits, sampling, greedy = self._run_graph(sched.scheduled, key[0], 0, prev)
        else:
            inputs = self.prepare(sched, prev)
            backend = PagedAttention(self.kv, inputs.meta, self.model_config.head_dim, cpu_decode=self.cpu_attention)
            h = self.model(inputs.input_ids, inputs.positions, backend)      # [T, hidden]
            logits, sampling = self.model.logits(h[inputs.logits_rows]), inputs.sampling
        n = len(sampling)
        assert logits.shape[0] == n, "overlapped steps sample one row per sequence"
        sampled = self._sampled[:n]
        if n and not greedy:
            torch.argmax(logits, -1, out=sampled)                             # [n] int64
        if not self.is_cuda:
            return LaunchedStep(sampling, sampled.clone(), None)
        turn = self._launches % 2
        self._launches += 1
        host = self._host_tokens[turn][:n]
        host.copy_(sampled, non_blocking=True)
        event = self._events[turn]
        event.record()
        return LaunchedStep(sampling, host, event)

    def _run_fused_decode(self, s: ScheduledSeq) -> tuple[torch.Tensor, list[ScheduledSeq]]:
        """A step of one single-token query through the fused native step (engine.cpu_decode)."""
        token, pos = s.seq.token_ids[s.start], s.start
        if not s.num_logits_rows:  # a one-token prefill chunk that does not sample: store its K/V only
            self.fused_decode.hidden(token, pos, s.seq.block_table)
            return torch.empty(0, self.model_config.vocab_size), []
        return self.fused_decode.logits(token, pos, s.seq.block_table), [s]

    # ---- CUDA graphs ------------------------------------------------------------------------------
    # Graphs are keyed (bucket b, drafts k). k = 0: a decode batch, b rows, through the decode kernel.
    # k > 0: a verify batch, b sequences x (k + 1) query rows each (sequence i owns rows [i(k+1), (i+1)(k+1)),
    # its last token, its drafts, then padding rows), through the varlen kernel with constant cu_seqlens;
    # a sequence with fewer drafts (a plain decode: none) pads its own rows, which sit after its real ones
    # and so are causally invisible to them. Padding rows and sequences have slot -1 (nothing stored).
    def _graph_for(self, scheduled: list[ScheduledSeq]) -> tuple[int, int] | None:
        """The captured (bucket, k) of fewest rows that runs this step; None: run it eagerly."""
        if not self._graphs:
            return None
        if any(s.num_tokens != 1 for s in scheduled):
            b = self._mixed_bucket(scheduled)
            return None if b is None else (b, 0)
        n, drafts = len(scheduled), max(len(s.draft_token_ids) for s in scheduled)
        fits = [(b * (k + 1), b, k) for b, k in self._graphs if b >= n and (k >= drafts > 0 or k == drafts == 0)]
        if not fits:
            if drafts:
                log.debug("no verify graph for %d sequences with up to %d drafts: eager", n, drafts)
            return None
        _, b, k = min(fits)
        return b, k

    def _mixed_bucket(self, scheduled: list[ScheduledSeq]) -> int | None:
        """The decode bucket that runs a step mixing prompt chunks into its decodes, every query token a decode
        row of its own (its context: its sequence up to itself, the chunk's K/V stored before any row attends),
        or None (the step runs eagerly): at most ``_graph_max_batch`` sequences, no drafts, at most
        ``_mixed_tokens`` prompt tokens reading ``MIXED_MEAN_CONTEXT`` context tokens each on average."""
        if not self._mixed_tokens or len(scheduled) > self._graph_max_batch:
            return None
        rows = prompt = reads = 0
        for s in scheduled:
            n = s.num_tokens
            if s.draft_token_ids:
                return None
            rows += n
            if n > 1:
                prompt += n
                reads += n * s.start + n * (n + 1) // 2  # rows at contexts start + 1 .. start + n
        if prompt > self._mixed_tokens or reads > prompt * MIXED_MEAN_CONTEXT:
            return None
        return self._decode_buckets[bisect.bisect_left(self._decode_buckets, rows)]

    @torch.inference_mode()
    def _capture_graphs(self, max_batch: int) -> None:
        """Capture decode steps for every bucket, then verify steps for every (bucket, k) the config names
        (buckets up to the batch that still speculates), largest first, all sharing one memory pool."""
        cap = self.config.speculative_disable_by_batch_size
        vmax = min(max_batch, cap) if cap is not None else max_batch
        ks = self._static_inputs(max_batch, vmax)
        pool = None
        try:
            for b in reversed(graph_buckets(max_batch, self._mixed_tokens)):
                pool = self._capture(b, 0, pool)
            if self._one_pass_tokens:
                for b in reversed([b for b in graph_buckets(max_batch) if b <= ONE_PASS_MAX_BATCH]):
                    pool = self._capture(b, 0, pool, one_pass=True)
            for k in reversed(ks):
                for b in reversed(graph_buckets(vmax)):
                    pool = self._capture(b, k, pool)
        except RuntimeError as exc:  # a kernel that syncs with the host cannot be captured
            log.warning("CUDA graph capture failed, decoding eagerly: %s", exc)
            self._graphs.clear()
            self._one_pass.clear()

    def _static_inputs(self, max_batch: int, verify_max_batch: int) -> tuple[int, ...]:
        """Allocate the graphs' input buffers (decode batches up to ``max_batch``, verify batches up to
        ``verify_max_batch``); return the verify graphs' draft counts."""
        dev, ks = self.device, self.config.verify_graph_tokens()
        # rows for every running sequence (row SAMPLED also holds an eager step's tokens: overlapped loop) and
        # for the largest bucket (prompt tokens as rows: a table each)
        top = graph_buckets(max_batch, self._mixed_tokens)[-1]
        self._decode_in = _StaticInputs(max(top, self.config.max_num_seqs), top, self.max_blocks_per_seq, dev)
        if not ks:
            return ks
        rows = verify_max_batch * (ks[-1] + 1)
        # padding rows sit up to k positions past a sequence's end: widen the tables so that the kernel never
        # clamps a context (which would shift the real rows' positions)
        width = -(-(self.max_model_len + ks[-1]) // self.block_size)
        self._verify_in = _StaticInputs(rows, verify_max_batch, width, dev)
        self._verify_logits = torch.empty(rows, self.model_config.vocab_size, dtype=torch.float32,
                                          device=dev)  # shared by every k
        for k in ks:  # constant row offsets: sequence i's query is rows [i * (k + 1), (i + 1) * (k + 1))
            self._verify_cu[k] = torch.arange(0, (verify_max_batch + 1) * (k + 1), k + 1, dtype=torch.int32,
                                              device=dev)
        return ks

    def _static_step(self, b: int, k: int, one_pass: bool = False) -> tuple[torch.Tensor, torch.Tensor,
                                                                             PagedAttention]:
        """The (b, k) step over the static buffers: input ids [b(k+1)], positions, attention backend;
        ``one_pass``: a decode step whose tables stop at ``_one_pass_tokens``, attended in one partition."""
        q, inp = k + 1, self._verify_in if k else self._decode_in
        ids, pos, slots = (inp.dev64[r, :b * q] for r in (_StaticInputs.IDS, _StaticInputs.POS, _StaticInputs.SLOTS))
        if k == 0 and one_pass:
            tokens = self._one_pass_tokens
            meta = AttentionMetadata(slots, b, inp.tables[:b, :tokens // self.block_size], inp.lens[:b],
                                     decode_partition=tokens)
        elif k == 0:
            meta = AttentionMetadata(slots, b, inp.tables[:b], inp.lens[:b])
        else:
            meta = AttentionMetadata(slots, 0, prefill_block_tables=inp.tables[:b],
                                     prefill_cu_seqlens_q=self._verify_cu[k][:b + 1],
                                     prefill_context_lens=inp.lens[:b], prefill_max_q=q)
        return ids, pos, PagedAttention(self.kv, meta, self.model_config.head_dim)

    def _capture(self, b: int, k: int, pool, one_pass: bool = False):
        """Capture the (b, k) step (``one_pass``: its one-pass-attention twin); return the memory pool."""
        inp = self._verify_in if k else self._decode_in
        ids, pos, backend = self._static_step(b, k, one_pass)
        backend.meta.slot_mapping.fill_(-1)
        inp.lens.fill_(k + 1)  # every sequence a padding one: k + 1 rows over k + 1 (harmless) slots of block 0
        self._static_forward(ids, pos, backend, b, k)  # warm up (Triton JIT)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = self._static_forward(ids, pos, backend, b, k)
            if k:  # verify graphs write one shared buffer: its size does not grow with buckets and ks
                out = self._verify_logits[:out.shape[0]].copy_(out)
        if one_pass:
            self._one_pass[b] = (graph, out)
        else:
            self._graphs[(b, k)] = (graph, out)
        return graph.pool()

    def _static_forward(self, ids: torch.Tensor, pos: torch.Tensor, backend: PagedAttention, b: int,
                        k: int) -> torch.Tensor:
        """What the (b, k) graph runs: logits [b * (k + 1), V]; a bucket above ``_graph_max_batch`` (prompt
        tokens as rows, every sampling row among the first ones: :meth:`_fill_chunks`) only the first
        ``_graph_max_batch`` rows'. A decode graph (k = 0) first gathers its ids (:meth:`_fill_gather`), and up
        to GREEDY_GRAPH_MAX_BATCH rows ends with its rows' greedy tokens in row SAMPLED (what the overlapped loop
        reads: :meth:`launch`)."""
        inp = self._decode_in  # (decode graphs' buffers: verify graphs' ids are the host's, uploaded)
        if not k:  # the ids: the host's, or for placeholders the tokens the last launch sampled (row SAMPLED)
            src = inp.dev64[:_StaticInputs.HOST_IDS + 1].view(-1)  # rows SAMPLED, HOST_IDS side by side
            torch.index_select(src, 0, inp.dev64[_StaticInputs.GATHER, :b], out=ids)
        h = self.model(ids, pos, backend)
        logits = self.model.logits(h if k or b <= self._graph_max_batch else h[:self._graph_max_batch])
        if not k and b <= GREEDY_GRAPH_MAX_BATCH:
            torch.argmax(logits, -1, out=inp.dev64[_StaticInputs.SAMPLED, :b])
        return logits

    def decode_graph(self, b: int, max_context: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """The captured decode graph (and its logits) for bucket ``b`` when the longest context is
        ``max_context`` tokens: the one-pass twin where the context fits it."""
        if b in self._one_pass and max_context <= self._one_pass_tokens:
            return self._one_pass[b]
        return self._graphs[(b, 0)]

    def _run_graph(self, scheduled: list[ScheduledSeq], b: int, k: int, feed: LaunchedStep | None = None
                   ) -> tuple[torch.Tensor, list[ScheduledSeq], bool]:
        """A decode, mixed or verify step through the captured (b, k) graph (``feed``: see :meth:`launch`);
        returns the sampling rows' logits, their sequences, and whether the graph also left their greedy tokens
        in ``_sampled`` in the same order (decode graphs up to GREEDY_GRAPH_MAX_BATCH rows whose sampling rows
        are the first ones)."""
        rows, sampling = self._stage(scheduled, b, k, feed)
        self.graph_steps += 1
        if k:
            graph, out = self._graphs[(b, k)]
        else:
            graph, out = self.decode_graph(b, max(s.start + s.num_tokens for s in scheduled))
        graph.replay()
        if not sampling and self.is_cuda:  # no token is read back this step: sync so the pinned mirrors can be refilled
            torch.cuda.current_stream(self.device).synchronize()
        return out[rows], sampling, not k and b <= GREEDY_GRAPH_MAX_BATCH and isinstance(rows, slice)

    def _stage(self, scheduled: list[ScheduledSeq], b: int, k: int,
               feed: LaunchedStep | None = None) -> tuple[slice | torch.Tensor, list[ScheduledSeq]]:
        """Fill the (b, k) step's static buffers for ``scheduled``; return the logits rows that sample (a
        slice when they are the first ones, else a device index) and their sequences in row order. A decode
        graph gathers its input ids on the device (:meth:`_fill_gather`): placeholders from the tokens ``feed``
        (the step launched before) sampled, the others from the host."""
        q = k + 1
        inp = self._verify_in if k else self._decode_in
        if k:
            rows, n = self._fill_verify(inp, scheduled, q), len(scheduled)
            sampling = [s for s in scheduled if s.samples]
        else:
            chunks = [s for s in scheduled if s.num_tokens != 1]
            decodes = [s for s in scheduled if s.num_tokens == 1] if chunks else scheduled
            rows = self._fill_decode(inp, decodes)
            sampling = list(decodes) if len(rows) == len(decodes) else [decodes[i] for i in rows]
            n = self._fill_chunks(inp, chunks, len(decodes), rows, sampling) if chunks else len(decodes)
            self._fill_gather(inp, decodes, n, b, feed)
        inp.host64[_StaticInputs.SLOTS, n * q:b * q] = -1  # padding sequences write nothing, read q slots of block 0
        inp.host_lens[n:b] = q
        whole = not rows or rows[-1] == len(rows) - 1  # rows ascend: then they are the first len(rows)
        if not whole:
            inp.host64[_StaticInputs.ROWS, :len(rows)] = rows
        inp.upload(b)
        return (slice(0, len(rows)) if whole else inp.dev64[_StaticInputs.ROWS, :len(rows)]), sampling

    def _fill_gather(self, inp: _StaticInputs, decodes: list[ScheduledSeq], n: int, b: int,
                     feed: LaunchedStep | None) -> None:
        """Gather indices into dev64's rows SAMPLED and HOST_IDS side by side (rows of width W), which a decode
        graph reads into row IDS first: row i reads its host id (W + i), or, for a placeholder among the
        ``decodes``' rows (they come first), the token ``feed`` (the step launched before) sampled for that
        sequence (its row there); rows ``n``.. pad with id 0."""
        h64, width = inp.host64, inp.dev64.shape[1]
        h64[_StaticInputs.GATHER, :b] = inp.arange[:b] + width
        h64[_StaticInputs.HOST_IDS, n:b] = 0  # padding rows: any valid id
        if feed is None:  # a synchronous step: every placeholder was resolved before it (LLMEngine._step)
            return
        placeholders = np.flatnonzero(h64[_StaticInputs.HOST_IDS, :len(decodes)] < 0)
        rows = feed.rows
        h64[_StaticInputs.GATHER, placeholders] = [rows[decodes[i].seq.seq_id] for i in placeholders.tolist()]

    def _fill_decode(self, inp: _StaticInputs, scheduled: list[ScheduledSeq]) -> list[int]:
        """Host inputs of a decode batch (one row per sequence; the hot path of large batches: scalar
        writes only; the ids into row HOST_IDS); return the rows that sample."""
        h64, lens, tables, bs = inp.host64, inp.host_lens, inp.host_tables, self.block_size
        ids_row, pos_row, slots_row = _StaticInputs.HOST_IDS, _StaticInputs.POS, _StaticInputs.SLOTS
        rows = []
        for i, s in enumerate(scheduled):
            seq, p = s.seq, s.start
            table, ids = seq.block_table, seq.token_ids
            h64[ids_row, i], h64[pos_row, i] = ids[p], p
            h64[slots_row, i] = table[p // bs] * bs + p % bs
            lens[i] = p + 1
            tables[i, :len(table)] = table
            if p + 1 == len(ids):  # s.samples, inlined (the hot loop)
                rows.append(i)
        return rows

    def _fill_chunks(self, inp: _StaticInputs, chunks: list[ScheduledSeq], r: int, rows: list[int],
                     sampling: list[ScheduledSeq]) -> int:
        """Prompt chunks as decode rows after the ``r`` decode rows: first the last token of each chunk that
        samples (so every sampling row lies among a mixed bucket's first ``_graph_max_batch``, whose logits the
        graph computes), then the chunks' other tokens; each row attends to its sequence up to itself. Appends
        the sampling rows and sequences; returns the rows filled in all."""
        h64, lens, tables, bs = inp.host64, inp.host_lens, inp.host_tables, self.block_size
        rest = r + sum(1 for s in chunks if s.samples)
        for s in chunks:
            n, p = s.num_tokens, s.start
            if s.samples:
                dest = np.arange(rest, rest + n)  # the others from ``rest``, the last at row r
                dest[-1] = r
                rows.append(r)
                sampling.append(s)
                r += 1
                rest += n - 1
            else:
                dest = np.arange(rest, rest + n)
                rest += n
            pos = np.arange(p, p + n)
            table = np.array(s.seq.block_table, np.int64)
            h64[_StaticInputs.HOST_IDS, dest] = s.seq.token_ids[p:p + n]
            h64[_StaticInputs.POS, dest] = pos
            h64[_StaticInputs.SLOTS, dest] = table[pos // bs] * bs + pos % bs
            lens[dest] = pos + 1
            tables[dest, :len(table)] = table
        return rest

    def _fill_verify(self, inp: _StaticInputs, scheduled: list[ScheduledSeq], q: int) -> list[int]:
        """Host inputs of a verify batch (sequence i: rows [i * q, (i + 1) * q), real rows first); return the
        rows that sample."""
        h64, bs, rows = inp.host64, self.block_size, []
        for i, s in enumerate(scheduled):
            table, p, r, n = s.seq.block_table, s.start, i * q, s.num_query_tokens
            h64[_StaticInputs.IDS, r:r + n] = s.query_token_ids()
            h64[_StaticInputs.POS, r:r + q] = range(p, p + q)  # positions run on through the padding rows
            h64[_StaticInputs.SLOTS, r:r + q] = [table[x // bs] * bs + x % bs for x in range(p, p + n)] + [-1] * (q - n)
            inp.host_lens[i] = p + q
            inp.host_tables[i, :len(table)] = table
            rows += range(r, r + s.num_logits_rows)
        return rows


class _StaticInputs:
    """The device buffers a family of CUDA graphs reads, and pinned host mirrors that fill them with one
    copy per step (under gVisor every CUDA call costs ~0.1 ms, so a step makes as few as possible).

    One byte buffer: dev64 [7, rows], then dev32 [S + S * W].
    dev64 rows: SAMPLED, the last launched step's greedy tokens (written on the device by the step's argmax, or
    by the decode graph itself up to GREEDY_GRAPH_MAX_BATCH rows; never uploaded); HOST_IDS, the host's ids;
    GATHER, the index that builds row IDS from rows SAMPLED and HOST_IDS side by side (a decode graph's first
    op); IDS, POS, SLOTS: the graph's input ids, positions and slots; ROWS: the logits rows a step samples (read
    after the replay). dev32: context lengths [S], block tables [S, W] (entries past a table hold block ids of
    earlier steps: in range, and read by padding rows only). Everything past row SAMPLED up to the first ``b``
    tables is one contiguous range: one upload a step.
    The host mirrors come in two sets used in turn: under the overlapped loop the host fills step n + 1's
    while step n's upload may still be queued behind step n - 1.
    """

    SAMPLED, HOST_IDS, GATHER, IDS, POS, SLOTS, ROWS = range(7)

    def __init__(self, rows: int, seqs: int, width: int, device: torch.device) -> None:
        self.seqs, self.width = seqs, width
        self._b64 = (self.ROWS + 1) * rows * 8      # dev64's bytes (a multiple of 8: dev32 starts aligned)
        nbytes = self._b64 + seqs * (1 + width) * 4
        self._dev = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self.dev64, self.dev32 = self._views(self._dev, rows)
        self.lens, self.tables = self.dev32[:seqs], self.dev32[seqs:].view(seqs, width)
        pin = device.type == "cuda"  # (the CPU builds them only in tests of the layout)
        self._sets = []
        for _ in range(2):  # each set: the pinned bytes and the numpy views the host fills
            buf = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=pin)
            h64, h32 = self._views(buf, rows)
            self._sets.append((buf, h64.numpy(), h32[:seqs].numpy(), h32[seqs:].view(seqs, width).numpy()))
        self.arange = torch.arange(rows).numpy()
        self._turn = 0
        self._use(0)

    def _views(self, buf: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        return buf[:self._b64].view(torch.int64).view(self.ROWS + 1, rows), buf[self._b64:].view(torch.int32)

    def _use(self, turn: int) -> None:
        self._pinned, self.host64, self.host_lens, self.host_tables = self._sets[turn]

    def upload(self, b: int) -> None:
        """Copy the host mirrors to the device in one copy (the rows after SAMPLED, the lengths and the first
        ``b`` tables); the next step fills the other set."""
        lo, hi = self.dev64.shape[1] * 8, self._b64 + (self.seqs + b * self.width) * 4
        self._dev[lo:hi].copy_(self._pinned[lo:hi], non_blocking=True)
        self._turn ^= 1
        self._use(self._turn)


_NUMPY = {torch.int64: np.int64, torch.int32: np.int32}


def _cumsum(xs: list[int]) -> list[int]:
    out, total = [], 0
    for x in xs:
        total += x
        out.append(total)
    return out
