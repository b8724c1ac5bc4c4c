"""Prometheus metrics of one server, in their own registry (several apps can live in one process)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from llminfer.results import GenerationStats

if TYPE_CHECKING:
    from llminfer.api.errors import APIError

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                 1.0, 2.5)
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class ServerMetrics:
    """The server's Prometheus metrics (names prefixed ``llminfer_``).

    Gauges about the engine (running / waiting requests, KV blocks, prefix-cache hit rate) are read when
    the metrics are scraped; histograms and counters are updated as requests finish.
    """

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        labels = ("model_name",)
        self.model_name = model_name
        self.running = Gauge("llminfer_num_requests_running", "Requests in the running batch.", labels,
                             registry=r)
        self.waiting = Gauge("llminfer_num_requests_waiting",
                             "Requests accepted but not yet running (queued or in transit).", labels, registry=r)
        self.kv_blocks_used = Gauge("llminfer_kv_blocks_used", "KV cache blocks in use.", labels, registry=r)
        self.kv_blocks_total = Gauge("llminfer_kv_blocks_total", "KV cache blocks in the pool.", labels,
                                     registry=r)
        self.hit_rate = Gauge("llminfer_prefix_cache_hit_rate", "Prefix-cache hit rate (0..1).", labels,
                              registry=r)
        self.ttft = Histogram("llminfer_time_to_first_token_seconds", "Submit to first token (s).", labels,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("llminfer_time_per_output_token_seconds",
                              "Mean time between output tokens after the first (s).", labels,
                              buckets=_TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("llminfer_e2e_request_latency_seconds", "Submit to last token (s).", labels,
                             buckets=_E2E_BUCKETS, registry=r)
        self.prompt_tokens = Counter("llminfer_prompt_tokens", "Prompt tokens processed.", labels, registry=r)
        self.generation_tokens = Counter("llminfer_generation_tokens", "Tokens generated.", labels, registry=r)
        self.finished = Counter("llminfer_requests_finished", "Engine requests finished, by finish reason.",
                                (*labels, "finished_reason"), registry=r)
        self.aborted_total = Counter("llminfer_requests_aborted",
                                     "Engine requests cancelled because the client went away.", labels,
                                     registry=r)
        self.client_disconnects_total = Counter(
            "llminfer_http_client_disconnects", "HTTP requests whose client left before a response (while "
            "the body was read, or while queued or tokenized).", labels, registry=r)
        self.failed_total = Counter("llminfer_requests_failed", "Engine requests that failed in the engine.",
                                    labels, registry=r)
        self.rejected_total = Counter("llminfer_requests_rejected",
                                      "API requests refused before generation, by reason.",
                                      (*labels, "reason"), registry=r)

    # ------------------------------------------------------------------ updates
    def observe_finished(self, stats: GenerationStats | None, finish_reason: str | None) -> None:
        """Record one finished engine request."""
        m = self.model_name
        self.finished.labels(m, finish_reason or "unknown").inc()
        if stats is None:
            return
        self.prompt_tokens.labels(m).inc(stats.prompt_tokens)
        self.generation_tokens.labels(m).inc(stats.completion_tokens)
        if stats.completion_tokens > 0:
            self.ttft.labels(m).observe(stats.ttft_ms / 1e3)
        if stats.completion_tokens > 1:
            self.tpot.labels(m).observe((stats.total_latency_ms - stats.ttft_ms) / 1e3 / (stats.completion_tokens - 1))
        self.e2e.labels(m).observe(stats.total_latency_ms / 1e3)

    def aborted(self, count: int = 1) -> None:
        """Record engine requests cancelled by a client disconnect."""
        self.aborted_total.labels(self.model_name).inc(count)

    def client_disconnected(self) -> None:
        """Record an HTTP request whose client left before it was answered."""
        self.client_disconnects_total.labels(self.model_name).inc()

    def failed(self, count: int = 1) -> None:
        """Record engine requests that failed inside the engine."""
        self.failed_total.labels(self.model_name).inc(count)

    def rejected(self, error: APIError) -> None:
        """Record an API request refused with a 4xx (reason: the error code, or the status)."""
        self.rejected_total.labels(self.model_name, error.code or str(error.status)).inc()

    # ------------------------------------------------------------------ scrape
    def render(self, engine: Any, in_flight: int) -> bytes:
        """Refresh the engine gauges and return the text exposition format.

        Args:
            engine: the :class:`~llminfer.engine.InferenceEngine` (gauges stay 0 before it loads); running
                requests come from ``engine.scheduler_stats()``.
            in_flight: engine requests the server has submitted and not yet seen finish (those not running
                are reported as waiting: queued in the engine or still in transit to it).
        """
        m = self.model_name
        running = engine.scheduler_stats()["running"]
        self.running.labels(m).set(running)
        self.waiting.labels(m).set(max(in_flight - running, 0))
        if getattr(engine, "loaded", False):
            stats = engine.cache_stats()
            self.kv_blocks_used.labels(m).set(stats.get("blocks_used", 0))
            self.kv_blocks_total.labels(m).set(stats.get("blocks_total", 0))
            self.hit_rate.labels(m).set(stats.get("hit_rate", 0.0))
        return generate_latest(self.registry)
