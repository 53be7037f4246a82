"""Engine metrics: per-request latency records and per-step gauges, pushed to registered listeners.

The server registers a :class:`MetricsListener` and exports Prometheus series; :data:`VLLM_METRIC_NAMES`
gives the vLLM name of each field so dashboards built for vLLM keep working.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

# field -> vLLM's Prometheus name (histograms unless the name ends in _total or is a gauge)
VLLM_METRIC_NAMES = {
    "ttft": "vllm:time_to_first_token_seconds",
    "tpot": "vllm:request_time_per_output_token_seconds",
    "itl": "vllm:inter_token_latency_seconds",
    "queue_time": "vllm:request_queue_time_seconds",
    "e2e_latency": "vllm:e2e_request_latency_seconds",
    "prompt_tokens": "vllm:request_prompt_tokens",
    "generation_tokens": "vllm:request_generation_tokens",
    "prompt_tokens_total": "vllm:prompt_tokens_total",
    "generation_tokens_total": "vllm:generation_tokens_total",
    "num_running": "vllm:num_requests_running",
    "num_waiting": "vllm:num_requests_waiting",
    "kv_cache_usage": "vllm:kv_cache_usage_perc",
    "prefix_cache_queries": "vllm:prefix_cache_queries",
    "prefix_cache_hits": "vllm:prefix_cache_hits",
    "num_preemptions": "vllm:num_preemptions",
    "finished_requests": "vllm:request_success",
    "spec_num_drafts": "vllm:spec_decode_num_drafts",
    "spec_num_draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "spec_num_accepted_tokens": "vllm:spec_decode_num_accepted_tokens",
}


@dataclasses.dataclass
class RequestStats:
    """What one finished request cost (seconds; ``None`` where the event never happened).

    Attributes:
        ttft: arrival -> first token.
        tpot: mean time per output token after the first.
        itl: every gap between consecutive token-producing steps.
        queue_time: arrival -> first scheduled.
        e2e_latency: arrival -> finished.
    """

    request_id: str
    finish_reason: str | None
    prompt_tokens: int
    generation_tokens: int
    cached_tokens: int
    queue_time: float | None
    ttft: float | None
    tpot: float | None
    itl: list[float]
    e2e_latency: float


@dataclasses.dataclass
class EngineStats:
    """Gauges and counters after a step (counters are totals since start)."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_kv_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    prompt_tokens_total: int
    generation_tokens_total: int
    steps_total: int = 0               # engine steps that ran work
    prefill_steps_total: int = 0       # of which a row computed several tokens (a prompt chunk)
    step_tokens_total: int = 0         # tokens scheduled over those steps
    step_seconds_total: float = 0.0    # host wall time inside LLMEngine.step (idle polls included)
    graph_steps_total: int = 0         # steps that replayed a CUDA graph (the others ran eagerly)
    spec_num_drafts: int = 0           # speculative verify steps (one per sequence that carried drafts)
    spec_num_draft_tokens: int = 0     # draft tokens scored
    spec_num_accepted_tokens: int = 0  # of which accepted

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @property
    def spec_acceptance_rate(self) -> float:
        """Accepted / scored draft tokens."""
        return self.spec_num_accepted_tokens / self.spec_num_draft_tokens if self.spec_num_draft_tokens else 0.0

    @property
    def spec_tokens_per_step(self) -> float:
        """Tokens a verify step emits on average (accepted drafts + the target's own token)."""
        return 1.0 + self.spec_num_accepted_tokens / self.spec_num_drafts if self.spec_num_drafts else 0.0


class MetricsListener(Protocol):
    """Receives metrics from the engine thread; implementations must be quick and thread-safe."""

    def on_request_finished(self, stats: RequestStats) -> None:
        """Called once per finished or aborted request."""

    def on_step(self, stats: EngineStats) -> None:
        """Called after every engine step."""


def request_stats(request_id: str, finish_reason: str | None, prompt_tokens: int, generation_tokens: int,
                  cached_tokens: int, arrival: float, scheduled: float | None, token_times: list[float],
                  finished: float) -> RequestStats:
    """Derive latencies from a request's timestamps."""
    itl = [b - a for a, b in zip(token_times, token_times[1:], strict=False)]
    ttft = token_times[0] - arrival if token_times else None
    tpot = None
    if generation_tokens > 1 and token_times:
        tpot = (token_times[-1] - token_times[0]) / (generation_tokens - 1)
    return RequestStats(request_id, finish_reason, prompt_tokens, generation_tokens, cached_tokens,
                        None if scheduled is None else scheduled - arrival, ttft, tpot, itl,
                        finished - arrival)
