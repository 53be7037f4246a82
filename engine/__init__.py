"""cipherlm's model engine: Llama-family model, loaders, tokenizer, paged KV cache, scheduler, sampler."""

from engine.config import ModelConfig
from engine.default_model import default_model_dir
from engine.errors import (
    EngineError,
    EngineOverloadedError,
    InvalidRequestError,
    ModelLoadError,
    UnsupportedModelError,
)
from engine.loader import load_model
from engine.model import DenseKVCache, LlamaForCausalLM, greedy_generate
from engine.tokenizer import IncrementalDetokenizer, Tokenizer

__all__ = [
    "DenseKVCache",
    "EngineError",
    "EngineOverloadedError",
    "IncrementalDetokenizer",
    "InvalidRequestError",
    "LlamaForCausalLM",
    "ModelConfig",
    "ModelLoadError",
    "Tokenizer",
    "UnsupportedModelError",
    "default_model_dir",
    "greedy_generate",
    "load_model",
]
