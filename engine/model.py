"""Reference Llama-family decoder in plain torch.

This is the one model definition the engine, the client SDK (local early layers) and the FHE path
slice. Module and parameter names follow Hugging Face's so a ``state_dict`` loads unchanged.

The model works on a *flat* batch of tokens: ``input_ids [T]`` with ``positions [T]``; which token
belongs to which sequence, and where earlier keys/values live, is the business of the
:class:`AttentionBackend` passed to :meth:`LlamaForCausalLM.forward` (a dense per-sequence cache here,
the paged cache in ``engine.kv_cache``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig


class AttentionBackend(Protocol):
    """Stores this step's K/V and attends over the sequence's keys so far (causal)."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D] for this step's tokens -> [T, Hq, D]."""
        ...


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned gain (computed in fp32 like HF)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """x / rms(x), without the gain (the FHE path folds the gain into the next projection)."""
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * self.normalize(x)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [D/2], with Llama-3 / linear rope scaling applied."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    sc = cfg.rope_scaling or {}
    kind = sc.get("rope_type", sc.get("type", "default"))
    if kind == "linear":
        inv = inv / sc["factor"]
    elif kind == "llama3":
        factor, low, high = sc["factor"], sc.get("low_freq_factor", 1.0), sc.get("high_freq_factor", 4.0)
        old_len = sc["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        low_wl, high_wl = old_len / low, old_len / high
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > low_wl, inv / factor, inv)
        mid = (wavelen <= low_wl) & (wavelen >= high_wl)
        inv = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    return inv.float()


class RotaryEmbedding(nn.Module):
    """RoPE in the rotate-half layout of HF Llama: pairs (i, i + D/2)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self._shared: tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]] | None = None

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, D] (fp32)."""
        if self._shared is not None and self._shared[0] is positions:
            return self._shared[1]
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()

    @contextlib.contextmanager
    def shared_tables(self, positions: torch.Tensor) -> Iterator[None]:
        """Within the block, q and k of every layer reuse one cos/sin table for this positions tensor."""
        self._shared = None
        self._shared = (positions, self.cos_sin(positions))
        try:
            yield
        finally:
            self._shared = None

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [T, H, D] rotated by its token's position."""
        cos, sin = self.cos_sin(positions)
        return apply_rope(x, cos, sin)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D], cos/sin [T, D] -> rotated x (same dtype)."""
    half = x.shape[-1] // 2
    xf = x.float()
    rot = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos[:, None, :] + rot * sin[:, None, :]).to(x.dtype)


class Attention(nn.Module):
    """GQA self-attention; storage and the softmax itself are delegated to an AttentionBackend."""

    # x -> cat(q, k, v) in one product (engine.cpu_linear.fuse_projections); a plain attribute, not a
    # submodule, so the state_dict keeps HF's names
    fused_qkv: nn.Module | None = None

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)

    def qkv(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding):
        """x [T, hidden] -> q [T, Hq, D], k/v [T, Hkv, D], with RoPE applied to q and k."""
        t = x.shape[0]
        if self.fused_qkv is not None:
            return self._fused_qkv(x, positions, rope)
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        return rope(q, positions), rope(k, positions), v

    def _fused_qkv(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding):
        """One product for q/k/v and one RoPE over q and k together (same positions); views, not copies."""
        t, hq, hkv, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.fused_qkv(x)
        qk = rope(qkv[:, :(hq + hkv) * d].view(t, hq + hkv, d), positions)
        return qk[:, :hq], qk[:, hq:], qkv[:, (hq + hkv) * d:].view(t, hkv, d)

    def forward(self, x, positions, rope, backend: AttentionBackend) -> torch.Tensor:
        q, k, v = self.qkv(x, positions, rope)
        out = backend.attend(self.layer_idx, q, k, v)  # [T, Hq, D]
        return self.o_proj(out.reshape(x.shape[0], -1))


class MLP(nn.Module):
    """SwiGLU feed-forward."""

    fused_gate_up: nn.Module | None = None  # x -> cat(gate, up) in one product (see Attention.fused_qkv)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_gate_up is not None:
            gate, up = self.fused_gate_up(x).chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm block: h += attn(norm(h)); h += mlp(norm(h))."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, h, positions, rope, backend: AttentionBackend) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), positions, rope, backend)
        return self.mlp_block(h)

    def mlp_block(self, h: torch.Tensor) -> torch.Tensor:
        """The second half of the layer (the client runs it after an encrypted attention)."""
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm (HF's ``model.`` prefix)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """The decoder with its LM head; pieces are exposed for slicing (embed, layers, norm, head)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.rotary = RotaryEmbedding(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.layers

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> hidden [T, hidden]."""
        return self.model.embed_tokens(input_ids)

    def run_layers(self, h, positions, backend: AttentionBackend, start: int = 0, end: int | None = None):
        """Run decoder layers [start, end) on hidden h [T, hidden]."""
        with self.rotary.shared_tables(positions):  # the same positions in every layer: one cos/sin
            for layer in self.model.layers[start:end]:
                h = layer(h, positions, self.rotary, backend)
        return h

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm + head: hidden [T, hidden] -> logits [T, vocab] (fp32)."""
        return self.lm_head(self.model.norm(h)).float()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend):
        """input_ids/positions [T] -> last hidden state [T, hidden] (call :meth:`logits` on the rows you need)."""
        return self.run_layers(self.embed(input_ids), positions, backend)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int) -> torch.Tensor:
    """Reference GQA attention of one sequence.

    q [Tq, Hq, D] at positions q_start..q_start+Tq-1; k/v [Tk, Hkv, D] at positions 0..Tk-1.
    Returns [Tq, Hq, D]. Scores and softmax in fp32.
    """
    tq, hq, d = q.shape
    tk, hkv, _ = k.shape
    g = hq // hkv
    qf = q.float().view(tq, hkv, g, d).permute(1, 2, 0, 3)        # [Hkv, g, Tq, D]
    kf = k.float().permute(1, 0, 2)[:, None]                       # [Hkv, 1, Tk, D]
    vf = v.float().permute(1, 0, 2)[:, None]
    scores = (qf @ kf.transpose(-1, -2)) / math.sqrt(d)            # [Hkv, g, Tq, Tk]
    qpos = torch.arange(q_start, q_start + tq, device=q.device)[:, None]
    mask = torch.arange(tk, device=q.device)[None, :] > qpos       # [Tq, Tk]
    scores = scores.masked_fill(mask, float("-inf"))
    out = scores.softmax(-1) @ vf                                  # [Hkv, g, Tq, D]
    return out.permute(2, 0, 1, 3).reshape(tq, hq, d).to(q.dtype)


class DenseKVCache:
    """A contiguous K/V cache for one sequence: the reference backend (and the FHE simulator's)."""

    def __init__(self, cfg: ModelConfig, max_len: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        shape = (cfg.num_hidden_layers, max_len, cfg.num_key_value_heads, cfg.head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.length = 0     # tokens committed (all layers)
        self._pending = 0   # tokens of the step in flight

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        t, start = q.shape[0], self.length
        if start + t > self.max_len:
            raise ValueError(f"sequence of {start + t} tokens exceeds the cache ({self.max_len})")
        self.k[layer, start:start + t] = k
        self.v[layer, start:start + t] = v
        self._pending = t
        return causal_attention(q, self.k[layer, :start + t], self.v[layer, :start + t], start)

    def advance(self) -> None:
        """Commit the tokens of the last forward pass (call once per step, after all layers)."""
        self.length += self._pending
        self._pending = 0

    def truncate(self, length: int) -> None:
        """Forget everything after ``length`` tokens."""
        self.length = min(self.length, length)


@torch.inference_mode()
def greedy_generate(model: LlamaForCausalLM, prompt_ids: list[int], max_new_tokens: int,
                    stop_ids: set[int] | None = None, backend=None) -> list[int]:
    """Single-sequence greedy decoding: the reference the engine is checked against.

    ``backend`` is any single-sequence AttentionBackend with ``advance()`` and ``length`` (the FHE
    simulator passes its own); default: a DenseKVCache.
    """
    weight = model.model.norm.weight  # dtype/device only (a quantized head has no fp32 ``weight``)
    if backend is None:
        backend = DenseKVCache(model.config, len(prompt_ids) + max_new_tokens, dtype=weight.dtype,
                               device=weight.device)
    ids = torch.tensor(prompt_ids, device=weight.device)
    pos = torch.arange(len(prompt_ids), device=weight.device)
    out: list[int] = []
    for _ in range(max_new_tokens):
        h = model(ids, pos, backend)
        backend.advance()
        nxt = int(model.logits(h[-1:]).argmax(-1))
        out.append(nxt)
        if stop_ids and nxt in stop_ids:
            break
        ids = torch.tensor([nxt], device=weight.device)
        pos = torch.tensor([backend.length], device=weight.device)
    return out
