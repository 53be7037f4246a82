"""The private-mode client bundle: exactly the weights and files a client needs, in one file.

A bundle is a safetensors file. Its tensors are the model's state dict *minus* what stays on the server:
for every encrypted layer, the attention projections (q/k/v/o weights and biases) and the input RMSNorm
gain (folded into the server's projections; the client only normalizes). Its metadata (string → string)
carries ``config.json``, the tokenizer files, the plan hash and the list of withheld tensors. The SHA-256
of the file's bytes is published in the manifest; the SDK verifies it before loading.

An offload plan (:mod:`fhe.offload`) withholds more: every tensor of every server-side part — a server
attention block's projections and input norm gain, a server MLP's gate/up/down and post-attention norm
gain — so the bundle holds only what the client runs (:func:`write_offload_bundle`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from engine.config import ModelConfig
from engine.loader import build_model
from engine.model import LlamaForCausalLM
from fhe import quant
from fhe.offload import OffloadPlan

BUNDLE_FORMAT = "cipherlm-client-bundle"
BUNDLE_VERSION = 1
#: a bundle with block-quantized tensors (:mod:`fhe.quant`) is version 2; unquantized ones stay version 1
QUANTIZED_VERSION = 2
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
SERVER_SIDE = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
               "self_attn.o_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.bias",
               "self_attn.v_proj.bias", "input_layernorm.weight")
#: what a server-side MLP block keeps on the server (the gain folds into gate and up)
SERVER_SIDE_MLP = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                   "post_attention_layernorm.weight")


class BundleError(ValueError):
    """A bundle is malformed, of another version, or does not match its manifest."""


def withheld_names(cfg: ModelConfig, encrypted_layers: tuple[int, ...]) -> list[str]:
    """State-dict names that never leave the server for this plan."""
    suffixes = [s for s in SERVER_SIDE if cfg.attention_bias or not s.endswith("bias")]
    return [f"model.layers.{i}.{s}" for i in encrypted_layers for s in suffixes]


def offload_withheld_names(cfg: ModelConfig, plan: OffloadPlan) -> list[str]:
    """State-dict names of every server-side part of an offload plan (never in the client bundle)."""
    names = withheld_names(cfg, plan.server_attention)
    return names + [f"model.layers.{i}.{s}" for i in plan.server_mlp for s in SERVER_SIDE_MLP]


def write_bundle(model: LlamaForCausalLM, tokenizer_dir: Path, encrypted_layers: tuple[int, ...],
                 plan_hash: str, path: Path) -> dict:
    """Write the bundle for ``encrypted_layers``; returns its description (tensor names, withheld)."""
    withheld = withheld_names(model.config, encrypted_layers)
    return _write(model, tokenizer_dir, withheld, encrypted_layers, plan_hash, path)


def write_offload_bundle(model: LlamaForCausalLM, tokenizer_dir: Path, plan: OffloadPlan, path: Path, *,
                         quantize: bool = False) -> dict:
    """Write the bundle of an offload plan: only the tensors of the parts the client runs.

    ``encrypted_layers`` in its metadata lists the layers with any server-side part; ``plan_hash`` is
    the offload plan's content hash. ``quantize``: store each tensor that is exactly a Q4_1/Q8_0
    dequantization (the default model's weights) as its blocks, losslessly (:mod:`fhe.quant`).
    """
    if model.config.to_hf_dict() != plan.model_config.to_hf_dict():
        raise BundleError("the offload plan was made for another model shape")
    enc = tuple(sorted(set(plan.server_attention) | set(plan.server_mlp)))
    return _write(model, tokenizer_dir, offload_withheld_names(model.config, plan), enc, plan.content_hash, path,
                  quantize)


def _quantize(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, list]]:
    """Tensors that pack losslessly replaced by their parts (``name#kind.part``); the index of them."""
    out, index = {}, {}
    for name, t in state.items():
        packed = quant.pack(t)
        if packed is None:
            out[name] = t
            continue
        kind, parts = packed
        index[name] = [kind, list(t.shape)]
        out.update({f"{name}#{kind}.{p}": v.contiguous() for p, v in parts.items()})
    return out, index


def _dequantize(state: dict[str, torch.Tensor], index: dict, path: Path) -> dict[str, torch.Tensor]:
    out = {k: v for k, v in state.items() if "#" not in k}
    try:
        for name, (kind, shape) in index.items():
            prefix = f"{name}#{kind}."
            parts = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
            out[name] = quant.unpack(kind, parts, tuple(int(n) for n in shape))
    except (TypeError, ValueError, AttributeError) as exc:
        raise BundleError(f"{path}: bad quantized tensor: {exc}") from exc
    return out


def _write(model: LlamaForCausalLM, tokenizer_dir: Path, withheld: list[str], encrypted_layers: tuple[int, ...],
           plan_hash: str, path: Path, quantize: bool = False) -> dict:
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()
             if k not in withheld and not (model.config.tie_word_embeddings and k == "lm_head.weight")}
    names = sorted(state)
    index: dict[str, list] = {}
    if quantize:
        state, index = _quantize(state)
    files = {n: (tokenizer_dir / n).read_text() for n in TOKENIZER_FILES if (tokenizer_dir / n).exists()}
    meta = {"format": BUNDLE_FORMAT, "version": str(BUNDLE_VERSION), "plan_hash": plan_hash,
            "config.json": json.dumps(model.config.to_hf_dict()), "withheld": json.dumps(withheld),
            "encrypted_layers": json.dumps(list(encrypted_layers)), "files": json.dumps(sorted(files))}
    meta.update({f"file:{n}": text for n, text in files.items()})
    if index:
        meta.update({"version": str(QUANTIZED_VERSION), "quantized": json.dumps(index)})
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path), metadata=meta)
    return {"tensors": names, "withheld": withheld, "files": sorted(files), "quantized": sorted(index)}


def read_bundle(path: Path, files_dir: Path) -> tuple[LlamaForCausalLM, dict]:
    """Load a bundle: the client's model (withheld tensors left on ``meta``) and its metadata.

    The tokenizer files are written to ``files_dir`` (load them with ``Tokenizer.from_folder``).
    """
    try:
        with safe_open(str(path), framework="pt") as fh:
            meta = fh.metadata() or {}
            state = {k: fh.get_tensor(k) for k in fh.keys()}
    except (SafetensorError, OSError, ValueError) as exc:
        raise BundleError(f"{path}: not a readable bundle: {exc}") from exc
    if meta.get("format") != BUNDLE_FORMAT or meta.get("version") not in (str(BUNDLE_VERSION), str(QUANTIZED_VERSION)):
        raise BundleError(f"{path}: not a version-{BUNDLE_VERSION} or -{QUANTIZED_VERSION} cipherlm client bundle")
    if meta["version"] == str(QUANTIZED_VERSION):
        try:
            index = json.loads(meta["quantized"])
        except (KeyError, ValueError) as exc:
            raise BundleError(f"{path}: quantized bundle without a valid index") from exc
        state = _dequantize(state, index, path)
    cfg = ModelConfig.from_hf_dict(json.loads(meta["config.json"]))
    model = build_model(cfg, state, str(path), torch.float32, absent=frozenset(json.loads(meta["withheld"])))
    files_dir.mkdir(parents=True, exist_ok=True)
    for name in json.loads(meta["files"]):
        if name not in TOKENIZER_FILES:
            raise BundleError(f"{path}: unexpected file {name!r} in bundle")
        (files_dir / name).write_text(meta[f"file:{name}"])
    return model, meta
