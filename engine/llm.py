"""Offline batch generation: ``LLM(model).generate(prompts, params)``."""

from __future__ import annotations

from pathlib import Path

from engine.beam_search import BeamSearcher, BeamSearchOutput, BeamSearchParams
from engine.engine_config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model import LlamaForCausalLM
from engine.outputs import RequestOutput
from engine.parts import EngineParts
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer


class LLM:
    """Runs a list of prompts to completion with continuous batching."""

    def __init__(self, model: str | Path | LlamaForCausalLM, tokenizer: Tokenizer | None = None,
                 engine_config: EngineConfig | None = None, *, parts: EngineParts | None = None) -> None:
        if isinstance(model, (str, Path)):
            self.engine = LLMEngine.from_pretrained(model, engine_config, parts)
        else:
            self.engine = LLMEngine(model, tokenizer, engine_config, parts)
        self.engine.stream_outputs = False  # offline: only final outputs are needed

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    def generate(self, prompts: str | list[str] | list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None, *,
                 cache_salt: str | None = None) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs come back in prompt order.

        Args:
            prompts: one prompt, or a list of texts or of token-id lists.
            params: one SamplingParams for all prompts, or one per prompt (default: SamplingParams()).
            cache_salt: prefix-cache salt of every request of this call.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        if not isinstance(params, list):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        ids = [f"offline-{i}" for i in range(len(prompts))]
        for p in params:  # validate everything before running anything
            if not isinstance(p, SamplingParams):
                raise TypeError(f"params must be SamplingParams, got {type(p).__name__}")
        final: dict[str, RequestOutput] = {}
        for rid, prompt, p in zip(ids, prompts, params, strict=False):
            while self.engine.num_waiting_requests >= self.engine.config.max_waiting:
                self._step(final)  # offline: wait for room instead of failing
            self.engine.add_request(rid, prompt, p, cache_salt=cache_salt)
        while self.engine.has_unfinished_requests():
            self._step(final)
        return [final[rid] for rid in ids]

    def beam_search(self, prompts: str | list[str] | list[list[int]],
                    params: BeamSearchParams) -> list[BeamSearchOutput]:
        """Beam search (transformers' ``num_beams`` search, :mod:`engine.beam_search`) for every prompt.

        Args:
            prompts: one prompt, or a list of texts or of token-id lists.
            params: width, length, length penalty.

        Returns:
            One :class:`BeamSearchOutput` per prompt, in order, its beams best first.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be BeamSearchParams, got {type(params).__name__}")
        return BeamSearcher(self.engine).run(list(prompts), params)

    def _step(self, final: dict[str, RequestOutput]) -> None:
        for out in self.engine.step():
            if out.finished:
                final[out.request_id] = out
