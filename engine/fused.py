"""The fused CUDA forward of the Llama decoder: fewer, larger kernels for the same function.

The reference model (``engine.model``) launches ~50 small kernels per layer (fp32 upcasts of RMSNorm, the
RoPE tables rebuilt per projection, separate q/k/v and gate/up GEMMs). A batch-1 decode step replayed from
a CUDA graph is then bound by kernel count, not by the weight bytes it must read (docs/benchmarks.md). Per
layer this path runs: add+RMSNorm, one QKV GEMM, RoPE of q and k, the attention backend (KV store +
attention), the O GEMM, add+RMSNorm, one gate/up GEMM, SiLU*mul and the down GEMM. The cos/sin tables are
built once per forward. A single-row batch (batch-1 decode) runs its layer GEMMs through
``kernels.gemv`` (weight-streaming, no split-K reduce kernel) rather than cuBLAS.

Quantized weights (``EngineConfig.cuda_weight_format``): "int4" (group-wise RTN, :class:`Int4Weight`, decode
rows through ``kernels.gemv_int4_w32``) or "fp8" (e4m3 with per-channel scales, :class:`engine.fp8.Fp8Linear`:
decode rows weight-only through ``kernels.gemv_fp8``, more rows W8A8 through ``kernels.scaled_mm_fp8``). Both
quantize the layer GEMMs and the LM head at load; the embedding keeps its 16-bit table.

Decode fusions (issue 19.2): on the paged backend RoPE and the K/V store are one launch
(``kernels.rope_store_kv``, ``fused_rope_store`` = ``EngineConfig.cuda_fused_rope_store``, on by default), for
every batch; with ``gemv_prologues`` (``EngineConfig.cuda_gemv_prologues``, off by default: slower on an H100 at
the tunings measured, docs/benchmarks.md), where a product runs as a GEMV kernel (one bf16 row, or up to
``INT4_GEMV_MAX_ROWS`` int4 rows), the RMSNorm before qkv and gate/up and the SiLU·mul before down run in that
kernel's prologue (``kernels._prologue``). With ``fused_layers`` (``EngineConfig.cuda_fused_decode_layers``, off by
default: slower on an H100, docs/benchmarks.md) a step whose rows are all GEMV rows runs each layer as four
launches plus the attention (``kernels.decode_layer``): RMSNorm + QKV + RoPE + K/V store, attention, O + residual
add, RMSNorm + gate/up + SiLU·mul, down + residual add; the residual stream is updated in place by the O and down
epilogues.

:func:`fuse_for_cuda` concatenates each layer's q/k/v and gate/up weights once, at load, and re-points the
original parameters at row slices of the fused tensors, so no weight is stored twice and the wrapped model
still runs its own (reference) forward on the same weights.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from engine.fp8 import Fp8Linear, check_device
from engine.model import AttentionBackend, LlamaForCausalLM

# rows up to which int4 weights go through the GEMV kernel (it re-reads W from L2 per row); more: dequantize
INT4_GEMV_MAX_ROWS = 4


@dataclasses.dataclass
class Int4Weight:
    """A linear's weight in ``kernels.gemv_int4_w32``'s layout (made once, at load): ``w = scale * u +
    offset`` per column group, nibbles interleaved in int32 words, a group's scale and offset side by side."""

    qweight: torch.Tensor       # [N, K/8] int32
    scale_offset: torch.Tensor  # [N, K/group, 2] fp16

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return kernels.dequantize_int4_w32(self.qweight, self.scale_offset).to(dtype)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scale_offset))


@torch.no_grad()
def quantize_int4_rtn(w: torch.Tensor, group: int) -> Int4Weight:
    """RTN int4 per group of ``group`` columns, on w's device (the arithmetic of engine.quant.quantize_int4:
    offset = group min, scale = (max - min) / 15, both rounded to fp16 before the weights are)."""
    n, k = w.shape
    g = w.float().reshape(n, k // group, group)
    lo = g.amin(-1).half().float()
    scale = ((g.amax(-1) - lo) / 15).half().float()
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    u = ((g - lo[..., None]) / safe[..., None]).round().clamp(0, 15).reshape(n, k)
    return Int4Weight(*kernels.repack_int4_w32(kernels.pack_int4_rows(u), scale.half(), lo.half()))


Weight = torch.Tensor | Int4Weight | Fp8Linear  # a layer GEMM's weight [N, K] as the fused forward holds it


@dataclasses.dataclass
class FusedLayerWeights:
    """One decoder layer's weights in the fused layout (views share storage with the model's parameters)."""

    qkv: Weight                    # [(Hq + 2 Hkv) * D, hidden]
    qkv_bias: torch.Tensor | None  # [(Hq + 2 Hkv) * D]
    gate_up: Weight                # [2 * I, hidden]
    o: Weight                      # [hidden, Hq * D]
    down: Weight                   # [hidden, I]


def _concat_into(linears: list[nn.Linear], attr: str) -> torch.Tensor | None:
    """Concatenate the linears' `attr` along dim 0 and re-point each parameter at its slice."""
    params = [getattr(lin, attr) for lin in linears]
    if params[0] is None:
        return None
    fused = torch.cat([p.detach() for p in params])
    row = 0
    for p in params:
        p.data = fused[row:row + p.shape[0]]
        row += p.shape[0]
    return fused


@torch.no_grad()
def fuse_layer_weights(model: LlamaForCausalLM) -> list[FusedLayerWeights]:
    """Build every layer's fused QKV and gate/up weights (the model's parameters become views of them)."""
    out = []
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        lins = [attn.q_proj, attn.k_proj, attn.v_proj]
        out.append(FusedLayerWeights(_concat_into(lins, "weight"), _concat_into(lins, "bias"),
                                     _concat_into([mlp.gate_proj, mlp.up_proj], "weight"),
                                     attn.o_proj.weight, mlp.down_proj.weight))
    return out


@torch.no_grad()
def quantize_layer_weights(model: LlamaForCausalLM, fused: list[FusedLayerWeights], quantize) -> None:
    """Replace every layer GEMM weight by ``quantize(weight)`` and free the bf16 copies (the model's own
    linears then hold empty tensors: only the fused forward can run it)."""
    for layer, w in zip(model.layers, fused, strict=True):
        w.qkv, w.gate_up, w.o, w.down = (quantize(t) for t in (w.qkv, w.gate_up, w.o, w.down))
        attn, mlp = layer.self_attn, layer.mlp
        for lin in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            lin.weight.data = lin.weight.data.new_empty(0)


def weight_tensors(w: Weight) -> list[torch.Tensor]:
    """The tensors a layer GEMM's weight is stored in (16-bit weight; int4 data and scales; fp8 data and scales)."""
    if isinstance(w, Int4Weight):
        return [w.qweight, w.scale_offset]
    if isinstance(w, Fp8Linear):
        return [w.weight, w.scale]
    return [w]


def weight_nbytes(w: Weight) -> int:
    """Bytes a layer GEMM's weight occupies as stored (quantized data and scales)."""
    return w.numel() * w.element_size() if isinstance(w, torch.Tensor) else w.nbytes()


class FusedLlama(nn.Module):
    """Same interface as :class:`LlamaForCausalLM` for the runner: ``forward`` and ``logits``."""

    def __init__(self, model: LlamaForCausalLM, use_gemv: bool = True, int4_group: int | None = None,
                 gemv_prologues: bool = False, fused_rope_store: bool = True, fp8: bool = False,
                 fused_layers: bool = False, kernel_backend: str = "auto") -> None:
        super().__init__()
        self.base = model
        self.use_gemv = use_gemv  # single-row GEMMs through kernels.gemv (batch-1 decode) instead of cuBLAS
        self.gemv_prologues = gemv_prologues  # RMSNorm / SiLU·mul in the prologue of the GEMV rows' kernels
        self.fused_rope_store = fused_rope_store  # RoPE + K/V store in one launch (paged backend)
        self.fused_layers = fused_layers  # GEMV-row steps: 4 launches + attention a layer (kernels.decode_layer)
        # the decode-layer launchers' backend: "auto" (Triton on CUDA, torch references elsewhere); tests force
        # "triton" on CPU tensors under Triton's interpreter
        self.kernel_backend = kernel_backend
        self.config = model.config
        self.fused = fuse_layer_weights(model)
        # int4 / fp8 weights: the layer GEMMs and the head (the embedding keeps its copy)
        self.quant_head: Int4Weight | Fp8Linear | None = None
        if int4_group is not None and fp8:
            raise ValueError("int4 and fp8 weights exclude each other")
        quantize = None
        if int4_group is not None:
            quantize = lambda w: quantize_int4_rtn(w, int4_group)  # noqa: E731
        elif fp8:
            check_device(model.lm_head.weight.device)
            quantize = Fp8Linear.quantize
        if quantize is not None:
            quantize_layer_weights(model, self.fused, quantize)
            self.quant_head = quantize(model.lm_head.weight)
            if model.lm_head.weight is not model.model.embed_tokens.weight:  # untied: the 16-bit head goes
                model.lm_head.weight.data = model.lm_head.weight.data.new_empty(0)
        cfg = model.config
        self._q, self._kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim

    @property
    def layers(self) -> nn.ModuleList:
        return self.base.layers

    @property
    def rotary(self) -> nn.Module:
        return self.base.rotary

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend):
        """input_ids/positions [T] -> last hidden state [T, hidden], as the reference forward."""
        h = self.base.embed(input_ids)                      # [T, hidden]
        cos, sin = self.base.rotary.cos_sin(positions)      # [T, D] fp32, shared by every layer
        if self._fused_layers_apply(h, backend):
            return self._forward_fused_layers(h, cos, sin, backend)
        residual = None
        for layer, w in zip(self.base.layers, self.fused, strict=True):
            h, residual = self._layer(layer, w, h, residual, cos, sin, backend)
        return h + residual

    def _layer(self, layer, w: FusedLayerWeights, h, residual, cos, sin, backend):
        """One decoder layer on (layer input h, residual stream) -> (MLP output, residual stream)."""
        attn = layer.self_attn
        qkv, residual = self._norm_linear(layer.input_layernorm, h, residual, w.qkv, w.qkv_bias)
        o = self._attend(attn, qkv, cos, sin, backend)      # [T, Hq, D]
        h = _reduce(attn.o_proj, self._linear(o.reshape(o.shape[0], -1), w.o))
        gate_up, residual = self._norm_linear(layer.post_attention_layernorm, h, residual, w.gate_up)
        return _reduce(layer.mlp.down_proj, self._silu_linear(gate_up, w.down)), residual

    def _fused_layers_apply(self, h: torch.Tensor, backend) -> bool:
        """Whether this step runs the fused decode layers: switched on, every product a GEMV row (bf16: one
        row; int4: up to INT4_GEMV_MAX_ROWS), the kernels' paged backend with pools of the activations' dtype
        (not the CPU attention path, not fp8 pools), no fp8 weights and no tensor-parallel slices (their
        partial products are summed over ranks before the residual add)."""
        if not self.fused_layers:
            return False
        w0 = self.fused[0]
        rows = h.shape[0]
        if isinstance(w0.qkv, Int4Weight):
            if rows > INT4_GEMV_MAX_ROWS:
                return False
        elif not (self.use_gemv and rows == 1 and isinstance(w0.qkv, torch.Tensor)):
            return False
        cache, meta = getattr(backend, "cache", None), getattr(backend, "meta", None)
        if (cache is None or meta is None or getattr(backend, "cpu_decode", True) or cache.quantized
                or cache.k[0].dtype != h.dtype or meta.slot_mapping.shape[0] != rows):
            return False
        layer = self.base.layers[0]
        return getattr(layer.self_attn.o_proj, "reduce", None) is None and getattr(
            layer.mlp.down_proj, "reduce", None) is None

    def _forward_fused_layers(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend) -> torch.Tensor:
        """Every layer in four ``kernels.decode_layer`` launches + the attention; h [T, hidden] is the residual
        stream from here on (the embedding's fresh output), updated in place by the O and down epilogues."""
        kb, cache, slots = self.kernel_backend, backend.cache, backend.meta.slot_mapping
        t = h.shape[0]
        for layer, w in zip(self.base.layers, self.fused, strict=True):
            attn, n1, n2 = layer.self_attn, layer.input_layernorm, layer.post_attention_layernorm
            i = attn.layer_idx
            (wqkv, sqkv), (wo, so), (wgu, sgu), (wd, sd) = (_wso(x) for x in (w.qkv, w.o, w.gate_up, w.down))
            q = kernels.norm_qkv_rope_store(h, n1.weight, n1.eps, wqkv, w.qkv_bias, attn.num_heads,
                                            attn.num_kv_heads, cos, sin, cache.k[i], cache.v[i], slots, sqkv,
                                            backend=kb)                       # q [T, Hq, D]; k, v stored
            o = backend.attend_stored(i, q)                                   # [T, Hq, D]
            kernels.gemv_add_residual(o.reshape(t, -1), wo, h, so, backend=kb)
            act = kernels.norm_gate_up_silu(h, n2.weight, n2.eps, wgu, sgu, backend=kb)  # [T, I]
            kernels.gemv_add_residual(act, wd, h, sd, backend=kb)
        return h

    def _norm_linear(self, norm, h, residual, weight, bias=None):
        """(add +) RMSNorm then x @ weight^T (+ bias) -> (product [T, N], residual stream [T, hidden]); one
        launch where the product is a GEMV row (decode fusions), else the norm kernel then the product."""
        if self.gemv_prologues and self._gemv_rows(h, weight):
            if isinstance(weight, Int4Weight):
                return kernels.gemv_int4_w32_rms_norm(h, norm.weight, norm.eps, weight.qweight,
                                                      weight.scale_offset, bias, residual=residual)
            return kernels.gemv_rms_norm(h, norm.weight, norm.eps, weight, bias, residual=residual)
        if residual is None:
            x, residual = kernels.rms_norm(h, norm.weight, norm.eps), h
        else:
            x, residual = kernels.add_rms_norm(h, residual, norm.weight, norm.eps)
        return self._linear(x, weight, bias), residual

    def _attend(self, attn, qkv, cos, sin, backend) -> torch.Tensor:
        """RoPE, K/V store and attention of a fused QKV projection [T, (Hq + 2 Hkv) * D] -> [T, Hq, D]."""
        attend_qkv = getattr(backend, "attend_qkv", None)  # the paged backend: RoPE + store in one launch
        if self.fused_rope_store and attend_qkv is not None:
            return attend_qkv(attn.layer_idx, qkv, attn.num_heads, attn.num_kv_heads, cos, sin)
        t, d = qkv.shape[0], attn.head_dim
        q = qkv[:, :self._q].view(t, attn.num_heads, d)
        k = qkv[:, self._q:self._q + self._kv].view(t, attn.num_kv_heads, d)
        v = qkv[:, self._q + self._kv:].view(t, attn.num_kv_heads, d)
        q, k = kernels.rope(q, k, cos, sin)
        return backend.attend(attn.layer_idx, q, k, v)

    def _silu_linear(self, gate_up: torch.Tensor, weight: Weight) -> torch.Tensor:
        """silu(gate) * up @ weight^T: one launch where the product is a GEMV row (decode fusions)."""
        if self.gemv_prologues and self._gemv_rows(gate_up, weight):
            if isinstance(weight, Int4Weight):
                return kernels.gemv_int4_w32_silu_mul(gate_up, weight.qweight, weight.scale_offset)
            return kernels.gemv_silu_mul(gate_up, weight)
        return self._linear(kernels.silu_mul(gate_up), weight)

    def _gemv_rows(self, x: torch.Tensor, weight: Weight) -> bool:
        """Whether x's rows go through a GEMV kernel with a prologue variant (not cuBLAS / a dequantized
        copy) for this weight; fp8 has none (its norm and SiLU·mul run their own kernels)."""
        if isinstance(weight, Fp8Linear):
            return False
        if isinstance(weight, Int4Weight):
            return x.shape[0] <= INT4_GEMV_MAX_ROWS
        return self.use_gemv and x.shape[0] == 1 and x.is_cuda

    def _linear(self, x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, K] @ weight[N, K]^T (+ bias): one row goes through the GEMV kernel, more through cuBLAS."""
        if isinstance(weight, Fp8Linear):
            return weight(x, bias)  # GEMV rows weight-only, more rows W8A8 (engine.fp8)
        if isinstance(weight, Int4Weight):
            if x.shape[0] <= INT4_GEMV_MAX_ROWS:
                return kernels.gemv_int4_w32(x, weight.qweight, weight.scale_offset, bias)
            return F.linear(x, weight.dequantize(x.dtype), bias)  # prefill: a transient bf16 copy
        if self.use_gemv and x.shape[0] == 1 and x.is_cuda:
            return kernels.gemv(x, weight, bias)
        return F.linear(x, weight, bias)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm + head: hidden [T, hidden] -> logits [T, vocab] (fp32)."""
        norm = self.base.model.norm
        x = kernels.rms_norm(h, norm.weight, norm.eps)
        if self.quant_head is not None:
            return self._linear(x, self.quant_head).float()
        return self.base.lm_head(x).float()

    def resident_weight_bytes(self) -> int:
        """Bytes of every distinct tensor the forward holds for weights: parameters (norms, embedding, biases;
        the bf16 layer GEMMs, whose fused tensors the parameters view), quantized data and scales."""
        tensors = list(self.base.parameters())
        for w in self.fused:
            for t in (w.qkv, w.gate_up, w.o, w.down):
                tensors += weight_tensors(t)
        if self.quant_head is not None:
            tensors += weight_tensors(self.quant_head)
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t.numel()}
        return sum(storages.values())


def _wso(w: Weight) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A layer weight as ``kernels.decode_layer`` takes it: (16-bit weight, None) or (qweight, scale_offset)."""
    return (w.qweight, w.scale_offset) if isinstance(w, Int4Weight) else (w, None)


def _reduce(module: nn.Module, partial: torch.Tensor) -> torch.Tensor:
    """A tensor-parallel row slice (``engine.tp_linear.RowParallelLinear``) sums its partial product over
    the ranks; a plain linear's output is already whole."""
    reduce = getattr(module, "reduce", None)
    return partial if reduce is None else reduce(partial)


def fuse_for_cuda(model: LlamaForCausalLM, int4_group: int | None = None,
                  gemv_prologues: bool = False, fused_rope_store: bool = True, fp8: bool = False,
                  fused_layers: bool = False) -> FusedLlama:
    """The model with the fused forward (the runner's choice on CUDA); ``int4_group``: int4 weights; ``fp8``:
    e4m3 weights (engine.fp8); ``gemv_prologues``: norms / SiLU·mul in the GEMV rows' prologues;
    ``fused_rope_store``: RoPE + K/V store in one launch; ``fused_layers``: GEMV-row steps as four launches +
    attention a layer (``kernels.decode_layer``)."""
    return FusedLlama(model, int4_group=int4_group, gemv_prologues=gemv_prologues,
                      fused_rope_store=fused_rope_store, fp8=fp8, fused_layers=fused_layers)
