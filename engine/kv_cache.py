"""The paged KV pool and the attention backend that reads and writes it.

Per layer, K and V each live in one tensor ``[num_blocks, block_size, num_kv_heads, head_dim]``; a
sequence's tokens are scattered over blocks through its block table (see ``engine.block_manager``).
The pool is sized from what is left of the device after a warm-up pass (GPU: a fraction of total
memory minus the warm-up's peak) or from a byte budget (CPU).

:class:`PagedAttention` is the :class:`engine.model.AttentionBackend` of one forward pass over a flat
batch: rows ``[0, num_decode)`` are single-token decodes (one sequence each), the rest are prefill chunks
described by ``cu_seqlens_q``. On GPU it stores the step's K/V with ``kernels.store_kv`` and attends
with ``kernels.paged_decode_attention`` / ``kernels.paged_prefill_attention`` (Triton); the engine's
CPU path is :mod:`engine.cpu_attention`.

FP8 pools (``EngineConfig.kv_cache_dtype = "fp8_e4m3"``) hold ``torch.float8_e4m3fn`` values and one fp32
scale per (layer, KV head) for K and one for V, fixed at load by :func:`calibrate_kv_scales`; the kernels
quantize on store and dequantize in the attention kernels.
"""

from __future__ import annotations

import dataclasses
import math

import torch

import kernels
from engine import cpu_attention
from engine.config import ModelConfig
from engine.model import causal_attention

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_KV_DTYPE).max)  # 448
# a calibrated head's scale leaves room for values this many times the calibration's amax before the store
# saturates; e4m3 is floating point, so the headroom costs precision only below amax * 8 / 448 / 2^6
# (= amax / 3584, subnormal), which is noise in a dot product
KV_SCALE_HEADROOM = 8.0
CALIBRATION_TOKENS = 256  # length of the calibration prefill (seeded random ids: no tenant's data)


class PagedKVCache:
    """K and V block pools for every layer (and, for fp8 pools, their per-KV-head scales).

    Attributes:
        k, v: per layer [num_blocks, block_size, Hkv, D] of the pool dtype.
        k_scale, v_scale: per layer [Hkv] fp32 scales (value = stored * scale) for fp8 pools, else None.
    """

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str,
                 scales: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None) -> None:
        shape = (num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        layers = cfg.num_hidden_layers
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.num_blocks = num_blocks
        self.block_size = block_size
        if (dtype == FP8_KV_DTYPE) != (scales is not None):
            raise ValueError(f"a {dtype} pool takes {'per-head scales' if dtype == FP8_KV_DTYPE else 'no scales'}")
        none: list[torch.Tensor | None] = [None] * layers
        self.k_scale = none if scales is None else [s.to(device, torch.float32).contiguous() for s in scales[0]]
        self.v_scale = none if scales is None else [s.to(device, torch.float32).contiguous() for s in scales[1]]

    @property
    def quantized(self) -> bool:
        """Whether the pools hold fp8 values."""
        return self.k[0].dtype == FP8_KV_DTYPE

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        """Bytes of one block across all layers, K and V."""
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * cfg.head_dim * elem

    @property
    def nbytes(self) -> int:
        """Resident bytes of the pools (the fp8 pools' scales are a few hundred bytes more)."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: block dst := block src in every layer."""
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.k[0].device)
        dst = torch.tensor([d for _, d in copies], device=self.k[0].device)
        for pool in self.k + self.v:
            pool = pool.view(torch.uint8) if self.quantized else pool  # index kernels take no float8
            pool[dst] = pool[src]


def blocks_for_budget(cfg: ModelConfig, block_size: int, dtype: torch.dtype, budget_bytes: int) -> int:
    """Blocks that fit a byte budget."""
    return max(0, budget_bytes // PagedKVCache.bytes_per_block(cfg, block_size, dtype))


def blocks_for_gpu(cfg: ModelConfig, block_size: int, dtype: torch.dtype, device: torch.device,
                   utilization: float) -> int:
    """Blocks that fit in ``utilization * total`` minus this process's peak since the warm-up began (which
    includes everything it already holds) minus what other processes use."""
    free, total = torch.cuda.mem_get_info(device)
    peak = torch.cuda.max_memory_allocated(device)
    used_by_others = total - free - torch.cuda.memory_reserved(device)
    budget = int(total * utilization) - peak - max(0, used_by_others)
    return blocks_for_budget(cfg, block_size, dtype, budget)


class KVAmaxRecorder:
    """AttentionBackend of a one-sequence prefill (dense causal attention) that records, per layer, the
    largest |K| (after RoPE) and |V| of every KV head."""

    def __init__(self, num_layers: int) -> None:
        self.k_amax: list[torch.Tensor | None] = [None] * num_layers
        self.v_amax: list[torch.Tensor | None] = [None] * num_layers

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] of one sequence from position 0 -> [T, Hq, D]."""
        self.k_amax[layer] = k.detach().abs().amax(dim=(0, 2)).float()  # [Hkv]
        self.v_amax[layer] = v.detach().abs().amax(dim=(0, 2)).float()
        return causal_attention(q, k, v, 0)


@torch.inference_mode()
def calibrate_kv_scales(model, num_tokens: int = CALIBRATION_TOKENS, seed: int = 0,
                        headroom: float = KV_SCALE_HEADROOM) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Static per-(layer, KV head) fp8 scales for K and V: one prefill of ``num_tokens`` seeded random ids
    (the BOS id first where the config has one), scale = ``headroom`` * amax / 448.

    The scales depend on the model and the seed only, never on a request, so one tenant's prompt cannot
    change how another tenant's K/V are rounded. Returns (k_scales, v_scales), per layer [Hkv] fp32.
    """
    cfg = model.config
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (num_tokens,), generator=gen)
    if cfg.bos_token_id is not None:
        ids[0] = cfg.bos_token_id
    rec = KVAmaxRecorder(cfg.num_hidden_layers)
    model(ids.to(device), torch.arange(num_tokens, device=device), rec)
    tiny = torch.finfo(torch.float32).tiny  # a head that is all zeros still gets a usable scale

    def scale(amax: torch.Tensor | None) -> torch.Tensor:
        assert amax is not None, "the calibration forward skipped a layer"
        return (amax.clamp_min(tiny) * (headroom / FP8_MAX)).float()

    return [scale(a) for a in rec.k_amax], [scale(a) for a in rec.v_amax]


@dataclasses.dataclass
class AttentionMetadata:
    """Where this step's tokens go and what they attend to (all tensors on the model's device).

    Attributes:
        slot_mapping: [T] int64 flat slot of every token (-1: padding).
        num_decode: rows [0, num_decode) are decodes of one token each.
        decode_block_tables: [num_decode, max_blocks] int32.
        decode_context_lens: [num_decode] int32 (tokens incl. the new one).
        prefill_block_tables: [P, max_blocks] int32 for the prefill sequences.
        prefill_cu_seqlens_q: [P + 1] int32 row offsets of the prefill chunks (from 0 at row num_decode).
        prefill_context_lens: [P] int32.
        prefill_max_q: longest prefill chunk (known on the host: no device sync in the launcher).
        decode_partition: split-K partition of the decode attention in tokens (None: the kernel plans
            one); the runner's one-pass graphs set it to their table width, so no reduce kernel runs.
    """

    slot_mapping: torch.Tensor
    num_decode: int
    decode_block_tables: torch.Tensor | None = None
    decode_context_lens: torch.Tensor | None = None
    prefill_block_tables: torch.Tensor | None = None
    prefill_cu_seqlens_q: torch.Tensor | None = None
    prefill_context_lens: torch.Tensor | None = None
    prefill_max_q: int = 0
    decode_partition: int | None = None


class PagedAttention:
    """AttentionBackend over a :class:`PagedKVCache` for one forward pass.

    ``cpu_decode=True`` (the engine's choice on CPU) is the CPU path of :mod:`engine.cpu_attention`: it
    stores with one ``index_copy_``, builds the step's gather indices and masks once (on the first
    layer) and reuses them in every layer, decodes with grouped ``bmm`` attention and prefills with
    SDPA. Otherwise the ``kernels`` launchers run (Triton on GPU, their torch reference elsewhere): so do
    fp8 pools on the CPU (the CPU path reads fp32 pools only).
    """

    def __init__(self, cache: PagedKVCache, meta: AttentionMetadata, head_dim: int,
                 cpu_decode: bool = False) -> None:
        self.cache = cache
        self.meta = meta
        self.scale = 1.0 / math.sqrt(head_dim)
        if cpu_decode and cache.quantized:
            raise ValueError("the CPU attention path reads fp32 pools: run fp8 pools with cpu_decode=False")
        self.cpu_decode = cpu_decode
        self._plan: cpu_attention.StepPlan | None = None  # the CPU path's per-step indices

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]."""
        m, kc, vc = self.meta, self.cache.k[layer], self.cache.v[layer]
        assert q.shape[0] == k.shape[0] == m.slot_mapping.shape[0], (q.shape, k.shape, m.slot_mapping.shape)
        self._store(layer, k, v, kc, vc)
        if self.cpu_decode:
            return self._attend_cpu(q, k, v, kc, vc)
        return self.attend_stored(layer, q)

    def attend_qkv(self, layer: int, qkv: torch.Tensor, num_heads: int, num_kv_heads: int, cos: torch.Tensor,
                   sin: torch.Tensor) -> torch.Tensor:
        """RoPE, K/V store and attention of a fused projection qkv [T, (Hq + 2 Hkv) * D] -> [T, Hq, D]; on
        the kernels' path RoPE and the store are one launch (``kernels.rope_store_kv``)."""
        m, kc, vc = self.meta, self.cache.k[layer], self.cache.v[layer]
        ks, vs = self.cache.k_scale[layer], self.cache.v_scale[layer]
        assert qkv.shape[0] == m.slot_mapping.shape[0], (qkv.shape, m.slot_mapping.shape)
        if self.cpu_decode:  # the CPU path's own store and attention
            d = kc.shape[-1]
            q, k, v = qkv.split([num_heads * d, num_kv_heads * d, num_kv_heads * d], dim=1)
            t = qkv.shape[0]
            q, k = kernels.rope(q.view(t, num_heads, d), k.view(t, num_kv_heads, d), cos, sin)
            return self.attend(layer, q, k, v.view(t, num_kv_heads, d))
        q = kernels.rope_store_kv(qkv, num_heads, num_kv_heads, cos, sin, kc, vc, m.slot_mapping, k_scale=ks,
                                  v_scale=vs)
        return self.attend_stored(layer, q)

    def attend_stored(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """The kernels' attention of q [T, Hq, D] over the cache (this step's K/V already stored)."""
        m, kc, vc = self.meta, self.cache.k[layer], self.cache.v[layer]
        scales = dict(k_scale=self.cache.k_scale[layer], v_scale=self.cache.v_scale[layer])  # None unless fp8
        nd = m.num_decode
        if nd == q.shape[0]:
            return kernels.paged_decode_attention(q, kc, vc, m.decode_block_tables, m.decode_context_lens,
                                                  self.scale, partition_size=m.decode_partition, **scales)
        out = torch.empty_like(q)  # both parts write their rows of it: no concatenation (a copy, a launch)
        kernels.paged_prefill_attention(q[nd:], kc, vc, m.prefill_block_tables, m.prefill_cu_seqlens_q,
                                        m.prefill_context_lens, self.scale, max_seqlen_q=m.prefill_max_q,
                                        out=out[nd:], **scales)
        if nd:
            kernels.paged_decode_attention(q[:nd], kc, vc, m.decode_block_tables, m.decode_context_lens,
                                           self.scale, partition_size=m.decode_partition, out=out[:nd], **scales)
        return out

    def _store(self, layer: int, k: torch.Tensor, v: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor) -> None:
        if self.cpu_decode:  # no padding slots on the CPU path
            kc.view(-1, *kc.shape[2:]).index_copy_(0, self.meta.slot_mapping, k)
            vc.view(-1, *vc.shape[2:]).index_copy_(0, self.meta.slot_mapping, v)
        else:
            kernels.store_kv(k, v, kc, vc, self.meta.slot_mapping, k_scale=self.cache.k_scale[layer],
                             v_scale=self.cache.v_scale[layer])

    def _attend_cpu(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kc: torch.Tensor,
                    vc: torch.Tensor) -> torch.Tensor:
        if self._plan is None:  # same indices in every layer: build them once per step
            self._plan = cpu_attention.plan_step(self.meta, kc.shape[1], kc.shape[2], q.shape[0],
                                                 q.shape[1] // kc.shape[2])
        nd, t = self.meta.num_decode, q.shape[0]
        parts = []
        if nd:
            parts.append(cpu_attention.decode_attention(q[:nd], kc, vc, self._plan, self.scale))
        if nd < t:
            parts.append(cpu_attention.prefill_attention(q[nd:], k[nd:], v[nd:], kc, vc, self._plan,
                                                         self.scale))
        return parts[0] if len(parts) == 1 else torch.cat(parts)
