"""Tensor-parallel pieces of the Llama decoder: shard a state dict for one rank, join the shards.

Megatron-LM's split, as vLLM runs it. Rank ``r`` of ``N`` holds:

* q/k/v and gate/up as **column-parallel** slices (output rows): query heads ``[r * Hq/N, (r+1) * Hq/N)``,
  KV heads ``[r * Hkv/N, ...)`` (GQA: the query heads of a rank are exactly those of its KV heads, so
  attention needs no communication and the rank's paged KV pool holds only its heads), MLP columns
  ``[r * I/N, ...)``;
* o_proj and down_proj as **row-parallel** slices (input columns), each followed by one all-reduce (sum):
  two all-reduces of ``[T, hidden]`` per layer;
* the embedding and the LM head **vocabulary-parallel**: rows ``[r * Vp, (r+1) * Vp)`` with
  ``Vp = ceil(V / N)`` (the last shard zero-padded); a token outside the rank's rows embeds to zero and
  one all-reduce sums the rank embeddings; the head's ``[T, Vp]`` slices are all-gathered to ``[T, V]``;
* norms and RoPE replicated.

Sharding happens on the state dict, before :func:`engine.loader.build_model` and before the CUDA path fuses
q/k/v and gate/up (``engine.fused``): the rank's model is an ordinary :class:`LlamaForCausalLM` of the
*local* shape (:func:`local_config`) whose o/down/embedding/head modules are then wrapped
(:func:`parallelize`). Nothing here starts processes: ``engine.distributed`` does.
"""

from __future__ import annotations

import dataclasses
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig
from engine.errors import ParallelConfigError
from engine.model import LlamaForCausalLM

# parameter-name suffix -> (how it is split, along which dim); anything else is replicated
_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")   # output rows (dim 0), bias too
_ROW = ("o_proj", "down_proj")                                     # input columns (dim 1)
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")           # vocabulary rows (dim 0), padded


def valid_sizes(cfg: ModelConfig, limit: int = 8) -> list[int]:
    """Tensor-parallel sizes up to ``limit`` that divide the query heads, the KV heads and the MLP width."""
    return [n for n in range(1, limit + 1)
            if not (cfg.num_attention_heads % n or cfg.num_key_value_heads % n or cfg.intermediate_size % n)]


def check_tensor_parallel(cfg: ModelConfig, size: int) -> None:
    """Raise :class:`ParallelConfigError` unless ``size`` ranks can split this model's heads evenly."""
    if size < 1:
        raise ParallelConfigError(f"tensor_parallel_size must be >= 1, got {size}")
    if size in valid_sizes(cfg, size):
        return
    raise ParallelConfigError(
        f"tensor_parallel_size {size} does not divide the model: {cfg.num_attention_heads} query heads, "
        f"{cfg.num_key_value_heads} KV heads, MLP width {cfg.intermediate_size} must each split evenly "
        f"(sizes that work here: {valid_sizes(cfg, max(8, size))})")


def vocab_per_rank(cfg: ModelConfig, world: int) -> int:
    """Rows of the embedding / head one rank holds (the last rank's slice is padded up to this)."""
    return -(-cfg.vocab_size // world)


def local_config(cfg: ModelConfig, world: int) -> ModelConfig:
    """The shape of one rank's model: 1/N of the heads, of the MLP width and (padded) of the vocabulary."""
    check_tensor_parallel(cfg, world)
    return dataclasses.replace(cfg, num_attention_heads=cfg.num_attention_heads // world,
                               num_key_value_heads=cfg.num_key_value_heads // world,
                               intermediate_size=cfg.intermediate_size // world,
                               vocab_size=vocab_per_rank(cfg, world))


def shard_state(state: dict[str, torch.Tensor], cfg: ModelConfig, rank: int, world: int
                ) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s slice of a full (HF-named) state dict; copies, so the full one can be dropped."""
    out = {}
    for name, t in state.items():
        module = name.rsplit(".", 2)[-2]  # "model.layers.0.self_attn.q_proj.weight" -> "q_proj"
        if name in _VOCAB:
            out[name] = _vocab_rows(t, cfg, rank, world)
        elif module in _COLUMN:
            out[name] = t.chunk(world, dim=0)[rank].clone()
        elif module in _ROW:
            out[name] = t.chunk(world, dim=1)[rank].contiguous()
        else:
            out[name] = t.clone()
    return out


def _vocab_rows(t: torch.Tensor, cfg: ModelConfig, rank: int, world: int) -> torch.Tensor:
    vp = vocab_per_rank(cfg, world)
    rows = t[rank * vp:(rank + 1) * vp]
    if rows.shape[0] == vp:
        return rows.clone()
    return torch.cat([rows, rows.new_zeros(vp - rows.shape[0], *rows.shape[1:])])  # [Vp, hidden]


def full_state(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """The model's state dict as loaded (a tied head is stored once, as the embedding)."""
    state = dict(model.state_dict())
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


@dataclasses.dataclass
class Comm:
    """The collectives of one rank's forward, over ``group``; ``timing`` adds up the time they take."""

    group: dist.ProcessGroup | None
    world: int
    timing: bool = False
    seconds: float = 0.0
    calls: int = 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place."""
        t0 = time.perf_counter() if self.timing else 0.0
        dist.all_reduce(x, group=self.group)
        self._count(t0, x)
        return x

    def all_gather_cat(self, x: torch.Tensor) -> torch.Tensor:
        """[T, n] on every rank -> [T, N * n] (rank order along the last dim)."""
        t0 = time.perf_counter() if self.timing else 0.0
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        self._count(t0, x)
        return torch.cat(parts, dim=-1)

    def _count(self, t0: float, x: torch.Tensor) -> None:
        if self.timing:
            if x.is_cuda:  # NCCL returns before the GPU is done
                torch.cuda.synchronize(x.device)
            self.seconds += time.perf_counter() - t0
            self.calls += 1


class RowParallelLinear(nn.Module):
    """A row-parallel slice ``[out, in/N]`` whose partial products are summed over the ranks.

    ``weight`` is the inner linear's, so the fused CUDA forward (which calls ``F.linear`` on it) finds it;
    that forward then calls :meth:`reduce` itself.
    """

    def __init__(self, inner: nn.Module, comm: Comm) -> None:
        super().__init__()
        self.inner, self.comm = inner, comm

    @property
    def weight(self) -> torch.Tensor:
        return self.inner.weight

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """partial [T, out] of this rank -> the full product (no bias: Llama's o/down have none)."""
        return self.comm.all_reduce(partial)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(self.inner(x))


class VocabParallelEmbedding(nn.Module):
    """Rows ``[start, start + Vp)`` of the embedding; other ids embed to 0, the ranks' rows are summed."""

    def __init__(self, weight: nn.Parameter, start: int, comm: Comm) -> None:
        super().__init__()
        self.weight, self.start, self.comm = weight, start, comm

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> [T, hidden], the same on every rank."""
        local = input_ids - self.start
        inside = (local >= 0) & (local < self.weight.shape[0])
        h = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)  # [T, hidden]
        return self.comm.all_reduce(h * inside[:, None].to(h.dtype))


class VocabParallelHead(nn.Module):
    """The head's ``[Vp, hidden]`` slice; the ranks' logits are gathered and the padding dropped."""

    def __init__(self, inner: nn.Module, vocab_size: int, comm: Comm) -> None:
        super().__init__()
        self.inner, self.vocab_size, self.comm = inner, vocab_size, comm

    @property
    def weight(self) -> torch.Tensor:
        return self.inner.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> logits [T, V] (every rank gets all of them)."""
        return self.comm.all_gather_cat(self.inner(x))[:, :self.vocab_size]


def parallelize(model: LlamaForCausalLM, full_cfg: ModelConfig, rank: int, comm: Comm) -> LlamaForCausalLM:
    """Wrap a rank-local model (built from :func:`shard_state` at :func:`local_config`) so it computes
    the full model's function: all-reduce after o/down, vocabulary-parallel embedding and head."""
    for layer in model.layers:
        layer.self_attn.o_proj = RowParallelLinear(layer.self_attn.o_proj, comm)
        layer.mlp.down_proj = RowParallelLinear(layer.mlp.down_proj, comm)
    start = rank * model.config.vocab_size
    model.model.embed_tokens = VocabParallelEmbedding(model.model.embed_tokens.weight, start, comm)
    model.lm_head = VocabParallelHead(model.lm_head, full_cfg.vocab_size, comm)  # tied: same Parameter
    model.full_config = full_cfg  # type: ignore[assignment]
    return model
