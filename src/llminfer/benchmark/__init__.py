"""Benchmarking: metrics over stage traces (polars), offline benchmarks, backend comparison, the serving
load generator, artifacts and plots.

The names below load on first use, so that ``llminfer.benchmark.settings`` or ``.artifacts`` can be
imported without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "itl_ms": "metrics", "request_metrics": "metrics", "summarize": "metrics", "trace_frame": "metrics",
    "BackendComparison": "comparison", "BenchmarkResult": "results", "Benchmarker": "runner",
    "ComparisonResult": "results", "plot": "results", "print_table": "results",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(f"llminfer.benchmark.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'llminfer.benchmark' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
