"""Benchmark plots (matplotlib, headless): a 2x2 dashboard and single-metric figures, by batch size.

Every figure stands on its own: its title names the model, dtype, device and backend(s), its footer the
date, the settings and the backends that were skipped (with their reason); batch-size ticks are the batch
sizes measured. Throughput is the median over runs with the min-max range as error bars; latency shows p50
(solid) and p99 (dashed), both over every request of every measured run.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import polars as pl

PANELS = {
    "throughput": ("output_tokens_per_s", "Throughput (median, min-max over runs)", "output tokens/s"),
    "latency": ("latency_p50_ms", "End-to-end latency (p50 solid, p99 dashed)", "ms"),
    "ttft": ("ttft_p50_ms", "Time to first token (p50)", "ms"),
    "memory": ("peak_memory_mb", "Peak memory", "MiB"),
}


def _has(df: pl.DataFrame, column: str) -> bool:
    return column in df.columns and df[column].drop_nulls().len() > 0


def _axes_plot(ax, series: dict[str, pl.DataFrame], panel: str) -> None:
    column, title, unit = PANELS[panel]
    sizes: set[int] = set()
    for label, df in series.items():
        if not _has(df, column):
            continue
        x = df["batch_size"].to_list()
        sizes.update(int(b) for b in x)
        y = df[column].to_list()
        if panel == "throughput" and _has(df, "output_tokens_per_s_min"):
            lo = [max(m - a, 0) if m is not None and a is not None else 0
                  for m, a in zip(y, df["output_tokens_per_s_min"])]
            hi = [max(a - m, 0) if m is not None and a is not None else 0
                  for m, a in zip(y, df["output_tokens_per_s_max"])]
            ax.errorbar(x, y, yerr=[lo, hi], marker="o", capsize=3, label=label)
        else:
            (line,) = ax.plot(x, y, marker="o", label=label)
            if panel == "latency" and _has(df, "latency_p99_ms"):
                ax.plot(x, df["latency_p99_ms"].to_list(), marker=".", linestyle="--", color=line.get_color())
    if panel == "memory":
        kinds = sorted({k for df in series.values() if "memory_kind" in df.columns
                        for k in df["memory_kind"].drop_nulls().to_list()})
        if kinds:
            title += f" ({', '.join(kinds)})"
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("batch size (requests)")
    ax.set_ylabel(unit)
    if sizes:
        ticks = sorted(sizes)
        ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.grid(True, alpha=0.3)
    if len(series) > 1:
        ax.legend(fontsize=8)


def _figure():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def title(meta: dict[str, Any] | None) -> str:
    """``llminfer benchmark — model · dtype · device · backend: ...``."""
    m = meta or {}
    parts = [str(m[k]) for k in ("model", "dtype", "device") if m.get(k)]
    if m.get("backend"):
        parts.append(f"backend: {m['backend']}")
    return "llminfer benchmark" + (" — " + " · ".join(parts) if parts else "")


def footer(meta: dict[str, Any] | None, width: int = 150) -> str:
    """The date, the settings and the skipped backends with their reasons, wrapped to ``width`` characters."""
    m = meta or {}
    bits = [m["date"]] if m.get("date") else []
    if m.get("mode"):
        bits.append(f"{m['mode']} batching")
    if m.get("num_runs"):
        bits.append(f"{m['num_runs']} measured runs per batch size, percentiles over every request")
    if m.get("max_new_tokens"):
        bits.append(f"max_new_tokens {m['max_new_tokens']}")
    if m.get("prompt_len"):
        bits.append(f"prompt_len {m['prompt_len']}")
    lines = textwrap.wrap(" · ".join(bits), width)
    for name, reason in (m.get("skipped") or {}).items():
        first = reason.splitlines()[0] if reason else ""
        lines.append(textwrap.shorten(f"skipped: {name} — {first}", width, placeholder=" …"))
    return "\n".join(lines)


def _save(fig, plt, path: str | Path, meta: dict[str, Any] | None, margins: dict[str, float], fontsize: int) -> Path:
    # Fixed margins, not tight_layout(): that draws the figure once more and was most of a plot's time.
    fig.suptitle(textwrap.fill(title(meta), 120 if fontsize >= 9 else 80), fontsize=fontsize + 2)
    foot = footer(meta, width=170 if fontsize >= 9 else 125)
    lines = foot.count("\n") + 1 if foot else 0
    fig.text(0.01, 0.005, foot, fontsize=fontsize - 1, va="bottom", ha="left", color="0.3")
    line_h = (fontsize + 2) / 72 / fig.get_figheight()  # one footer line, as a fraction of the height
    fig.subplots_adjust(**{**margins, "bottom": margins["bottom"] + lines * line_h})
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def dashboard(series: dict[str, pl.DataFrame], path: str | Path, meta: dict[str, Any] | None = None) -> Path:
    """Write the 2x2 dashboard (throughput, latency, TTFT, memory) of one or more summaries to ``path``
    (1100 x 800 px). ``meta``: ``model``, ``dtype``, ``device``, ``backend``, ``date``, ``mode``,
    ``num_runs``, ``max_new_tokens``, ``prompt_len``, ``skipped`` (``{backend: reason}``), all optional."""
    plt = _figure()
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, panel in zip(axes.flat, PANELS):
        _axes_plot(ax, series, panel)
    return _save(fig, plt, path, meta, dict(left=0.07, right=0.98, top=0.92, bottom=0.07, hspace=0.32, wspace=0.2),
                 fontsize=10)


def single(series: dict[str, pl.DataFrame], panel: str, path: str | Path, meta: dict[str, Any] | None = None) -> Path:
    """Write one panel of :data:`PANELS` as its own figure (600 x 400 px)."""
    plt = _figure()
    fig, ax = plt.subplots(figsize=(6, 4))
    _axes_plot(ax, series, panel)
    return _save(fig, plt, path, meta, dict(left=0.12, right=0.97, top=0.79, bottom=0.13), fontsize=7)


def suite_names(prefix: str = "benchmark") -> list[str]:
    """The file names :func:`suite` may write."""
    return [f"{prefix}_dashboard.png", *(f"{prefix}_{p}.png" for p in PANELS)]


def suite(series: dict[str, pl.DataFrame], directory: str | Path, prefix: str = "benchmark",
          meta: dict[str, Any] | None = None) -> list[Path]:
    """``<prefix>_dashboard.png`` plus one PNG per panel (``_ttft`` only when TTFT was measured)."""
    directory = Path(directory)
    out = [dashboard(series, directory / f"{prefix}_dashboard.png", meta)]
    for panel, (column, _, _) in PANELS.items():
        if panel == "ttft" and not any(_has(df, column) for df in series.values()):
            continue
        out.append(single(series, panel, directory / f"{prefix}_{panel}.png", meta))
    return out
