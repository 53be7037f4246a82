"""Load Llama-family weights from a Hugging Face folder (safetensors) or a GGUF file.

A model *folder* holds ``config.json``, ``*.safetensors`` (sharded or not, with or without an index) and
tokenizer files. A GGUF file is dequantized on load through transformers' GGUF reader (which uses the
``gguf`` package) — no GGUF parser of our own.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from engine.config import ModelConfig
from engine.errors import ModelLoadError, UnsupportedModelError
from engine.model import LlamaForCausalLM

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


def load_hf_folder(folder: str | Path, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    """Load a Hugging Face model folder (config.json + safetensors)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ModelLoadError(f"{folder}: not a directory")
    cfg_path = folder / "config.json"
    if not cfg_path.exists():
        raise ModelLoadError(f"{cfg_path}: missing (a model folder needs config.json)")
    cfg = ModelConfig.from_file(cfg_path)
    return build_model(cfg, read_safetensors(safetensors_files(folder)), str(folder), dtype)


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


def load_model(path: str | Path, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    """Load a model folder or a ``.gguf`` file."""
    path = Path(path)
    if path.suffix == ".gguf":
        return load_gguf(path, dtype)
    return load_hf_folder(path, dtype)


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
