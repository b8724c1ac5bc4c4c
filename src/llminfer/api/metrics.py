"""Prometheus metrics of one server, in their own registry (several apps can live in one process).

The names are vLLM's with the ``llminfer_`` prefix in place of ``vllm:`` (``vllm:time_to_first_token_seconds``
is ``llminfer_time_to_first_token_seconds``), so a vLLM dashboard works after a search and replace; the README
lists them. Counters and histograms come from the engine core's per-step statistics
(:mod:`llminfer.stats`: :class:`ServerMetrics` is a stat logger of the engine), gauges are read from the
engine when ``/metrics`` is scraped, and refused HTTP requests are counted by the API's error handler.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from llminfer.stats import COMPLETED, IterationStats

if TYPE_CHECKING:
    from llminfer.api.errors import APIError

PREFIX = "llminfer_"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                           40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = tuple(m * 10**e for e in range(6) for m in (1, 2, 5))  # 1, 2, 5, 10, ... 500000 tokens

#: Prometheus' text format; Litestar appends "; charset=utf-8" to text/* media types itself
CONTENT_TYPE = "text/plain; version=0.0.4"


class StepHistogram:
    """A histogram fed ``(value, count)`` at a time, exposed under one or more names.

    The inter-token latency has one sample per token, but every request decoding in consecutive engine
    steps shares the same gap, so a step costs one bucket search per distinct gap instead of one
    ``Histogram.observe`` per token. Exposition is prometheus_client's own (a custom collector).

    Args:
        names: metric names (without ``_bucket``/``_sum``/``_count``); all carry the same samples.
        documentation: the HELP text.
        buckets: upper bounds in increasing order (``+Inf`` is added).
        labels: label values, for the label names ``label_names``.
    """

    def __init__(self, names: Sequence[str], documentation: str, buckets: Sequence[float],
                 label_names: Sequence[str], labels: Sequence[str]) -> None:
        self.names = tuple(names)
        self.documentation = documentation
        self.bounds = tuple(float(b) for b in buckets)
        self.label_names = list(label_names)
        self.labels = list(labels)
        self._counts = [0] * (len(self.bounds) + 1)
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float, count: int = 1) -> None:
        """Add ``count`` samples of ``value`` (in the histogram's unit)."""
        i = bisect.bisect_left(self.bounds, value)  # the first bucket whose bound is >= value (le is inclusive)
        with self._lock:
            self._counts[i] += count
            self._sum += value * count

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            counts, total = list(self._counts), self._sum
        cumulative, running = [], 0
        for bound, c in zip((*self.bounds, math.inf), counts):
            running += c
            cumulative.append((floatToGoString(bound), running))
        for name in self.names:
            family = HistogramMetricFamily(name, self.documentation, labels=self.label_names)
            family.add_metric(self.labels, cumulative, total)
            yield family


class GrammarCompileCollector:
    """The structured-output compiler's counters (:meth:`~llminfer.sampling.structured.GrammarCompiler.stats`),
    read at scrape time: compiled-grammar cache hits and misses, compiles stopped at their deadline, and the
    compile processes killed for it. Nothing is exposed for an engine without a compiler (vLLM)."""

    _FAMILIES = (("grammar_cache_hits", "cache_hits", "Structured-output constraints served from the compiled-"
                  "grammar cache (keyed by the normalized constraint)."),
                 ("grammar_cache_misses", "cache_misses", "Structured-output constraints compiled (cache misses)."),
                 ("grammar_compile_timeouts", "compile_timeouts", "Grammar compiles stopped because every "
                  "request waiting for them had passed grammar_compile_timeout_s."),
                 ("grammar_compile_processes_killed", "workers_killed", "Compile processes killed at their "
                  "deadline (their CPU and slot freed)."))

    def __init__(self, engine: Any, labels: tuple[str, ...], values: tuple[str, ...]) -> None:
        self.engine = engine
        self.labels = labels
        self.values = values

    def collect(self) -> Iterator[Metric]:
        compiler = getattr(getattr(self.engine, "runtime", None), "grammar_compiler", None)
        if compiler is None:
            return
        stats = compiler.stats()
        for name, key, doc in self._FAMILIES:
            family = CounterMetricFamily(PREFIX + name, doc, labels=self.labels)
            family.add_metric(self.values, stats[key])
            yield family


class ServerMetrics:
    """The server's Prometheus metrics (names ``llminfer_*``, after vLLM's ``vllm:*``; see the README).

    It is a :class:`~llminfer.stats.StatLogger`: constructed with an engine, it appends itself to
    ``engine.stat_loggers``, and :meth:`record` turns each engine step's statistics into counter increments
    and histogram samples. Gauges (running / waiting requests, KV-cache usage, prefix-cache hit rate) are
    read from the engine in :meth:`render`.

    Args:
        model_name: the ``model_name`` label of every metric.
        engine: the engine to follow (``None``: only :meth:`rejected` and the gauges in :meth:`render`).
    """

    def __init__(self, model_name: str, engine: Any = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        r = self.registry
        labels = ("model_name",)
        p = PREFIX

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(p + name, doc, (*labels, *extra), registry=r)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(p + name, doc, labels, registry=r)

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Any:
            return Histogram(p + name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        # Gauges, read at scrape time.
        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting",
                             "Requests accepted but not running yet (queued in the engine or on their way to it).")
        self.kv_usage = gauge("kv_cache_usage_perc",
                              "Fraction of KV-cache blocks in use, 0 to 1 (cached free blocks count as free).")
        self.kv_blocks_used = gauge("kv_blocks_used", "KV-cache blocks in use (blocks).")
        self.kv_blocks = gauge("kv_blocks_capacity", "KV-cache blocks in the pool (blocks).")
        self.hit_rate = gauge("prefix_cache_hit_rate",
                              "Prompt tokens found in the prefix cache / prompt tokens looked up, since start (0 to 1).")
        # Counters, from the engine's steps.
        m = model_name
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed (counted when a prompt's "
                                     "prefill completes).").labels(m)
        self.generation_tokens = counter("generation_tokens", "Tokens generated, as they are generated "
                                         "(aborted requests' tokens included).").labels(m)
        self.success = counter("request_success", "Engine requests that ended, by finish reason "
                               "(stop, length, abort, error).", ("finished_reason",))
        for reason in ("stop", "length", "abort", "error"):
            self.success.labels(m, reason)  # present at 0 from the start, so rate() sees the first one
        self.preemptions = counter("num_preemptions", "Requests preempted (KV freed, recomputed later).").labels(m)
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache "
                                      "(tokens).").labels(m)
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache (tokens).").labels(m)
        self.client_disconnects = counter("http_client_disconnects", "HTTP requests whose client left before a "
                                          "response (while the body was read, or while queued or tokenized).").labels(m)
        self.rejected_total = counter("requests_rejected", "HTTP requests refused before generation: with a 4xx, "
                                      "or with a 503 at the server's concurrency limit (too_many_requests), by "
                                      "reason (the error code, e.g. rate_limit_exceeded).", ("reason",))
        # Histograms.
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token (s).", TTFT_BUCKETS)
        self.itl = StepHistogram((p + "inter_token_latency_seconds", p + "time_per_output_token_seconds"),
                                 "Time between consecutive output deliveries of a request (s).", ITL_BUCKETS,
                                 labels, (m,))
        r.register(self.itl)
        self.request_tpot = histogram("request_time_per_output_token_seconds",
                                      "Per request: decode time / (output tokens - 1) (s).", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Per request: arrival to finish (s).",
                             REQUEST_LATENCY_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Per request: waiting in the scheduler before "
                               "its first step (s).", REQUEST_LATENCY_BUCKETS)
        self.prefill = histogram("request_prefill_time_seconds", "Per request: first step to prompt computed (s).",
                                 REQUEST_LATENCY_BUCKETS)
        self.decode = histogram("request_decode_time_seconds", "Per request: first token to finish (s).",
                                REQUEST_LATENCY_BUCKETS)
        self.request_prompt = histogram("request_prompt_tokens", "Per request: prompt tokens (tokens).",
                                        TOKEN_BUCKETS)
        self.request_generation = histogram("request_generation_tokens", "Per request: generated tokens (tokens).",
                                            TOKEN_BUCKETS)
        self._queries = self._hits = 0
        if engine is not None:
            engine.stat_loggers.append(self)
            r.register(GrammarCompileCollector(engine, labels, (m,)))

    # ------------------------------------------------------------------ updates
    def record(self, stats: IterationStats) -> None:
        """Record one engine step (:class:`~llminfer.stats.StatLogger`); histogram samples per request and
        per distinct inter-token gap, never per token."""
        if stats.num_prompt_tokens:
            self.prompt_tokens.inc(stats.num_prompt_tokens)
        if stats.num_generation_tokens:
            self.generation_tokens.inc(stats.num_generation_tokens)
        if stats.num_preemptions:
            self.preemptions.inc(stats.num_preemptions)
        if stats.prefix_cache_queries:
            self._queries += stats.prefix_cache_queries
            self._hits += stats.prefix_cache_hits
            self.prefix_queries.inc(stats.prefix_cache_queries)
            self.prefix_hits.inc(stats.prefix_cache_hits)
        for ttft in stats.time_to_first_tokens_s:
            self.ttft.observe(ttft)
        for gap_ns, count in stats.inter_token_ns.items():
            self.itl.observe(gap_ns / 1e9, count)
        for done in stats.finished:
            self.success.labels(self.model_name, done.finish_reason).inc()
            if done.finish_reason not in COMPLETED:
                continue  # an aborted or failed request's latencies say nothing about the server
            self.e2e.observe(done.e2e_s)
            self.request_prompt.observe(done.prompt_tokens)
            self.request_generation.observe(done.generation_tokens)
            for hist, value in ((self.queue, done.queue_s), (self.prefill, done.prefill_s),
                                (self.decode, done.decode_s), (self.request_tpot, done.tpot_s)):
                if value is not None:
                    hist.observe(value)

    def rejected(self, error: APIError) -> None:
        """Record an API request refused with a 4xx (reason: the error code, or the status)."""
        self.rejected_total.labels(self.model_name, error.code or str(error.status)).inc()

    def refused_busy(self) -> None:
        """Record an HTTP request refused with a 503 at the server's concurrency limit (``--limit-concurrency``)."""
        self.rejected_total.labels(self.model_name, "too_many_requests").inc()

    def client_disconnected(self) -> None:
        """Record an HTTP request whose client left before it was answered."""
        self.client_disconnects.inc()

    # ------------------------------------------------------------------ scrape
    def render(self, engine: Any, in_flight: int) -> bytes:
        """Refresh the engine gauges and return the text exposition format.

        Args:
            engine: the :class:`~llminfer.engine.InferenceEngine` (gauges stay 0 before it loads); running
                requests come from ``engine.scheduler_stats()``, KV blocks from ``engine.cache_stats()``
                (absent with vLLM, whose pool is its own).
            in_flight: engine requests the server has submitted and not yet seen finish (those not running
                are reported as waiting: queued in the engine or still in transit to it).
        """
        m = self.model_name
        running = engine.scheduler_stats()["running"]
        self.running.labels(m).set(running)
        self.waiting.labels(m).set(max(in_flight - running, 0))
        self.hit_rate.labels(m).set(self._hits / self._queries if self._queries else 0.0)
        if getattr(engine, "loaded", False):
            stats = engine.cache_stats()
            total = stats.get("blocks_total")
            if total:
                used = stats.get("blocks_used", 0)
                self.kv_blocks_used.labels(m).set(used)
                self.kv_blocks.labels(m).set(total)
                self.kv_usage.labels(m).set(used / total)
        return generate_latest(self.registry)
