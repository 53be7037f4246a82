"""cipherlm's model engine: Llama-family model, loaders, tokenizer, paged KV cache, scheduler, sampler."""

from engine.async_llm import AsyncLLM
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
