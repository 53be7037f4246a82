"""Model configuration for the Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from engine.errors import UnsupportedModelError

# model_type -> does it carry a bias on q/k/v by default
SUPPORTED_MODEL_TYPES = {"llama": False, "mistral": False, "qwen2": True}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder.

    Built from a Hugging Face ``config.json`` with :meth:`from_hf_dict`; validated on construction.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    max_position_embeddings: int = 2048
    model_type: str = "llama"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {self.model_type!r} is not supported; supported: {sorted(SUPPORTED_MODEL_TYPES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))
            if kind not in ("default", "llama3", "linear"):
                raise UnsupportedModelError(f"rope_scaling type {kind!r} is not supported")

    @property
    def q_per_kv(self) -> int:
        """Query heads sharing one KV head (GQA group size)."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def eos_token_ids(self) -> list[int]:
        """End-of-sequence ids as a list (configs store an int or a list)."""
        if self.eos_token_id is None:
            return []
        return [self.eos_token_id] if isinstance(self.eos_token_id, int) else list(self.eos_token_id)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from the dict of a Hugging Face ``config.json``."""
        model_type = d.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            archs = d.get("architectures") or []
            raise UnsupportedModelError(
                f"unsupported architecture {model_type!r} {archs}; supported model types: "
                f"{sorted(SUPPORTED_MODEL_TYPES)}"
            )
        heads = d["num_attention_heads"]
        rope = d.get("rope_parameters") or {}  # transformers >= 5 keeps theta/scaling here
        hidden = d["hidden_size"]
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=hidden,
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or hidden // heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=d.get("rope_theta") or rope.get("rope_theta", 10000.0),
            rope_scaling=d.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None),
            tie_word_embeddings=d.get("tie_word_embeddings", False),
            attention_bias=d.get("attention_bias", SUPPORTED_MODEL_TYPES[model_type]),
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            model_type=model_type,
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
        )

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        """Read a ``config.json``."""
        path = Path(path)
        try:
            return cls.from_hf_dict(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError, KeyError) as exc:
            raise UnsupportedModelError(f"{path}: cannot read model config: {exc}") from exc

    def to_hf_dict(self) -> dict[str, Any]:
        """The config as a Hugging Face ``config.json`` dict (round-trips through from_hf_dict)."""
        d = dataclasses.asdict(self)
        d["architectures"] = [{"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                               "qwen2": "Qwen2ForCausalLM"}[self.model_type]]
        return d
