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
cipherlm:http_requests_total                     counter    responses by endpoint and status
cipherlm:rate_limited_total                      counter    429s by limit
cipherlm:plaintext_fallback_total                counter    encrypted tenants served in plaintext
cipherlm:num_requests_running / _waiting         gauge      from engine.stats()
cipherlm:kv_cache_usage_perc                     gauge      from engine.stats()
===============================================  =========  =======================================
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

PREFIX = "cipherlm:"
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)
_STAT_GAUGES = {  # engine.stats() field -> (metric name, help)
    "num_running": ("num_requests_running", "Requests running in the engine"),
    "num_waiting": ("num_requests_waiting", "Requests waiting for admission"),
    "kv_cache_usage": ("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1)"),
}
_STAT_COUNTERS = {  # engine-wide totals (no tenant label: the engine does not know tenants)
    "prefix_cache_queries": ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache"),
    "prefix_cache_hits": ("prefix_cache_hits", "Prompt tokens found in the prefix cache"),
    "num_preemptions": ("num_preemptions", "Sequences preempted (recomputed later)"),
}


class _EngineStatsCollector(Collector):
    """Engine-wide gauges read from ``stats()`` when Prometheus scrapes."""

    def __init__(self, stats: Callable[[], Any], model_name: str) -> None:
        self._stats = stats
        self._model = model_name

    def collect(self) -> Iterable[Metric]:
        try:
            stats = self._stats()
        except Exception:  # a scrape must never fail because the engine is starting/stopping
            stats = None
        for table, family in ((_STAT_GAUGES, GaugeMetricFamily), (_STAT_COUNTERS, CounterMetricFamily)):
            for key, (name, doc) in table.items():
                value = getattr(stats, key, None)
                if isinstance(value, (int, float)):
                    m = family(PREFIX + name, doc, labels=["model_name"])
                    m.add_metric([self._model], float(value))
                    yield m


class ServerMetrics:
    """The app's metric objects."""

    def __init__(self, model_name: str = "") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        labels = ["tenant", "model_name"]
        r = self.registry
        self.request_success = Counter(PREFIX + "request_success", "Finished requests",
                                       labels + ["finished_reason"], registry=r)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens processed", labels, registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generated tokens", labels, registry=r)
        self.cached_tokens = Counter(PREFIX + "prefix_cache_hit_tokens", "Prompt tokens from the prefix cache",
                                     labels, registry=r)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token", labels,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between streamed tokens", labels,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Request latency", labels,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.http_requests = Counter(PREFIX + "http_requests", "HTTP responses", ["endpoint", "status"],
                                     registry=r)
        self.rate_limited = Counter(PREFIX + "rate_limited", "Requests refused by a limit", ["tenant", "limit"],
                                    registry=r)
        self.fallbacks = Counter(PREFIX + "plaintext_fallback", "Encrypted-mode requests served in plaintext",
                                 ["tenant"], registry=r)

    def watch_engine(self, stats: Callable[[], Any]) -> None:
        """Export the engine's gauges (``stats()`` is called on every scrape)."""
        self.registry.register(_EngineStatsCollector(stats, self.model_name))

    def record_finished(self, tenant: str, prompt_tokens: int, completion_tokens: int, cached: int,
                        finish_reasons: Iterable[str]) -> None:
        """Count one finished request."""
        lab = (tenant, self.model_name)
        self.prompt_tokens.labels(*lab).inc(prompt_tokens)
        self.generation_tokens.labels(*lab).inc(completion_tokens)
        self.cached_tokens.labels(*lab).inc(cached)
        for reason in finish_reasons:
            self.request_success.labels(*lab, reason or "unknown").inc()

    def render(self) -> bytes:
        """The text exposition format."""
        return generate_latest(self.registry)
