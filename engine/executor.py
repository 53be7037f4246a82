"""The seam between the engine and the model: an executor runs a scheduled step wherever the model lives.

``LLMEngine`` talks only to an :class:`Executor`: size and allocate the KV pool, run a step, shut down
(and, optionally, ``launch``: run a greedy step whose tokens are read back later, for the overlapped loop).
:class:`InProcessExecutor` (today's, the default) drives one :class:`~engine.model_runner.ModelRunner` in
this process. A tensor-parallel executor implements the same three calls by broadcasting the
:class:`~engine.scheduler.SchedulerOutput` to one runner per rank (torch.distributed/NCCL) and returning
rank 0's logits; the engine, scheduler and sampler do not change: that one is
:class:`engine.distributed.TensorParallelExecutor`, which :func:`make_executor` (the engine's default
factory) picks when ``tensor_parallel_size > 1``.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch

from engine.engine_config import EngineConfig
from engine.model import LlamaForCausalLM
from engine.model_runner import LaunchedStep, ModelRunner
from engine.scheduler import ScheduledSeq, SchedulerOutput


@dataclasses.dataclass
class ModelOutput:
    """One step's result.

    Attributes:
        logits: [R, V] fp32, the sampling rows of ``sampling`` in order, ``s.num_logits_rows`` rows each.
        sampling: the scheduled sequences that yield tokens this step.
    """

    logits: torch.Tensor
    sampling: list[ScheduledSeq]


class Executor(Protocol):
    """What the engine needs from whatever runs the model."""

    device: torch.device

    def init_kv_cache(self) -> int:
        """Size and allocate the KV pool; return its number of blocks."""
        ...

    def execute(self, sched: SchedulerOutput) -> ModelOutput:
        """Run one scheduled step (block copies first); return the logits of its sampling rows."""
        ...

    def shutdown(self) -> None:
        """Release the model and its workers."""
        ...


class InProcessExecutor:
    """One :class:`ModelRunner` in the calling process (the default executor)."""

    def __init__(self, model: LlamaForCausalLM, config: EngineConfig, max_model_len: int) -> None:
        self.runner = ModelRunner(model, config, max_model_len)
        self.device = self.runner.device

    def init_kv_cache(self) -> int:
        return self.runner.init_kv_cache()

    def execute(self, sched: SchedulerOutput) -> ModelOutput:
        logits, sampling = self.runner.execute(sched)
        return ModelOutput(logits, sampling)

    def launch(self, sched: SchedulerOutput, prev: LaunchedStep | None) -> LaunchedStep:
        """Run a step of plain greedy sequences without reading its tokens back (the overlapped loop:
        ``LLMEngine.step``); an executor without this method runs every step synchronously."""
        return self.runner.launch(sched, prev)

    @property
    def graph_steps(self) -> int:
        """Steps that replayed a CUDA graph (optional: an executor without it reports none)."""
        return self.runner.graph_steps

    def shutdown(self) -> None:
        """Nothing to stop: the runner lives and dies with the engine."""


def make_executor(model: LlamaForCausalLM, config: EngineConfig, max_model_len: int) -> Executor:
    """The executor the config asks for: in process, or ``tensor_parallel_size`` ranks."""
    if config.tensor_parallel_size > 1:
        from engine.distributed import TensorParallelExecutor  # torch.distributed only when asked for

        return TensorParallelExecutor(model, config, max_model_len)
    return InProcessExecutor(model, config, max_model_len)
