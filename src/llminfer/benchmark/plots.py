"""Benchmark plots (matplotlib, headless): a 2x2 dashboard and single-metric figures, by batch size."""

from __future__ import annotations

from pathlib import Path

import polars as pl

PANELS = {
    "throughput": ("output_tokens_per_s", "Throughput", "output tokens/s"),
    "latency": ("latency_p50_ms", "End-to-end latency (p50)", "ms"),
    "ttft": ("ttft_mean_ms", "Time to first token (mean)", "ms"),
    "memory": ("peak_rss_mb", "Peak process memory", "MiB"),
}


def _axes_plot(ax, series: dict[str, pl.DataFrame], column: str, title: str, unit: str) -> None:
    for label, df in series.items():
        if column in df.columns and df[column].drop_nulls().len():
            ax.plot(df["batch_size"].to_list(), df[column].to_list(), marker="o", label=label)
    ax.set_title(title)
    ax.set_xlabel("batch size (requests)")
    ax.set_ylabel(unit)
    ax.grid(True, alpha=0.3)
    if len(series) > 1:
        ax.legend()


def _figure():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def dashboard(series: dict[str, pl.DataFrame], path: str | Path) -> Path:
    """Write the 2x2 dashboard (throughput, latency, TTFT, memory) of one or more summaries to ``path``."""
    plt = _figure()
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, (column, title, unit) in zip(axes.flat, PANELS.values()):
        _axes_plot(ax, series, column, title, unit)
    fig.suptitle("llminfer benchmark")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def single(series: dict[str, pl.DataFrame], panel: str, path: str | Path) -> Path:
    """Write one panel of :data:`PANELS` as its own figure."""
    plt = _figure()
    fig, ax = plt.subplots(figsize=(6, 4))
    _axes_plot(ax, series, *PANELS[panel])
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def suite(series: dict[str, pl.DataFrame], directory: str | Path, prefix: str = "benchmark") -> list[Path]:
    """``<prefix>_dashboard.png`` plus one PNG per panel (``_ttft`` only when TTFT was measured)."""
    directory = Path(directory)
    out = [dashboard(series, directory / f"{prefix}_dashboard.png")]
    for panel, (column, _, _) in PANELS.items():
        if panel == "ttft" and not any(column in df.columns and df[column].drop_nulls().len() for df in series.values()):
            continue
        out.append(single(series, panel, directory / f"{prefix}_{panel}.png"))
    return out
