"""The parts an :class:`~engine.llm_engine.LLMEngine` is built from, as injectable factories.

``LLMEngine(model, tokenizer, config, parts=EngineParts(...))`` swaps any part; each default is today's
construction. The engine builds them in dependency order: executor (which sizes the KV pool) -> block
manager -> scheduler; sampler and output processor after. The tokenizer is the engine's own argument.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from engine.block_manager import BlockManager
from engine.engine_config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from engine.executor import Executor, make_executor
from engine.model import LlamaForCausalLM
from engine.output_processor import OutputProcessor
from engine.sampler import Sampler
from engine.scheduler import Scheduler
from engine.spec_decode import SpecDecoder
from engine.tokenizer import Tokenizer


def default_block_manager(num_blocks: int, config: CacheConfig) -> BlockManager:
    """The ref-counted block manager with the salted prefix cache."""
    return BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)


@dataclasses.dataclass
class EngineParts:
    """Factories of the engine's parts.

    Attributes:
        executor: ``(model, engine_config, max_model_len) -> Executor`` — runs steps, owns the KV pool
            (default: in process, or tensor-parallel ranks when ``tensor_parallel_size > 1``).
        block_manager: ``(num_blocks, cache_config) -> BlockManager``.
        scheduler: ``(scheduler_config, block_manager) -> Scheduler``.
        sampler: ``(generator) -> Sampler`` — the generator serves requests without a seed.
        output_processor: ``(tokenizer, eos_token_ids, max_model_len) -> OutputProcessor``.
        spec_decoder: ``(spec_config, max_model_len) -> SpecDecoder`` — drafts and verifies (a test or a
            draft-model proposer swaps its proposer).
    """

    executor: Callable[[LlamaForCausalLM, EngineConfig, int], Executor] = make_executor
    block_manager: Callable[[int, CacheConfig], BlockManager] = default_block_manager
    scheduler: Callable[[SchedulerConfig, BlockManager], Scheduler] = Scheduler
    sampler: Callable[[torch.Generator], Sampler] = Sampler
    output_processor: Callable[[Tokenizer | None, list[int], int], OutputProcessor] = OutputProcessor
    spec_decoder: Callable[[SpecConfig, int], SpecDecoder] = SpecDecoder
