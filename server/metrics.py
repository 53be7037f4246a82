"""Prometheus metrics of the server, with vLLM's names under the ``cipherlm:`` prefix.

Each app owns its own :class:`~prometheus_client.CollectorRegistry` (no process-global state, so
several apps can live in one test process). Request metrics are labelled by ``tenant`` (the tenant id —
never anything from the prompt) and ``model_name``; engine-wide gauges (queue, KV usage) are read from
``engine.stats()`` at scrape time.

===============================================  =========  =======================================
name                                             type       meaning
===============================================  =========  =======================================
cipherlm:request_success_total                   counter    finished requests by finished_reason
cipherlm:prompt_tokens_total                     counter    prompt tokens processed
cipherlm:generation_tokens_total                 counter    tokens generated
cipherlm:prefix_cache_hit_tokens_total           counter    prompt tokens served from the cache
cipherlm:time_to_first_token_seconds             histogram  arrival → first token (server side)
cipherlm:inter_token_latency_seconds             histogram  between consecutive streamed tokens
cipherlm:e2e_request_latency_seconds             histogram  arrival → last token
cipherlm:request_queue_time_seconds              histogram  engine: arrival → first scheduled
cipherlm:first_token_delivery_seconds            histogram  engine's first token → its stream (API lag)
cipherlm:api_event_loop_lag_seconds              histogram  how late the API's event loop ran a timer
cipherlm:http_requests_total                     counter    responses by endpoint and status
cipherlm:rate_limited_total                      counter    429s by limit
cipherlm:plaintext_fallback_total                counter    encrypted tenants served in plaintext
cipherlm:num_requests_running / _waiting         gauge      from engine.stats()
cipherlm:kv_cache_usage_perc                     gauge      from engine.stats()
cipherlm:engine_steps_total                      counter    engine steps that ran work
cipherlm:engine_prefill_steps_total              counter    of which carried prompt tokens
cipherlm:engine_graph_steps_total                counter    steps that replayed a CUDA graph (GPU)
cipherlm:engine_step_tokens_total                counter    tokens scheduled in those steps
cipherlm:engine_step_seconds_total               counter    host wall time inside engine steps
cipherlm:private_step_stage_seconds              histogram  an encrypted step's time by stage and kind
===============================================  =========  =======================================

``private_step_stage_seconds`` is labelled by ``stage`` (one of :data:`PRIVATE_STEP_STAGES`, a fixed list)
and ``kind`` (``prefill``: a step of several positions; ``decode``: one position) only: no tenant, session,
layer or byte of a body, so its series are bounded (``docs/operator-guide.md`` says what each stage covers).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

PREFIX = "cipherlm:"
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)
LOOP_LAG_INTERVAL_S = 0.05  # the event-loop watcher's timer: 20 wake-ups a second
#: encrypted steps: stages run ~0.1-100 ms each, a whole step up to seconds on a loaded CPU worker
_STAGE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256,
                  0.512, 1.0, 2.0, 4.0, 8.0, 16.0)
#: The stages of one encrypted step, in the order they happen (server.private: router, service, workers, compute)
PRIVATE_STEP_STAGES = (
    "body_read",        # the request body streamed in (router.read_capped)
    "envelope",         # envelope parse and the step's checks (session, key, layer, positions, sizes)
    "digest",           # SHA-256 of the body (retry semantics)
    "queue_wait",       # queued for the session's worker (behind other tasks)
    "to_worker",        # the task handed to the worker process (serialization, the pipe, its read there)
    "worker_parse",     # the worker parsing and checking the uploaded ciphertexts
    "worker_compute",   # the evaluation itself
    "worker_serialize",  # the results serialized for the wire
    "worker_rest",      # the worker's other time on the task (all of it where a task does not split it)
    "from_worker",      # the result back from the worker process (serialization, the pipe, its read here)
    "pool_rest",        # the pool's own overhead around the call (thread hand-off, event-loop wake-up)
    "result",           # the result envelope built
    "total",            # the whole step in the server's handler, from the first byte read to the answer
)
PRIVATE_STEP_KINDS = ("prefill", "decode")
_STAT_GAUGES = {  # engine.stats() field -> (metric name, help)
    "num_running": ("num_requests_running", "Requests running in the engine"),
    "num_waiting": ("num_requests_waiting", "Requests waiting for admission"),
    "kv_cache_usage": ("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1)"),
}
_STAT_COUNTERS = {  # engine-wide totals (no tenant label: the engine does not know tenants)
    "prefix_cache_queries": ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache"),
    "prefix_cache_hits": ("prefix_cache_hits", "Prompt tokens found in the prefix cache"),
    "num_preemptions": ("num_preemptions", "Sequences preempted (recomputed later)"),
    "generation_tokens_total": ("engine_generation_tokens", "Tokens generated by the engine (all tenants)"),
    "steps_total": ("engine_steps", "Engine steps that ran work"),
    "prefill_steps_total": ("engine_prefill_steps", "Engine steps that carried prompt tokens"),
    "graph_steps_total": ("engine_graph_steps", "Engine steps that replayed a CUDA graph"),
    "step_tokens_total": ("engine_step_tokens", "Tokens scheduled in engine steps"),
    "step_seconds_total": ("engine_step_seconds", "Host wall time inside engine steps"),
    "spec_num_drafts": ("spec_decode_num_drafts", "Speculative verify steps (sequences that carried drafts)"),
    "spec_num_draft_tokens": ("spec_decode_num_draft_tokens", "Speculative draft tokens scored"),
    "spec_num_accepted_tokens": ("spec_decode_num_accepted_tokens", "Speculative draft tokens accepted"),
}


class _EngineStatsCollector(Collector):
    """Engine-wide gauges read from ``stats()`` when Prometheus scrapes."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterable[Metric]:
        source = self._metrics.engine_stats
        try:
            stats = source() if source is not None else None
        except Exception:  # a scrape must never fail because the engine is starting/stopping
            stats = None
        for table, family in ((_STAT_GAUGES, GaugeMetricFamily), (_STAT_COUNTERS, CounterMetricFamily)):
            for key, (name, doc) in table.items():
                value = getattr(stats, key, None)
                if isinstance(value, (int, float)):
                    m = family(PREFIX + name, doc, labels=["model_name"])
                    m.add_metric([self._metrics.model_name], float(value))
                    yield m


async def watch_loop_lag(observe: Callable[[float], None], interval_s: float = LOOP_LAG_INTERVAL_S) -> None:
    """Until cancelled: sleep ``interval_s`` at a time and ``observe`` how much later than asked the running event
    loop woke (seconds): how long anything ready on it waits for its turn."""
    while True:
        start = time.monotonic()
        await asyncio.sleep(interval_s)
        observe(max(0.0, time.monotonic() - start - interval_s))


class ServerMetrics:
    """The app's metric objects."""

    def __init__(self, model_name: str = "") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        self.engine_stats: Callable[[], Any] | None = None
        labels = ["tenant", "model_name"]
        r = self.registry
        self.request_success = Counter(PREFIX + "request_success", "Finished requests",
                                       labels + ["finished_reason"], registry=r)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens processed", labels, registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generated tokens", labels, registry=r)
        self.cached_tokens = Counter(PREFIX + "prefix_cache_hit_tokens",
                                     "Prompt tokens from the prefix cache", labels, registry=r)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token", labels,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between streamed tokens", labels,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Request latency", labels,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram(PREFIX + "request_queue_time_seconds",
                                    "Engine arrival to first scheduled step", labels, buckets=_LATENCY_BUCKETS,
                                    registry=r)
        self.first_token_delivery = Histogram(PREFIX + "first_token_delivery_seconds",
                                              "Engine's first token to the API's stream", labels,
                                              buckets=_LATENCY_BUCKETS, registry=r)
        self.http_requests = Counter(PREFIX + "http_requests", "HTTP responses", ["endpoint", "status"],
                                     registry=r)
        self.rate_limited = Counter(PREFIX + "rate_limited", "Requests refused by a limit",
                                    ["tenant", "limit"], registry=r)
        self.fallbacks = Counter(PREFIX + "plaintext_fallback", "Encrypted-mode requests served in plaintext",
                                 ["tenant"], registry=r)

        self.private_step_stage = Histogram(PREFIX + "private_step_stage_seconds",
                                            "Encrypted step time by stage (server side)", ["stage", "kind"],
                                            buckets=_STAGE_BUCKETS, registry=r)

        # the API process's one interpreter saturated shows here first: every new request and every stream
        # waits this long for its turn (sampled by watch_event_loop)
        self.loop_lag = Histogram(PREFIX + "api_event_loop_lag_seconds",
                                  "How late the API's event loop woke a timer", buckets=_LATENCY_BUCKETS,
                                  registry=r)

        self.registry.register(_EngineStatsCollector(self))

    async def watch_event_loop(self, interval_s: float = LOOP_LAG_INTERVAL_S) -> None:
        """Until cancelled: the running loop's lag into ``loop_lag`` (:func:`watch_loop_lag`)."""
        await watch_loop_lag(self.loop_lag.observe, interval_s)

    def watch_engine(self, stats: Callable[[], Any] | None) -> None:
        """Export the engine's gauges (``stats()`` is called on every scrape; None: stop)."""
        self.engine_stats = stats

    def record_finished(self, tenant: str, prompt_tokens: int, completion_tokens: int, cached: int,
                        finish_reasons: Iterable[str]) -> None:
        """Count one finished request."""
        lab = (tenant, self.model_name)
        self.prompt_tokens.labels(*lab).inc(prompt_tokens)
        self.generation_tokens.labels(*lab).inc(completion_tokens)
        self.cached_tokens.labels(*lab).inc(cached)
        for reason in finish_reasons:
            self.request_success.labels(*lab, reason or "unknown").inc()

    def record_private_stages(self, kind: str, stages: dict[str, float]) -> None:
        """Observe one encrypted step's stage times (seconds; ``kind`` ``prefill`` or ``decode``). Names outside
        :data:`PRIVATE_STEP_STAGES` and kinds outside :data:`PRIVATE_STEP_KINDS` are dropped, so the label
        sets stay the fixed ones whatever a caller passes."""
        if kind not in PRIVATE_STEP_KINDS:
            return
        for stage, seconds in stages.items():
            if stage in PRIVATE_STEP_STAGES:
                self.private_step_stage.labels(stage, kind).observe(max(0.0, seconds))

    def render(self) -> bytes:
        """The text exposition format."""
        return generate_latest(self.registry)
