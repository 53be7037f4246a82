"""cipherlm's model engine: Llama-family model, loaders, tokenizer, paged KV cache, scheduler, sampler.

The public names below are imported lazily (PEP 562): ``import engine.errors`` or
``engine.default_model`` does not pull in torch, so the ``cipherlm`` command line can print its help,
and the thread policy (:mod:`engine.threads`) can set OpenMP's environment, before torch loads.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# public name -> the module that defines it
_EXPORTS = {
    "AsyncLLM": "engine.async_llm",
    "BeamSearchOutput": "engine.beam_search",
    "BeamSearchParams": "engine.beam_search",
    "ModelConfig": "engine.config",
    "default_model_dir": "engine.default_model",
    "EngineConfig": "engine.engine_config",
    "EngineError": "engine.errors",
    "EngineOverloadedError": "engine.errors",
    "InvalidRequestError": "engine.errors",
    "ModelLoadError": "engine.errors",
    "UnsupportedModelError": "engine.errors",
    "LLM": "engine.llm",
    "LLMEngine": "engine.llm_engine",
    "load_model": "engine.loader",
    "VLLM_METRIC_NAMES": "engine.metrics",
    "EngineStats": "engine.metrics",
    "MetricsListener": "engine.metrics",
    "RequestStats": "engine.metrics",
    "DenseKVCache": "engine.model",
    "LlamaForCausalLM": "engine.model",
    "greedy_generate": "engine.model",
    "CompletionOutput": "engine.outputs",
    "RequestMetrics": "engine.outputs",
    "RequestOutput": "engine.outputs",
    "SamplingParams": "engine.sampling_params",
    "IncrementalDetokenizer": "engine.tokenizer",
    "Tokenizer": "engine.tokenizer",
}

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
    # serving engine
    "AsyncLLM",
    "BeamSearchOutput",
    "BeamSearchParams",
    "CompletionOutput",
    "EngineConfig",
    "EngineStats",
    "LLM",
    "LLMEngine",
    "MetricsListener",
    "RequestMetrics",
    "RequestOutput",
    "RequestStats",
    "SamplingParams",
    "VLLM_METRIC_NAMES",
]

if TYPE_CHECKING:  # static analysers see the eager imports
    from engine.async_llm import AsyncLLM
    from engine.beam_search import BeamSearchOutput, BeamSearchParams
    from engine.config import ModelConfig
    from engine.default_model import default_model_dir
    from engine.engine_config import EngineConfig
    from engine.errors import (
        EngineError,
        EngineOverloadedError,
        InvalidRequestError,
        ModelLoadError,
        UnsupportedModelError,
    )
    from engine.llm import LLM
    from engine.llm_engine import LLMEngine
    from engine.loader import load_model
    from engine.metrics import VLLM_METRIC_NAMES, EngineStats, MetricsListener, RequestStats
    from engine.model import DenseKVCache, LlamaForCausalLM, greedy_generate
    from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
    from engine.sampling_params import SamplingParams
    from engine.tokenizer import IncrementalDetokenizer, Tokenizer


def __getattr__(name: str) -> Any:
    """Import a public name's module on first access (and cache the name here)."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
