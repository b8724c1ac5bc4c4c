"""What an offline benchmark or a backend comparison gives back, and how it is shown: the summary's columns
(:data:`SUMMARY_SCHEMA`), :class:`BenchmarkResult` (one engine over batch sizes), :class:`ComparisonResult`
(several backends), their tables, plots and artifacts. :mod:`llminfer.benchmark.runner` measures them and
:mod:`llminfer.benchmark.comparison` runs several backends; nothing here imports torch.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import polars as pl

from llminfer.benchmark import artifacts
from llminfer.benchmark.environment import MEMORY_KINDS, environment
from llminfer.config import Backend

PERCENTILES = (50, 95, 99)
#: One row per configuration (batch size): the CSV columns and the JSON ``summary`` keys, in order.
SUMMARY_SCHEMA: dict[str, Any] = {
    "batch_size": pl.Int64, "n_runs": pl.Int64, "n_requests": pl.Int64,
    **{f"{m}_{s}_ms": pl.Float64 for m in ("latency", "ttft", "tpot", "itl")
       for s in (*(f"p{q}" for q in PERCENTILES), "mean")},
    "output_tokens_per_s": pl.Float64, "output_tokens_per_s_min": pl.Float64,
    "output_tokens_per_s_max": pl.Float64,
    "peak_memory_mb": pl.Float64, "memory_kind": pl.Utf8, "peak_rss_mb": pl.Float64,
    "baseline_rss_mb": pl.Float64, "peak_device_mb": pl.Float64,
}
SUMMARY_COLUMNS = list(SUMMARY_SCHEMA)
#: What :meth:`BenchmarkResult.print_summary` shows: (column, header).
DISPLAY = [("batch_size", "batch"), ("n_requests", "n_req"), ("latency_p50_ms", "lat_p50_ms"),
           ("latency_p95_ms", "lat_p95_ms"), ("latency_p99_ms", "lat_p99_ms"), ("ttft_p50_ms", "ttft_p50_ms"),
           ("tpot_p50_ms", "tpot_p50_ms"), ("output_tokens_per_s", "tok/s_med"),
           ("output_tokens_per_s_min", "tok/s_min"), ("output_tokens_per_s_max", "tok/s_max"),
           ("peak_memory_mb", "mem_MiB")]

def _utc_now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")

@attrs.define
class BenchmarkResult:
    """Rows of one benchmark (warm-up excluded) plus the settings, config and environment they were
    measured under.

    Attributes:
        runs: one row per measured run (``batch_size``, ``run``, ``n_requests``, ``wall_s``,
            ``output_tokens``, ``output_tokens_per_s``).
        requests: one row per request of every measured run (``batch_size``, ``run``, ``index``,
            ``e2e_ms``, ``ttft_ms``, ``tpot_ms``, ``queue_ms``, ``prompt_tokens``, ``output_tokens``).
        configs: one row per configuration (batch size), the columns of :data:`SUMMARY_COLUMNS`.
    """

    runs: list[dict[str, Any]]
    settings: dict[str, Any]
    config: dict[str, Any]
    environment: dict[str, Any]
    info: dict[str, Any] = attrs.field(factory=dict)
    requests: list[dict[str, Any]] = attrs.field(factory=list)
    configs: list[dict[str, Any]] = attrs.field(factory=list)
    created_utc: str = attrs.field(factory=_utc_now)

    def to_polars(self) -> pl.DataFrame:
        """One row per measured run (warm-up excluded)."""
        return pl.DataFrame(self.runs)

    def requests_frame(self) -> pl.DataFrame:
        """One row per request of every measured run (the samples of the percentiles)."""
        return pl.DataFrame(self.requests)

    def summary(self) -> pl.DataFrame:
        """One row per batch size, the columns of :data:`SUMMARY_COLUMNS`: percentiles over every request of
        every measured run, the median / min / max of the runs' throughput, and the configuration's memory."""
        return pl.DataFrame(self.configs, schema=SUMMARY_SCHEMA, orient="row") if self.configs else \
            pl.DataFrame(schema=SUMMARY_SCHEMA)

    def meta(self) -> dict[str, Any]:
        """What a plot or a table needs to stand on its own: model, dtype, device, backend, date, settings."""
        return {"model": self.info.get("model") or self.config.get("model_name") or "llminfer/tiny-qwen2",
                "dtype": self.info.get("dtype") or self.config.get("dtype"),
                "device": self.info.get("device") or self.config.get("device"),
                "backend": self.config.get("backend"), "date": self.created_utc,
                "mode": self.settings.get("mode"), "num_runs": self.settings.get("num_runs"),
                "max_new_tokens": self.settings.get("max_new_tokens"),
                "prompt_len": self.settings.get("prompt_len")}

    def print_summary(self, title: str | None = None) -> str:
        """Print (and return) the summary table and a line saying what the memory column measures."""
        m = self.meta()
        text = format_table(_display(self.summary()), title or (
            f"llminfer benchmark — {m['model']} · {m['backend']} · {m['dtype']} · {m['device']} · "
            f"{m['mode']} · {m['num_runs']} runs x batch, percentiles over every request"))
        text += _memory_note(self.summary())
        print(text)
        return text

    def plot(self, path: str | Path) -> Path:
        """A 2x2 dashboard PNG (throughput with its min-max spread, latency p50/p99, TTFT, memory by batch
        size) titled with the model, dtype, device, backend and date."""
        from llminfer.benchmark.plots import dashboard

        return dashboard({self.config.get("backend") or "llminfer": self.summary()}, path, meta=self.meta())

    def plot_suite(self, directory: str | Path, prefix: str = "benchmark") -> list[Path]:
        """``<prefix>_dashboard.png``, ``_throughput.png``, ``_latency.png``, ``_ttft.png``, ``_memory.png``."""
        from llminfer.benchmark.plots import suite

        return suite({self.config.get("backend") or "llminfer": self.summary()}, directory, prefix, meta=self.meta())

    def to_json_dict(self) -> dict[str, Any]:
        return {
            "schema_version": 2,
            "kind": "benchmark",
            "created_utc": self.created_utc,
            "settings": self.settings,
            "config": self.config,
            "environment": self.environment,
            "info": self.info,
            "memory_kinds": {k: MEMORY_KINDS[k] for k in sorted({c["memory_kind"] for c in self.configs})},
            "runs": self.runs,
            "requests": self.requests,
            "summary": self.summary().to_dicts(),
        }

    def save_artifacts(self, directory: str | Path | None = ".", json_out: str | Path | None = None,
                       csv_out: str | Path | None = None, overwrite: bool = False) -> dict[str, Path]:
        """Write ``benchmark.json`` (everything) and ``benchmark.csv`` (the summary, one row per batch size)
        into ``directory``, or to the explicit paths; see :func:`llminfer.benchmark.artifacts.save` for the
        no-overwrite policy (a fresh timestamped subfolder, or FileExistsError for an explicit path).
        Returns the paths written."""
        return artifacts.save(self.to_json_dict(), self.summary(), directory, "benchmark", json_out, csv_out,
                              overwrite)


def _display(summary: pl.DataFrame) -> pl.DataFrame:
    cols = [(c, h) for c, h in ([("backend", "backend")] + DISPLAY) if c in summary.columns]
    return summary.select(pl.col(c).alias(h) for c, h in cols)


def _memory_note(summary: pl.DataFrame) -> str:
    kinds = [k for k in summary["memory_kind"].unique(maintain_order=True).to_list() if k] \
        if "memory_kind" in summary.columns else []
    return "".join(f"\nmem_MiB: {k} — {MEMORY_KINDS.get(k, '')}" for k in kinds)


def format_table(df: pl.DataFrame, title: str = "") -> str:
    """A plain fixed-width table of a frame (numbers to one decimal)."""
    cols = df.columns
    rows = [[("-" if v is None else f"{v:.1f}" if isinstance(v, float) else str(v)) for v in r] for r in df.rows()]
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(cols)]
    line = "  ".join(c.rjust(w) for c, w in zip(cols, widths))
    out = [title, line, "-" * len(line)] if title else [line, "-" * len(line)]
    out += ["  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in rows]
    return "\n".join(out)


@attrs.define
class ComparisonResult:
    """Per backend: a :class:`BenchmarkResult`, or the reason it was skipped; ``notes``: settings that did
    not apply to a backend and were ignored for it (``{backend: [note, ...]}``)."""

    results: dict[str, BenchmarkResult]
    skipped: dict[str, str]
    environment: dict[str, Any]
    notes: dict[str, list[str]] = attrs.field(factory=dict)
    created_utc: str = attrs.field(factory=_utc_now)

    def table(self) -> pl.DataFrame:
        """One row per backend and batch size: ``backend`` then :data:`SUMMARY_COLUMNS`."""
        frames = [r.summary().with_columns(pl.lit(name).alias("backend")) for name, r in self.results.items()]
        if not frames:
            return pl.DataFrame(schema={"backend": pl.Utf8, **SUMMARY_SCHEMA})
        return pl.concat(frames).select(["backend", *SUMMARY_COLUMNS])

    def meta(self) -> dict[str, Any]:
        first = next(iter(self.results.values()), None)
        m = first.meta() if first else {}
        return {**m, "backend": ", ".join(self.results) or "none", "date": self.created_utc,
                "skipped": dict(self.skipped)}

    def print_table(self) -> str:
        return print_table(self)

    def plot(self, path: str | Path) -> Path:
        return plot(self, path)

    def plot_suite(self, directory: str | Path, prefix: str = "comparison") -> list[Path]:
        """The dashboard and one PNG per metric, one line per backend (see :meth:`BenchmarkResult.plot_suite`)."""
        from llminfer.benchmark.plots import suite

        return suite({n: r.summary() for n, r in self.results.items()}, directory, prefix, meta=self.meta())

    def to_json_dict(self) -> dict[str, Any]:
        kinds = sorted({c["memory_kind"] for r in self.results.values() for c in r.configs})
        return {
            "schema_version": 2,
            "kind": "comparison",
            "created_utc": self.created_utc,
            "environment": self.environment,
            "backends": {name: {k: v for k, v in r.to_json_dict().items() if k not in ("environment",)}
                         for name, r in self.results.items()},
            "skipped": self.skipped,
            "notes": self.notes,
            "memory_kinds": {k: MEMORY_KINDS[k] for k in kinds},
            "table": self.table().to_dicts(),
        }

    def save_artifacts(self, directory: str | Path | None = ".", json_out: str | Path | None = None,
                       csv_out: str | Path | None = None, overwrite: bool = False) -> dict[str, Path]:
        """``comparison.json`` and ``comparison.csv`` (the table, one row per backend and batch size), with the
        policy of :func:`llminfer.benchmark.artifacts.save`. Returns the paths written."""
        return artifacts.save(self.to_json_dict(), self.table(), directory, "comparison", json_out, csv_out,
                              overwrite)


def _as_comparison(results: ComparisonResult | Mapping[str, BenchmarkResult]) -> ComparisonResult:
    if isinstance(results, ComparisonResult):
        return results
    if isinstance(results, Mapping) and all(isinstance(r, BenchmarkResult) for r in results.values()):
        return ComparisonResult(dict(results), {}, environment())
    raise TypeError(f"expected a ComparisonResult or a mapping of backend name to BenchmarkResult, "
                    f"got {type(results).__name__}")


def print_table(results: ComparisonResult | Mapping[str, BenchmarkResult]) -> str:
    """Print (and return) the comparison table, what its memory column measures, one line per skipped
    backend with its reason, and one per setting ignored for a backend.

    Raises:
        TypeError: ``results`` is neither a :class:`ComparisonResult` nor ``{backend: BenchmarkResult}``.
    """
    results = _as_comparison(results)
    m = results.meta()
    title = "llminfer backend comparison"
    if results.results:
        title += (f" — {m['model']} · {m['dtype']} · {m['device']} · {m['mode']} · {m['num_runs']} runs x "
                  "batch, percentiles over every request")
    table = results.table()
    text = format_table(_display(table), title) + _memory_note(table)
    for name, reason in results.skipped.items():
        text += f"\n{name}: skipped — {reason}"
    for name, notes in results.notes.items():
        text += "".join(f"\nnote: {name}: {n}" for n in notes)
    text += "".join(f"\nnote: {n}" for n in slower_than_eager(results))
    print(text)
    return text


def slower_than_eager(results: ComparisonResult, backend: str = Backend.COMPILED.value) -> list[str]:
    """One line per batch size where ``backend`` gave fewer output tokens/s (median of runs) than eager.

    The compiled backend exists to be faster; a row where it is not points at recompiles inside the measured
    runs, a shape that fell back to eager, or a regression (``engine.info()["compile"]`` has the counts).
    """
    if backend not in results.results or Backend.EAGER.value not in results.results:
        return []
    eager = {c["batch_size"]: c.get("output_tokens_per_s") for c in results.results[Backend.EAGER.value].configs}
    out = []
    for c in results.results[backend].configs:
        mine, theirs = c.get("output_tokens_per_s"), eager.get(c["batch_size"])
        if mine is not None and theirs and mine < theirs:
            out.append(f"{backend} is slower than eager at batch {c['batch_size']} ({mine:.1f} vs {theirs:.1f} "
                       f"output tok/s, x{mine / theirs:.3f}): check for recompiles and eager fallbacks in its "
                       "compile stats")
    return out


def plot(results: ComparisonResult | Mapping[str, BenchmarkResult], path: str | Path) -> Path:
    """A 2x2 dashboard PNG with one line per backend (throughput, latency, TTFT, memory against batch size),
    the skipped backends named in its footer; returns its path.

    Raises:
        TypeError: as :func:`print_table`.
    """
    from llminfer.benchmark.plots import dashboard

    results = _as_comparison(results)
    return dashboard({name: r.summary() for name, r in results.results.items()}, path, meta=results.meta())
