"""The fused batch-1 decode step on CPU (``EngineConfig.cpu_fused_decode``).

A step of one single-token query (batch-1 decode) through the reference forward is ~20 small torch ops per
layer around its four products (norms, RoPE, the K/V store, the attention gather, softmax, SiLU, residual
adds, casts and views) plus the Python around them: on SmolLM2-135M at one thread that was about as much
CPU time as the Q4_1 products themselves (docs/benchmarks.md, session 13). :class:`FusedDecode` instead runs
every decoder layer of the token in **one** native call, ``kernels.cpu.decode_step`` (``gemv_q.cpp``): per
layer RMSNorm, the fused q/k/v product, RoPE, the K/V store into the engine's paged pools, GQA attention
over the context, the O product and residual, RMSNorm, the fused gate/up product, SiLU·mul, the down product
and residual. Its products are the same code as the unfused path's one-row products (fp32 ``f32_rows``,
Q4_1 / Q8_0 over int8 activations), so the logits equal the unfused path's to float rounding. The embedding
and the final norm + LM head stay in torch (one lookup, one product).

:func:`build` returns None, and the engine keeps the unfused forward, where the step cannot run fused: the
native kernels do not load (no compiler, no AVX2/FMA/F16C, ``CIPHERLM_NATIVE=0``), or a layer is not one
the kernel takes (q/k/v or gate/up not fused into one product, a bias, a weight neither fp32 nor Q4_1 /
Q8_0-shaped, e.g. Q4_K or int4 with groups of 64, or tensor-parallel shards).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from engine.kv_cache import PagedKVCache
from engine.model import LlamaForCausalLM
from kernels import cpu as native

log = logging.getLogger(__name__)


def linear_operands(mod: nn.Module | None) -> list[torch.Tensor] | None:
    """What the native step reads for a linear: ``[w]`` (fp32 ``[N, K]``), ``[qs, d, m]`` (Q4_1) or
    ``[qs, d]`` (Q8_0); None where the layer is none of these or has a bias."""
    from engine.quant import Int4Linear

    if mod is None or getattr(mod, "bias", None) is not None:
        return None
    if isinstance(mod, Int4Linear):
        return mod.native_operands()
    w = getattr(mod, "weight", None)
    if isinstance(w, torch.Tensor) and w.dtype == torch.float32 and w.dim() == 2 and w.device.type == "cpu":
        return [w.detach().contiguous()]
    return None


class FusedDecode:
    """Every layer of a one-token step in one native call; see the module docstring."""

    def __init__(self, model: LlamaForCausalLM, layer_weights: list[list[torch.Tensor]], max_model_len: int) -> None:
        cfg = model.config
        self.model = model
        self.layer_weights = layer_weights  # per layer: ln1, ln2, then the linears' operands
        self.max_model_len = max_model_len
        self.cos = self.sin = None          # [positions, D] fp32, RotaryEmbedding.cos_sin's values (bind())
        self.num_layers, self.num_heads, self.num_kv_heads = (
            cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads)
        self.eps = float(model.model.layers[0].input_layernorm.eps)
        self.max_len = 0
        self._weights: list[torch.Tensor] | None = None  # the flat list with the KV pools, after bind()

    def bind(self, kv: PagedKVCache) -> None:
        """Interleave the KV pools into the weight list (the pool is made after the model) and build RoPE's
        tables for every position the pool can hold (at most ``max_model_len``)."""
        self.max_len = min(self.max_model_len, kv.num_blocks * kv.block_size)
        with torch.inference_mode():
            cos, sin = self.model.rotary.cos_sin(torch.arange(self.max_len))
        self.cos, self.sin = cos.float().contiguous(), sin.float().contiguous()
        flat = []
        for i, lw in enumerate(self.layer_weights):
            flat += [lw[0], lw[1], kv.k[i], kv.v[i], *lw[2:]]
        self._weights = flat

    @torch.inference_mode()
    def hidden(self, token: int, pos: int, block_table: list[int]) -> torch.Tensor:
        """Run every layer of ``token`` at ``pos`` (its K/V stored in the pools); the last hidden [1, hidden]."""
        assert self._weights is not None, "bind() the KV pool first"
        if pos >= self.max_len:
            raise ValueError(f"position {pos} beyond the RoPE table ({self.max_len})")
        h = self.model.embed(torch.tensor([token])).float().contiguous()
        native.decode_step(h, self._weights, self.num_layers, self.num_heads, self.num_kv_heads, pos,
                           block_table, self.cos, self.sin, self.eps)
        return h

    def logits(self, token: int, pos: int, block_table: list[int]) -> torch.Tensor:
        """:meth:`hidden`, then the final norm and the head: logits [1, V] fp32."""
        with torch.inference_mode():
            return self.model.logits(self.hidden(token, pos, block_table))


def build(model: LlamaForCausalLM, max_model_len: int) -> FusedDecode | None:
    """A :class:`FusedDecode` for ``model``, or None (logged) where the step cannot run fused."""
    reason = _why_not(model)
    if reason is None:
        layers = []
        for layer in model.model.layers:
            ops = [linear_operands(m) for m in (layer.self_attn.fused_qkv, layer.self_attn.o_proj,
                                                  layer.mlp.fused_gate_up, layer.mlp.down_proj)]
            if any(o is None for o in ops):
                reason = f"layer {layer.self_attn.layer_idx}: a linear the native step does not take"
                break
            norms = [layer.input_layernorm.weight.detach().float().contiguous(),
                     layer.post_attention_layernorm.weight.detach().float().contiguous()]
            layers.append(norms + [t for o in ops for t in o])
    if reason is not None:
        log.info("fused CPU decode step off: %s", reason)
        return None
    return FusedDecode(model, layers, max_model_len)


def _why_not(model: LlamaForCausalLM) -> str | None:
    if not native.available():
        return f"native kernels unavailable ({native.unavailable_reason()})"
    norm = model.model.norm.weight
    if norm.device.type != "cpu" or norm.dtype != torch.float32:
        return "the model is not fp32 on the CPU"
    layer0 = model.model.layers[0]
    if layer0.self_attn.fused_qkv is None or layer0.mlp.fused_gate_up is None:
        return "q/k/v and gate/up are not fused products (cpu_fused_projections off or not fusable)"
    eps = {float(x.eps) for layer in model.model.layers
           for x in (layer.input_layernorm, layer.post_attention_layernorm)}
    if len(eps) != 1:
        return "RMSNorm eps differs between layers"
    return None
