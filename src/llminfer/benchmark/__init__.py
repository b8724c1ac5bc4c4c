"""Benchmarking: metrics over stage traces (polars), offline benchmarks, backend comparison, the serving
load generator, artifacts and plots."""

from llminfer.benchmark.metrics import itl_ms, request_metrics, summarize, trace_frame
from llminfer.benchmark.runner import (
    BackendComparison,
    Benchmarker,
    BenchmarkResult,
    ComparisonResult,
    plot,
    print_table,
)

__all__ = [
    "BackendComparison",
    "BenchmarkResult",
    "Benchmarker",
    "ComparisonResult",
    "itl_ms",
    "plot",
    "print_table",
    "request_metrics",
    "summarize",
    "trace_frame",
]
