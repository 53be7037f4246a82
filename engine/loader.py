"""Load Llama-family weights from a Hugging Face folder (safetensors) or a GGUF file.

A model *folder* holds ``config.json``, ``*.safetensors`` (sharded or not, with or without an index) and
tokenizer files. A GGUF file is dequantized on load through transformers' GGUF reader (which uses the
``gguf`` package) — no GGUF parser of our own.

``weight_format`` (``engine.quant.WEIGHT_FORMATS``) picks what the linears hold:

* ``fp32`` (default) — everything dequantized to fp32, as before;
* ``native`` — quantized tensors stay as stored: a GGUF's Q4_1 / Q8_0 / Q4_K blocks (read with
  ``gguf.GGUFReader``, decoded into ``engine.quant`` layers without an fp32 copy), a folder written by
  :func:`save_quantized_folder` (``cipherlm model quantize``), or a GPTQ / AWQ (GEMM) checkpoint
  (``engine.gptq_awq``: its integers straight into the int4 layers); an fp32 source stays fp32;
* ``int8`` / ``int8-channel`` / ``int4`` — load fp32, then round-to-nearest quantize every linear
  (``engine.quant``; int4 keeps the head at int8).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from engine import gptq_awq
from engine.config import ModelConfig
from engine.errors import ModelLoadError, UnsupportedModelError
from engine.model import LlamaForCausalLM
from engine.quant import (
    GGUF_DECODERS,
    WEIGHT_FORMATS,
    Int4Linear,
    Int4Plane,
    Int8Linear,
    QuantError,
    QuantLinear,
    pack_int4,
    quantize_model,
    tie_embedding,
    unpack_int4,
)

_SKIP_SUFFIXES = ("rotary_emb.inv_freq",)


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files of a model folder, honouring ``model.safetensors.index.json`` when present."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError) as exc:
            raise ModelLoadError(f"{index}: corrupt index: {exc}") from exc
        files = [folder / n for n in names]
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise ModelLoadError(f"{index} names shard files that are missing: {missing}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder}: no *.safetensors weight files")
    return files


def read_safetensors(files: list[Path]) -> dict[str, torch.Tensor]:
    """All tensors of the files; a corrupt or truncated file raises ModelLoadError naming it."""
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as fh:
                for name in fh.keys():
                    tensors[name] = fh.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
            raise ModelLoadError(f"{f}: cannot read safetensors file (corrupt or truncated?): {exc}") from exc
    return tensors


def build_model(cfg: ModelConfig, state: dict[str, torch.Tensor], source: str,
                dtype: torch.dtype = torch.float32, absent: frozenset[str] = frozenset()) -> LlamaForCausalLM:
    """Instantiate the model and copy ``state`` in, checking every name and shape.

    ``absent`` names tensors that are deliberately not there (a private-mode client bundle lacks the
    encrypted layers' attention weights); they stay on the ``meta`` device, so any use of them fails loudly.
    """
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    expected = dict(model.state_dict())
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    state = {k: v for k, v in state.items() if not k.endswith(_SKIP_SUFFIXES)}
    missing = sorted(set(expected) - set(state) - absent)
    if missing:
        raise ModelLoadError(f"{source}: missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    unexpected = sorted(set(state) - set(expected))
    if unexpected:
        raise UnsupportedModelError(
            f"{source}: tensors this architecture does not use: {unexpected[:5]}"
            f"{' ...' if len(unexpected) > 5 else ''}")
    for name, t in state.items():
        if tuple(t.shape) != tuple(expected[name].shape):
            raise ModelLoadError(f"{source}: tensor {name} has shape {tuple(t.shape)}, "
                                 f"the config implies {tuple(expected[name].shape)}")
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.rotary = type(model.rotary)(cfg)  # buffers are not in the state dict: rebuild off meta
    return model.eval()


def load_hf_folder(folder: str | Path, dtype: torch.dtype = torch.float32,
                   native: bool = False) -> LlamaForCausalLM:
    """Load a Hugging Face model folder (config.json + safetensors); a quantized folder (written by
    :func:`save_quantized_folder`) keeps its quantized layers when ``native``, else is dequantized."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ModelLoadError(f"{folder}: not a directory")
    cfg_path = folder / "config.json"
    if not cfg_path.exists():
        raise ModelLoadError(f"{cfg_path}: missing (a model folder needs config.json)")
    cfg = ModelConfig.from_file(cfg_path)
    state = read_safetensors(safetensors_files(folder))
    qcfg = json.loads(cfg_path.read_text()).get("quantization_config")
    if not qcfg:
        return build_model(cfg, state, str(folder), dtype)
    method = qcfg.get("quant_method")
    if method == QUANT_METHOD:
        layers = quantized_layers(state, qcfg.get("layers", {}), str(folder))
    elif method in gptq_awq.METHODS:
        layers = gptq_awq.read_layers(state, qcfg, str(folder))
    else:
        raise UnsupportedModelError(f"{folder}: quantization {method!r} is not supported (this loader reads "
                                    f"{QUANT_METHOD!r}, {', '.join(map(repr, gptq_awq.METHODS))} folders)")
    model = build_quantized(cfg, state, layers, str(folder))
    return model if native else dequantize_model(model)


def dequantize_model(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """Replace every quantized layer by an fp32 ``nn.Linear`` holding its exact dequantized weight."""
    tied = isinstance(model.model.embed_tokens, torch.nn.Module) and model.config.tie_word_embeddings
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, QuantLinear):
                lin = torch.nn.Linear(child.in_features, child.out_features, bias=child.bias is not None,
                                      device="meta")  # no random init: both parameters are replaced
                lin.weight = torch.nn.Parameter(child.dequantize(), requires_grad=False)
                if child.bias is not None:
                    lin.bias = child.bias
                setattr(parent, name, lin)
    if tied and not isinstance(model.model.embed_tokens, torch.nn.Embedding):
        emb = torch.nn.Embedding(model.config.vocab_size, model.config.hidden_size, device="meta")
        emb.weight = model.lm_head.weight
        model.model.embed_tokens = emb
    return model.eval()


def read_gguf(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Dequantize a GGUF file into (config, HF-named fp32 state dict) with transformers' GGUF reader."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"{path}: no such GGUF file")
    try:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    except ValueError as exc:
        if "architecture" in str(exc).lower():
            raise UnsupportedModelError(f"{path}: unsupported GGUF architecture: {exc}") from exc
        raise ModelLoadError(f"{path}: cannot read GGUF (corrupt, truncated or unsupported): {exc}") from exc
    except (KeyError, OSError, IndexError, TypeError, RuntimeError, AssertionError) as exc:
        raise ModelLoadError(f"{path}: cannot read GGUF (corrupt, truncated or unsupported): {exc}") from exc
    cfg = ModelConfig.from_hf_dict(hf.config.to_dict())
    state = {k: v.detach().float() for k, v in hf.state_dict().items()}
    return cfg, state


def load_gguf(path: str | Path, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    """Load a GGUF file, dequantized."""
    cfg, state = read_gguf(path)
    return build_model(cfg, state, str(path), dtype)


# GGUF tensor names -> HF names (llama.cpp's convert_hf_to_gguf, Llama family)
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def _hf_name(gguf_name: str) -> str | None:
    stem, _, kind = gguf_name.rpartition(".")
    if stem in _GGUF_TOP_NAMES:
        return f"{_GGUF_TOP_NAMES[stem]}.{kind}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _GGUF_LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}.{kind}"
    return None


def _rope_rows(n_rows: int, n_head: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's q/k permutation (transformers' ``_reverse_permute_weights``)."""
    dim = n_rows // n_head // 2
    return torch.arange(n_rows).reshape(n_head, dim, 2).transpose(1, 2).reshape(n_rows)


def gguf_config(path: Path) -> ModelConfig:
    """The model config of a GGUF file (its metadata, through transformers), without reading weights."""
    try:
        from transformers import AutoConfig

        hf_cfg = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    except (ValueError, KeyError, OSError, IndexError, TypeError, RuntimeError, AssertionError) as exc:
        raise ModelLoadError(f"{path}: cannot read GGUF metadata (corrupt, truncated or unsupported): "
                             f"{exc}") from exc
    return ModelConfig.from_hf_dict(hf_cfg.to_dict())


def read_gguf_native(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor], dict[str, QuantLinear]]:
    """(config, fp32 tensors, quantized layers by HF module name) of a GGUF file, blocks kept as stored."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"{path}: no such GGUF file")
    cfg = gguf_config(path)
    try:
        from gguf import GGUFReader

        tensors = GGUFReader(str(path)).tensors
    except (ValueError, KeyError, OSError, IndexError, TypeError) as exc:
        raise ModelLoadError(f"{path}: cannot read GGUF tensors: {exc}") from exc
    state: dict[str, torch.Tensor] = {}
    quant: dict[str, QuantLinear] = {}
    for t in tensors:
        name = _hf_name(t.name)
        if name is None:
            raise UnsupportedModelError(f"{path}: tensor {t.name} does not belong to a Llama-family model")
        data = torch.from_numpy(t.data.copy())
        heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}.get(name.split(".")[-2])
        kind = t.tensor_type.name
        if kind in ("F32", "F16", "BF16"):
            w = data.float().reshape(tuple(reversed(t.shape.tolist())))
            state[name] = w[_rope_rows(w.shape[0], heads)] if heads else w
        elif kind in GGUF_DECODERS:
            raw = data[_rope_rows(data.shape[0], heads)] if heads else data
            try:
                quant[name.removesuffix(".weight")] = GGUF_DECODERS[kind](raw)
            except QuantError as exc:
                raise ModelLoadError(f"{path}: tensor {t.name} ({kind}): {exc}") from exc
        else:
            raise UnsupportedModelError(f"{path}: tensor {t.name} is {kind}; the native loader reads "
                                        f"F32/F16/BF16, {', '.join(GGUF_DECODERS)} (use weight_format='fp32')")
    return cfg, state, quant


def build_quantized(cfg: ModelConfig, state: dict[str, torch.Tensor], quant: dict[str, QuantLinear],
                    source: str) -> LlamaForCausalLM:
    """Build the model from fp32 tensors plus quantized layers (their weights never exist in fp32)."""
    quant = dict(quant)
    if cfg.tie_word_embeddings and "model.embed_tokens" in quant:  # the tied head is the embedding
        quant.setdefault("lm_head", quant.pop("model.embed_tokens"))
    absent = {f"{name}.weight" for name in quant}
    if cfg.tie_word_embeddings and "lm_head" in quant:
        absent.add("model.embed_tokens.weight")
    model = build_model(cfg, state, source, absent=frozenset(absent))
    for name, layer in quant.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, child, None)
        if not isinstance(old, torch.nn.Linear):
            raise UnsupportedModelError(f"{source}: quantized tensor {name} is not a linear layer")
        if (old.out_features, old.in_features) != (layer.out_features, layer.in_features):
            raise ModelLoadError(f"{source}: quantized {name} is {layer.out_features}x{layer.in_features}, "
                                 f"the config implies {old.out_features}x{old.in_features}")
        if old.bias is not None:
            layer.bias = old.bias
        setattr(parent, child, layer)
    tie_embedding(model)
    return model


def load_gguf_native(path: str | Path) -> LlamaForCausalLM:
    """Load a GGUF file with its quantized blocks kept as they are (``weight_format='native'``)."""
    cfg, state, quant = read_gguf_native(path)
    return build_quantized(cfg, state, quant, str(path))


def load_model(path: str | Path, dtype: torch.dtype = torch.float32,
               weight_format: str = "fp32", group_size: int = 32) -> LlamaForCausalLM:
    """Load a model folder or a ``.gguf`` file with its linears in ``weight_format`` (module docstring)."""
    if weight_format not in WEIGHT_FORMATS:
        raise ModelLoadError(f"unknown weight_format {weight_format!r} (expected one of {WEIGHT_FORMATS})")
    path = Path(path)
    if weight_format == "native":
        return load_gguf_native(path) if path.suffix == ".gguf" else load_hf_folder(path, dtype, native=True)
    model = load_gguf(path, dtype) if path.suffix == ".gguf" else load_hf_folder(path, dtype)
    try:
        quantize_model(model, weight_format, group_size)
    except QuantError as exc:
        raise ModelLoadError(f"{path}: cannot quantize to {weight_format}: {exc}") from exc
    return model


# ---- quantized folders (``cipherlm model quantize``) -----------------------------------------------
# Portable layout, not the kernel's: int4 ``qweight`` [N, K/2] uint8 with column 2i in the low nibble and
# 2i+1 in the high one, ``scales``/``offsets`` [N, K/group] (w = scale * u + offset); two planes (Q8_0)
# add ``.1`` to the names; int8-channel ``qweight`` [N, K] int8 with ``scales`` [N].
QUANT_METHOD = "cipherlm"


def _int4_tensors(prefix: str, layer: Int4Linear) -> dict[str, torch.Tensor]:
    out = {}
    for i, p in enumerate(layer.planes):
        tag = "" if i == 0 else f".{i}"
        u = unpack_int4(p.packed)
        out[f"{prefix}.qweight{tag}"] = (u[:, 0::2] | (u[:, 1::2] << 4)).contiguous()
        out[f"{prefix}.scales{tag}"], out[f"{prefix}.offsets{tag}"] = p.scale.contiguous(), p.offset.contiguous()
    return out


def quantized_state(model: LlamaForCausalLM) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """(tensors to save, {layer name: {"kind", "group_size", "planes"}}) of a quantized model."""
    state: dict[str, torch.Tensor] = {}
    layers: dict[str, dict] = {}
    for name, mod in model.named_modules(remove_duplicate=False):
        if name.startswith("model.embed_tokens."):  # a tied lookup over the head: saved as lm_head
            continue
        if isinstance(mod, Int4Linear):
            state.update(_int4_tensors(name, mod))
            layers[name] = {"kind": mod.kind, "group_size": mod.group_size, "planes": len(mod.planes)}
        elif isinstance(mod, Int8Linear):
            state[f"{name}.qweight"], state[f"{name}.scales"] = mod.q, mod.scale
            layers[name] = {"kind": "int8-channel"}
        if isinstance(mod, QuantLinear) and mod.bias is not None:
            state[f"{name}.bias"] = mod.bias.detach()
    quant_prefixes = tuple(f"{n}." for n in layers)
    for k, v in model.state_dict().items():
        if not k.startswith(quant_prefixes) and v.device.type != "meta":
            state.setdefault(k, v.contiguous())
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
        if "lm_head" in layers:
            state.pop("model.embed_tokens.weight", None)
    return state, layers


def save_quantized_folder(model: LlamaForCausalLM, folder: str | Path) -> list[Path]:
    """Write a quantized model as config.json (with ``quantization_config``) + model.safetensors."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state, layers = quantized_state(model)
    cfg = model.config.to_hf_dict()
    cfg["quantization_config"] = {"quant_method": QUANT_METHOD, "layers": layers}
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return [folder / "config.json", folder / "model.safetensors"]


def _load_int4(state: dict[str, torch.Tensor], name: str, spec: dict) -> Int4Linear:
    planes = []
    for i in range(int(spec.get("planes", 1))):
        tag = "" if i == 0 else f".{i}"
        qw = state.pop(f"{name}.qweight{tag}")
        u = torch.stack([qw & 15, qw >> 4], dim=-1).reshape(qw.shape[0], -1)
        planes.append(Int4Plane(pack_int4(u), state.pop(f"{name}.scales{tag}"), state.pop(f"{name}.offsets{tag}")))
    return Int4Linear(planes, int(spec["group_size"]), planes[0].packed.shape[1] * 2, kind=spec["kind"])


def quantized_layers(state: dict[str, torch.Tensor], layers: dict[str, dict], source: str
                     ) -> dict[str, QuantLinear]:
    """Pop the quantized tensors of ``layers`` out of ``state`` and build their layers."""
    out: dict[str, QuantLinear] = {}
    for name, spec in layers.items():
        try:
            if spec["kind"] == "int8-channel":
                out[name] = Int8Linear(state.pop(f"{name}.qweight"), state.pop(f"{name}.scales"))
            else:
                out[name] = _load_int4(state, name, spec)
        except (KeyError, QuantError, RuntimeError) as exc:
            raise ModelLoadError(f"{source}: quantized layer {name}: {exc}") from exc
    return out


def save_hf_folder(model: LlamaForCausalLM, folder: str | Path) -> list[Path]:
    """Write config.json + model.safetensors (tied head stored once). Returns the files written."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    (folder / "config.json").write_text(json.dumps(model.config.to_hf_dict(), indent=2))
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return [folder / "config.json", folder / "model.safetensors"]
