"""Per-request sampling parameters (the fields and defaults of vLLM's ``SamplingParams``).

Validated on construction: a bad value raises :class:`engine.errors.InvalidRequestError` naming the field,
so the server can turn it into an HTTP 400 before any work is done.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from engine.errors import InvalidRequestError

_GREEDY_EPS = 1e-5  # temperatures below this mean argmax (vLLM's convention)
MAX_LOGPROBS = 20   # OpenAI's top_logprobs bound
MAX_SPECULATIVE_TOKENS = 16  # draft tokens a verify step may score per sequence


@dataclasses.dataclass
class SamplingParams:
    """How to pick tokens for one request.

    Attributes:
        n: completions per prompt; they share the prompt's KV blocks.
        max_tokens: generated tokens at most (the ``length`` finish reason).
        temperature: 0 means greedy; otherwise logits are divided by it.
        top_p: nucleus mass kept (1.0 = off).
        top_k: most likely tokens kept (<= 0 = off).
        min_p: tokens below ``min_p * p_max`` dropped (0 = off).
        repetition_penalty: >1 discourages tokens already in the prompt or output (CTRL-style).
        presence_penalty: subtracted once from the logit of every token already generated.
        frequency_penalty: subtracted per occurrence of a token already generated.
        seed: makes this request's sampling reproducible whatever else is in the batch.
        stop: strings that end the completion; the text never contains them.
        stop_token_ids: token ids that end the completion (kept in ``token_ids``, not in the text).
        ignore_eos: keep generating past the model's end-of-sequence token.
        logprobs: return the log-probabilities of the sampled token and of the top-n tokens.
        skip_special_tokens: drop special tokens from the text.
        logits_processors: vLLM-style callables ``(output_token_ids, logits) -> logits`` (or
            ``(prompt_token_ids, output_token_ids, logits)``) applied to this request's logits row before
            sampling, greedy included; see :mod:`engine.logits_process` for the batched form.
        num_speculative_tokens: draft tokens proposed per step (:mod:`engine.spec_decode`); None takes the
            deployment's ``EngineConfig.num_speculative_tokens``, 0 switches speculation off for this
            request. Lossless: greedy output is unchanged, sampled output keeps its distribution.
    """

    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = dataclasses.field(default_factory=list)
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    logits_processors: list[Callable[..., Any]] = dataclasses.field(default_factory=list)
    num_speculative_tokens: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logits_processors = list(self.logits_processors or [])
        self._check_ints()
        self._check_floats()
        self._check_lists()

    def _check_ints(self) -> None:
        _require(_is_int(self.n) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}")
        _require(_is_int(self.max_tokens) and self.max_tokens >= 1,
                 f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        _require(_is_int(self.top_k), f"top_k must be an integer (<= 0 disables it), got {self.top_k!r}")
        _require(self.seed is None or _is_int(self.seed),
                 f"seed must be an integer or None, got {self.seed!r}")
        _require(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
                 f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        k = self.num_speculative_tokens
        _require(k is None or (_is_int(k) and 0 <= k <= MAX_SPECULATIVE_TOKENS),
                 f"num_speculative_tokens must be None or an integer in [0, {MAX_SPECULATIVE_TOKENS}], got {k!r}")

    def _check_floats(self) -> None:
        _require(_is_num(self.temperature) and self.temperature >= 0,
                 f"temperature must be >= 0, got {self.temperature!r}")
        _require(_is_num(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}")
        _require(_is_num(self.min_p) and 0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p!r}")
        _require(_is_num(self.repetition_penalty) and self.repetition_penalty > 0,
                 f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _require(_is_num(value) and -2 <= value <= 2, f"{name} must be in [-2, 2], got {value!r}")

    def _check_lists(self) -> None:
        _require(all(isinstance(s, str) and s for s in self.stop),
                 f"stop must be a list of non-empty strings, got {self.stop!r}")
        _require(all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
                 f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        _require(all(callable(p) for p in self.logits_processors),
                 "logits_processors must be callables (token_ids, logits) -> logits")

    @property
    def greedy(self) -> bool:
        """True when tokens are picked by argmax."""
        return self.temperature < _GREEDY_EPS

    @property
    def needs_history(self) -> bool:
        """True when sampling looks at the tokens generated so far (penalties, logits processors)."""
        return self.has_penalties or bool(self.logits_processors)

    @property
    def has_penalties(self) -> bool:
        """True when any repetition/presence/frequency penalty is active."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x  # x == x: not NaN


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidRequestError(message)
