"""Quantizers that write GPTQ/AWQ layouts: round-to-nearest, and GPTQ's calibrated algorithm (written here).

* :func:`rtn` — each group's (scale, zero) from its weights, then ``q = clamp(round(w / scale) + zero)``.
  Two grids, as the reference tools compute them: GPTQ's (the group's range widened to include 0;
  symmetric: ``zero = 2**(bits-1)``, ``scale = 2 * absmax / maxq``) and AWQ's (min/max range, asymmetric).
  Scales are rounded to fp16 *before* rounding the weights, so the stored fp16 scale is the one used.
* :func:`gptq_quantize` — GPTQ (Frantar et al., 2022, Algorithm 1): with the layer's Hessian
  ``H = 2 X^T X / n`` of its calibration inputs, quantize one input column at a time and spread its error
  over the columns not yet quantized, ``W[:, j:] -= e_j * Hinv[j, j:] / Hinv[j, j]``, where ``Hinv`` is the
  upper Cholesky factor of ``(H + damp * mean(diag H) * I)^-1``; lazy batch updates over blocks of
  columns; a group's (scale, zero) found from its *updated* weights when its first column comes up.
  Act-order (columns by decreasing ``diag H``) uses static groups (parameters from the original weights
  per original group) so ``g_idx`` stays ``column // group_size`` and the layout loads unpermuted.
* :func:`calibrate` — sequential over decoder layers: the inputs of layer ``l`` come from layers ``< l``
  already quantized; every linear of the layer is quantized from the same pass (no "true-sequential").

The LM head and the embedding stay unquantized, as GPTQ/AWQ checkpoints keep them by default.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from engine.gptq_awq import IntWeights, awq_config, awq_tensors, gptq_config, gptq_tensors
from engine.model import DenseKVCache, LlamaForCausalLM
from engine.quant import QuantError, _fp16_grid

LAYOUTS = ("gptq", "awq")
METHODS = ("rtn", "gptq")


@dataclass(frozen=True)
class QuantSpec:
    """What to write: layout ``gptq``/``awq``, method ``rtn``/``gptq``, bits, group size, grid options."""

    layout: str = "gptq"
    method: str = "rtn"
    bits: int = 4
    group_size: int = 128
    sym: bool = True
    act_order: bool = False
    damp: float = 0.01

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS or self.method not in METHODS:
            raise QuantError(f"layout {self.layout!r} / method {self.method!r}: expected {LAYOUTS} / {METHODS}")
        if self.layout == "awq" and (self.bits != 4 or self.sym):
            raise QuantError("AWQ GEMM is 4-bit with zero points (bits=4, sym=False)")
        if self.bits not in (4, 8):
            raise QuantError(f"bits {self.bits}: expected 4 or 8")


def grid_params(w: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., g] -> (scale on the fp16 grid, integer zero) [...] per group, GPTQ's or AWQ's grid."""
    maxq = (1 << spec.bits) - 1
    lo, hi = w.amin(-1), w.amax(-1)
    if spec.layout == "awq":                          # AutoAWQ: min/max range, scale floored at 1e-5
        scale = _fp16_grid((hi - lo).clamp(min=1e-5) / maxq)
        return scale, (-(lo / scale).round()).clamp(0, maxq)
    lo, hi = lo.clamp(max=0), hi.clamp(min=0)         # GPTQ: the range always holds 0
    if spec.sym:
        hi = torch.maximum(lo.abs(), hi)
        lo = torch.where(lo < 0, -hi, lo)
    flat = (lo == 0) & (hi == 0)
    lo, hi = torch.where(flat, -1.0, lo), torch.where(flat, 1.0, hi)
    scale = _fp16_grid((hi - lo) / maxq)
    zero = torch.full_like(scale, (maxq + 1) // 2) if spec.sym else (-lo / scale).round().clamp(0, maxq)
    return scale, zero


def _round(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, maxq: int) -> torch.Tensor:
    return ((w / scale).round() + zero).clamp(0, maxq)


def rtn(w: torch.Tensor, spec: QuantSpec) -> IntWeights:
    """Round-to-nearest of w [N, K] on ``spec``'s grid."""
    n, k = w.shape
    g = spec.group_size
    if k % g:
        raise QuantError(f"in_features {k} is not a multiple of group_size {g}")
    groups = w.detach().float().view(n, k // g, g)
    scale, zero = grid_params(groups, spec)
    q = _round(groups, scale[..., None], zero[..., None], (1 << spec.bits) - 1).view(n, k)
    return IntWeights(q.to(torch.int32), scale.to(torch.float16), zero.to(torch.int32), g, spec.bits)


def gptq_quantize(w: torch.Tensor, h: torch.Tensor, spec: QuantSpec, block: int = 128) -> IntWeights:
    """GPTQ of w [N, K] given its input Hessian h [K, K] (module docstring)."""
    n, k = w.shape
    g, maxq = spec.group_size, (1 << spec.bits) - 1
    if k % g:
        raise QuantError(f"in_features {k} is not a multiple of group_size {g}")
    w, h = w.detach().float().clone(), h.double().clone()
    dead = h.diagonal() == 0                           # inputs that were always 0: any weight will do
    h[dead, dead] = 1
    w[:, dead] = 0
    scale, zero = torch.zeros(n, k // g), torch.zeros(n, k // g)
    if spec.act_order:                                  # static groups: from the original weights
        scale, zero = grid_params(w.view(n, k // g, g), spec)
        perm = torch.argsort(h.diagonal(), descending=True)
    else:
        perm = torch.arange(k)
    w, h = w[:, perm], h[perm][:, perm]
    h += spec.damp * h.diagonal().mean() * torch.eye(k, dtype=h.dtype)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True).float()
    q = torch.zeros(n, k, dtype=torch.int32)
    block = g * max(1, block // g)                      # whole groups per block: params from updated weights
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        w1, err, hb = w[:, i1:i2].clone(), torch.zeros(n, i2 - i1), hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = int(perm[i1 + i])
            if not spec.act_order and i % g == 0:
                scale[:, col // g], zero[:, col // g] = grid_params(w1[:, i:i + g], spec)
            s, z = scale[:, col // g], zero[:, col // g]
            qi = _round(w1[:, i], s, z, maxq)
            q[:, col] = qi.to(torch.int32)
            e = (w1[:, i] - s * (qi - z)) / hb[i, i]
            w1[:, i:] -= e[:, None] * hb[i, i:][None, :]
            err[:, i] = e
        w[:, i2:] -= err @ hinv[i1:i2, i2:]
    return IntWeights(q, scale.to(torch.float16), zero.to(torch.int32), g, spec.bits)


def _decoder_linears(layer: nn.Module) -> dict[str, nn.Linear]:
    return {name: mod for name, mod in layer.named_modules() if isinstance(mod, nn.Linear)}


def _swap(root: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, new)


@torch.inference_mode()
def _run_layer(model: LlamaForCausalLM, li: int, h: torch.Tensor) -> torch.Tensor:
    """Decoder layer ``li`` on one calibration sequence's hidden states h [T, hidden]."""
    return model.run_layers(h, torch.arange(h.shape[0]), DenseKVCache(model.config, h.shape[0]), li, li + 1)


def _hessians(model: LlamaForCausalLM, li: int, hs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """H = 2 X^T X / n of every linear of layer ``li`` over the calibration inputs."""
    linears = _decoder_linears(model.layers[li])
    acc = {name: [torch.zeros(m.in_features, m.in_features, dtype=torch.float64), 0] for name, m in linears.items()}

    def hook(name):
        def add(_mod, args):
            x = args[0].reshape(-1, args[0].shape[-1]).float()    # [rows, K]
            acc[name][0] += (x.T @ x).double()                    # one sequence in fp32, the sum in fp64
            acc[name][1] += x.shape[0]
        return add

    handles = [m.register_forward_pre_hook(hook(name)) for name, m in linears.items()]
    try:
        for h in hs:
            _run_layer(model, li, h)
    finally:
        for hd in handles:
            hd.remove()
    return {name: 2 * a / max(n, 1) for name, (a, n) in acc.items()}


def quantize_layers(model: LlamaForCausalLM, spec: QuantSpec, calib: list[list[int]] | None = None,
                    log=None) -> dict[str, IntWeights]:
    """Quantize every decoder linear of ``model`` in place (each swapped for its int4 layer); return the
    integers by module name. ``method = "gptq"`` needs ``calib`` (token id sequences)."""
    if spec.method == "gptq" and not calib:
        raise QuantError("GPTQ needs calibration sequences")
    out: dict[str, IntWeights] = {}
    hs = ([model.embed(torch.tensor(ids)).detach() for ids in calib] if spec.method == "gptq" else [])
    for li, layer in enumerate(model.layers):
        hess = _hessians(model, li, hs) if hs else {}
        for name, lin in _decoder_linears(layer).items():
            iw = gptq_quantize(lin.weight, hess[name], spec) if hs else rtn(lin.weight, spec)
            out[f"model.layers.{li}.{name}"] = iw
            _swap(layer, name, iw.to_linear(lin.bias, kind=f"{spec.layout}-{spec.method}"))
        if hs:
            hs = [_run_layer(model, li, h) for h in hs]
        if log:
            log(f"layer {li + 1}/{len(model.layers)} quantized ({spec.method})")
    return out


def save_layout_folder(model: LlamaForCausalLM, layers: dict[str, IntWeights], spec: QuantSpec,
                       folder: str | Path) -> list[Path]:
    """config.json (with a GPTQ/AWQ ``quantization_config``) + model.safetensors in that layout; the
    unquantized tensors (norms, embedding, biases) as the model holds them."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items() if v.device.type != "meta"}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    for name, iw in layers.items():
        state.pop(f"{name}.weight", None)
        state.update(gptq_tensors(name, iw, v1=spec.sym) if spec.layout == "gptq" else awq_tensors(name, iw))
    cfg = model.config.to_hf_dict()
    cfg["quantization_config"] = (
        gptq_config(spec.bits, spec.group_size, spec.sym, spec.act_order, spec.damp, spec.method)
        if spec.layout == "gptq" else awq_config(spec.group_size))
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return [folder / "config.json", folder / "model.safetensors"]


def default_calibration_text() -> str:
    """Python's own reference-manual topics (``pydoc_data``): offline English prose, apart from the
    bench's chat prompts and its perplexity text (CPython's LICENSE)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def calibration_ids(token_ids: list[int], samples: int, seq_len: int) -> list[list[int]]:
    """``samples`` sequences of ``seq_len`` tokens taken evenly spaced from one long token list."""
    if len(token_ids) < samples * seq_len:
        raise QuantError(f"calibration text has {len(token_ids)} tokens, need {samples} x {seq_len}")
    stride = len(token_ids) // samples
    return [token_ids[i * stride:i * stride + seq_len] for i in range(samples)]


def chat_calibration_ids(tokenizer, text: str, samples: int, seq_len: int) -> list[list[int]]:
    """``samples`` evenly spaced pieces of ``text``, each as a user message in the model's chat template,
    cut to ``seq_len`` tokens: the calibration then holds the template's tokens (system prompt, role
    markers) whose activations a served model sees in every request. Measured on the default model
    (docs/benchmarks.md): GPTQ calibrated on plain text lowered KL on that text's domain only; on chat
    prompts it was no better than RTN until calibrated in the chat format."""
    stride, chars = len(text) // samples, 8 * seq_len
    if stride < seq_len:
        raise QuantError(f"calibration text of {len(text)} characters is too short for {samples} samples")
    return [tokenizer.apply_chat_template([{"role": "user", "content": text[i * stride:i * stride + chars]}])
            [:seq_len] for i in range(samples)]


def quantize_to_folder(model: LlamaForCausalLM, tokenizer, spec: QuantSpec, folder: str | Path,
                       calib_text: str | None = None, samples: int = 128, seq_len: int = 256,
                       chat: bool = True, log=None) -> dict[str, IntWeights]:
    """Quantize ``model`` in place by ``spec`` (GPTQ calibrated on ``samples`` x ``seq_len`` tokens of
    ``calib_text``, default :func:`default_calibration_text`; in the chat template when ``chat`` and the
    tokenizer has one) and write it as a GPTQ/AWQ folder."""
    calib = None
    if spec.method == "gptq":
        text = calib_text if calib_text is not None else default_calibration_text()
        if chat and tokenizer.has_chat_template:
            calib = chat_calibration_ids(tokenizer, text, samples, seq_len)
        else:
            calib = calibration_ids(tokenizer.encode(text), samples, seq_len)
    layers = quantize_layers(model, spec, calib, log)
    save_layout_folder(model, layers, spec, folder)
    return layers
