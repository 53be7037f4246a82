"""What the engine streams back: one :class:`RequestOutput` per request per step that made progress."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class RequestMetrics:
    """Wall-clock timestamps (``time.time()`` seconds) of one request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclasses.dataclass
class CompletionOutput:
    """One of the ``n`` completions of a request.

    Attributes:
        index: which of the n completions this is.
        token_ids: every generated token so far.
        text: the detokenized text so far (never past a stop string).
        delta_text: text added since the previous output of this request.
        delta_token_ids: tokens added since the previous output.
        logprobs: per *new* token, ``{token_id: logprob}`` for the sampled token and the top-n, or None.
        finish_reason: "stop", "length", "abort" or None while running.
        stop_reason: the stop string or stop token id that ended it, if any.
    """

    index: int
    token_ids: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    delta_text: str = ""
    delta_token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    """A snapshot of a request after an engine step.

    Attributes:
        request_id: the caller's id.
        prompt_token_ids: the prompt as tokenized.
        outputs: the n completions (all of them, with deltas for those that progressed).
        finished: every completion is done.
        num_cached_tokens: prompt tokens served from the prefix cache.
        metrics: timestamps of the request's life.
    """

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
