"""Cross-server comparison: several ``llminfer bench-serve`` artifacts (one per server: llminfer, vLLM,
llama.cpp's server, TGI, anything OpenAI-compatible) side by side in one table and one plot suite.

Each artifact holds every request's client-side TTFT / TPOT and every load point's percentiles, so the
report reads the percentiles as measured and recomputes goodput (requests/s that met both SLOs) from the
requests under one SLO for all servers. The load axis is the request rate when every point shares one
concurrency, else the concurrency when every point shares one request rate; artifacts that vary both are
refused. A workload that differs between artifacts (another prompt set, more requests) is noted, not refused.

    report = build_report(["vllm.json", "llminfer.json"], labels=["vllm", "llminfer"], slo_ttft_ms=500)
    print(report.format_table()); report.save("out")          # report.json, report.csv, report_*.png
"""

from __future__ import annotations

import datetime
import json
import math
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

__all__ = ["ReportError", "ServingReport", "build_report", "format_table", "load_artifact", "point_rows",
           "safe_paths"]

PLOTS = ("dashboard", "ttft", "tpot", "itl", "throughput", "goodput")
_SUMMARY_KEYS = ("ttft_ms_p50", "tpot_ms_p50", "output_tokens_per_s", "duration_s")


class ReportError(ValueError):
    """An artifact that cannot be read or combined; the message is one line naming the file."""


# ---------------------------------------------------------------------------------------------- reading
def load_artifact(path: str | Path) -> dict[str, Any]:
    """Read a ``bench-serve`` artifact (``serving.json``, schema version 1 or 2) into the version-2 shape:
    ``server``, ``workload``, ``settings`` (``slo_ttft_ms``, ``slo_tpot_ms``) and ``points`` (each with
    ``load``, ``summary``, ``requests``), plus ``path``.

    Raises:
        ReportError: the file is missing, not JSON, or not a serving artifact llminfer can read.
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ReportError(f"{path}: no such file") from None
    except OSError as exc:
        raise ReportError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise ReportError(f"{path}: not valid JSON ({str(exc).splitlines()[0]})") from None
    if not isinstance(data, dict) or data.get("kind") != "serving":
        kind = data.get("kind") if isinstance(data, dict) else type(data).__name__
        raise ReportError(f"{path}: not a bench-serve artifact (kind {kind!r}; expected 'serving')")
    version = data.get("schema_version")
    if version == 1:
        data = _from_v1(data, path)
    elif version != 2:
        raise ReportError(f"{path}: serving artifact schema version {version!r} is not supported (1 or 2)")
    points = data.get("points")
    if not isinstance(points, list) or not points:
        raise ReportError(f"{path}: 'points' must be a non-empty list")
    for i, point in enumerate(points):
        where = f"{path}: points[{i}]"
        if not isinstance(point, dict) or not isinstance(point.get("summary"), dict):
            raise ReportError(f"{where}: no 'summary' object")
        missing = [k for k in _SUMMARY_KEYS if k not in point["summary"]]
        if missing:
            raise ReportError(f"{where}.summary lacks {', '.join(missing)}")
        if not isinstance(point.get("requests"), list):
            raise ReportError(f"{where}: 'requests' must be a list")
        if not isinstance(point.get("load"), dict):
            raise ReportError(f"{where}: no 'load' object")
    for key in ("server", "workload", "settings"):
        if not isinstance(data.get(key), dict):
            raise ReportError(f"{path}: no '{key}' object")
    return {**data, "path": str(path)}


def _from_v1(data: dict[str, Any], path: Path) -> dict[str, Any]:
    """A version-1 artifact (one load point, before sweeps) in the version-2 shape."""
    settings, summary = data.get("settings"), data.get("summary")
    if not isinstance(settings, dict) or not isinstance(summary, dict):
        raise ReportError(f"{path}: no 'settings' / 'summary' objects")
    server = data.get("server") or {"base_url": settings.get("base_url"), "model": settings.get("model"),
                                    "kind": "unknown", "version": None}
    workload = {k: settings.get(k) for k in ("endpoint", "num_requests", "prompt_len", "output_len",
                                             "prompts_file", "seed", "extra_body")}
    load = {"request_rate": settings.get("request_rate"), "concurrency": settings.get("concurrency")}
    return {"schema_version": 1, "kind": "serving", "created": None, "server": server, "workload": workload,
            "settings": {"slo_ttft_ms": summary.get("slo_ttft_ms"), "slo_tpot_ms": summary.get("slo_tpot_ms")},
            "environment": data.get("environment") or {},
            "points": [{"load": load, "summary": summary, "requests": data.get("requests")}]}


# ---------------------------------------------------------------------------------------------- rows
def _rate(value: Any) -> float:
    return math.inf if value is None else float(value)


def point_rows(artifact: dict[str, Any], label: str, slo_ttft_ms: float | None = None,
               slo_tpot_ms: float | None = None) -> list[dict[str, Any]]:
    """One row per load point of ``artifact`` (:func:`load_artifact`'s shape): load, counts, TTFT / TPOT /
    ITL / E2E percentiles (ms) as measured, output tokens/s, requests/s and goodput (requests/s meeting
    both SLOs, recomputed from the requests when an SLO is given, else the artifact's own figure)."""
    server = artifact["server"]
    rows = []
    for point in artifact["points"]:
        s, load = point["summary"], point["load"]
        row: dict[str, Any] = {
            "label": label, "server_kind": server.get("kind"), "server_version": server.get("version"),
            "model": server.get("model"), "base_url": server.get("base_url"),
            "request_rate": load.get("request_rate"), "concurrency": load.get("concurrency"),
            "num_requests": s.get("num_requests"), "completed": s.get("completed"), "failed": s.get("failed"),
            "duration_s": s["duration_s"],
        }
        for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            for q in ("p50", "p95", "p99"):
                row[f"{metric}_{q}"] = s.get(f"{metric}_{q}")
        row.update(output_tokens_per_s=s["output_tokens_per_s"], requests_per_s=s.get("requests_per_s"))
        ttft_slo = s.get("slo_ttft_ms") if slo_ttft_ms is None else slo_ttft_ms
        tpot_slo = s.get("slo_tpot_ms") if slo_tpot_ms is None else slo_tpot_ms
        if slo_ttft_ms is None and slo_tpot_ms is None:
            row["goodput_requests_per_s"] = s.get("goodput_requests_per_s")
        else:
            good = sum(1 for r in point["requests"] if _meets(r, ttft_slo, tpot_slo))
            row["goodput_requests_per_s"] = good / s["duration_s"] if s["duration_s"] else None
        done = s.get("completed") or 0
        row["good_fraction"] = (row["goodput_requests_per_s"] * s["duration_s"] / done
                                if done and row["goodput_requests_per_s"] is not None else None)
        row.update(slo_ttft_ms=ttft_slo, slo_tpot_ms=tpot_slo)
        rows.append(row)
    rows.sort(key=lambda r: (_rate(r["request_rate"]), r["concurrency"] or math.inf))
    return rows


def _meets(request: dict[str, Any], slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> bool:
    if not request.get("ok") or request.get("ttft_ms") is None:
        return False
    ttft_ok = slo_ttft_ms is None or request["ttft_ms"] <= slo_ttft_ms
    tpot_ok = slo_tpot_ms is None or (request.get("tpot_ms") or 0.0) <= slo_tpot_ms
    return ttft_ok and tpot_ok


def _load_text(row: dict[str, Any]) -> str:
    rate = "inf" if row["request_rate"] is None else f"{row['request_rate']:g}/s"
    return f"{rate} c={'-' if row['concurrency'] is None else row['concurrency']}"


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """A fixed-width text table of :func:`point_rows` rows (ms, tokens/s, requests/s)."""
    cols = [("server", 12, lambda r: str(r["label"])), ("load", 14, _load_text),
            ("ok/err", 9, lambda r: f"{r['completed']}/{r['failed']}"),
            ("TTFT p50", 9, lambda r: _num(r["ttft_ms_p50"])), ("TTFT p99", 9, lambda r: _num(r["ttft_ms_p99"])),
            ("TPOT p50", 9, lambda r: _num(r["tpot_ms_p50"])), ("TPOT p99", 9, lambda r: _num(r["tpot_ms_p99"])),
            ("ITL p50", 8, lambda r: _num(r["itl_ms_p50"])), ("ITL p99", 8, lambda r: _num(r["itl_ms_p99"])),
            ("out tok/s", 9, lambda r: _num(r["output_tokens_per_s"])),
            ("req/s", 7, lambda r: _num(r["requests_per_s"], 2)),
            ("goodput", 7, lambda r: _num(r["goodput_requests_per_s"], 2))]
    width = max([12] + [len(str(r["label"])) for r in rows])
    cols[0] = ("server", width, cols[0][2])
    lines = [" ".join(f"{name:>{w}s}" if i else f"{name:<{w}s}" for i, (name, w, _) in enumerate(cols))]
    for r in rows:
        lines.append(" ".join(f"{fn(r):>{w}s}" if i else f"{fn(r):<{w}s}" for i, (_, w, fn) in enumerate(cols)))
    return "\n".join(lines)


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


# ---------------------------------------------------------------------------------------------- report
@attrs.define
class ServingReport:
    """The combined comparison: ``rows`` (one per server x load point), the load ``axis``
    (``"request_rate"`` or ``"concurrency"``), the SLO used for goodput (ms), the sources and notes."""

    artifacts: list[dict[str, Any]]
    labels: list[str]
    rows: list[dict[str, Any]]
    axis: str
    slo_ttft_ms: float | None
    slo_tpot_ms: float | None
    notes: list[str]
    created: str

    def format_table(self) -> str:
        head = f"SLO: TTFT <= {_num(self.slo_ttft_ms, 0)} ms, TPOT <= {_num(self.slo_tpot_ms, 0)} ms (goodput in req/s)"
        return "\n".join([format_table(self.rows), head, *(f"note: {n}" for n in self.notes)])

    def print_table(self) -> str:
        text = self.format_table()
        print(text)
        return text

    def sources(self) -> list[dict[str, Any]]:
        return [{"label": label, "path": a["path"], "server": a["server"], "workload": a["workload"],
                 "created": a.get("created")} for label, a in zip(self.labels, self.artifacts)]

    def to_json_dict(self) -> dict[str, Any]:
        """The ``report.json`` payload (``schemas/serving_report.schema.json``)."""
        return {"schema_version": 1, "kind": "serving_report", "created": self.created, "axis": self.axis,
                "slo": {"ttft_ms": self.slo_ttft_ms, "tpot_ms": self.slo_tpot_ms}, "sources": self.sources(),
                "notes": self.notes, "rows": self.rows}

    def context(self) -> str:
        """One paragraph for the plots' footer: model(s), servers, workload, SLO, dates."""
        models = sorted({str(a["server"].get("model")) for a in self.artifacts})
        servers = "; ".join(
            f"{label} = {_server_text(a['server'])}"
            + (f" {a['server']['version']}" if a["server"].get("version") else "")
            + f" @ {a['server'].get('base_url')}" for label, a in zip(self.labels, self.artifacts))
        w = self.artifacts[0]["workload"]
        workload = (f"{w.get('num_requests')} requests, {w.get('endpoint')}, "
                    + (f"prompts {w['prompts_file']}" if w.get("prompts_file") else
                       f"prompt {_span(w.get('prompt_len'))} words, max_tokens {_span(w.get('output_len'))}"))
        dates = sorted({str(a.get("created"))[:10] for a in self.artifacts if a.get("created")})
        text = (f"model: {', '.join(models)} | servers: {servers} | workload: {workload} | SLO TTFT "
                f"{_num(self.slo_ttft_ms, 0)} ms, TPOT {_num(self.slo_tpot_ms, 0)} ms | measured "
                f"{' to '.join(dates[::max(1, len(dates) - 1)]) if dates else 'unknown'} | report {self.created[:10]}")
        return text + "".join(f" | note: {n}" for n in self.notes)

    def plot_suite(self, directory: str | Path, prefix: str = "report") -> list[Path]:
        """``<prefix>_dashboard.png`` (2x2: TTFT, TPOT, throughput, goodput) and one PNG per panel
        (``_ttft``, ``_tpot``, ``_itl``, ``_throughput``, ``_goodput``)."""
        return _plot_suite(self, Path(directory), prefix)

    def save(self, directory: str | Path, overwrite: bool = False, plots: bool = True) -> list[Path]:
        """Write ``report.json``, ``report.csv`` and the plot suite into ``directory``; when one of those
        files is there already and ``overwrite`` is False, into a fresh timestamped subfolder instead.

        Raises:
            OSError: the folder cannot be created or written.
        """
        import polars as pl

        from llminfer.benchmark.artifacts import _clean

        names = ["report.json", "report.csv"] + ([f"report_{p}.png" for p in PLOTS] if plots else [])
        target = safe_paths([Path(directory) / n for n in names], overwrite)[0].parent
        target.mkdir(parents=True, exist_ok=True)
        (target / "report.json").write_text(json.dumps(_clean(self.to_json_dict()), indent=2, default=str))
        pl.DataFrame(self.rows, infer_schema_length=None).write_csv(target / "report.csv")
        written = [target / "report.json", target / "report.csv"]
        if plots:
            written += self.plot_suite(target)
        return written


def _server_text(server: dict[str, Any]) -> str:
    kind = server.get("kind") if server.get("kind") not in (None, "unknown") else None
    return kind or (f"server {server['server_header']!r}" if server.get("server_header") else "unknown server")


def _span(value: Any) -> str:
    if isinstance(value, (list, tuple)) and len(value) == 2:
        return f"{value[0]}" if value[0] == value[1] else f"{value[0]}-{value[1]}"
    return str(value)


def _axis(artifacts: list[dict[str, Any]]) -> str:
    loads = [(p["load"].get("request_rate"), p["load"].get("concurrency")) for a in artifacts for p in a["points"]]
    if len({c for _, c in loads}) == 1:
        return "request_rate"
    if len({r for r, _ in loads}) == 1:
        return "concurrency"
    per_file = "; ".join(f"{a['path']}: " + ", ".join(
        f"rate {'inf' if p['load'].get('request_rate') is None else p['load']['request_rate']} "
        f"c={p['load'].get('concurrency')}" for p in a["points"]) for a in artifacts)
    raise ReportError("incompatible artifacts: their load points vary both request rate and concurrency, so no "
                      f"one load axis fits them ({per_file})")


def default_label(server: dict[str, Any]) -> str:
    """A server's name for tables and plots: its ``--label``, else its kind, else the product in its
    ``server`` header, else its ``owned_by``, else ``"server"``."""
    kind = server.get("kind") if server.get("kind") != "unknown" else None
    header = (server.get("server_header") or "").split("/")[0].split(" ")[0] or None
    return str(server.get("label") or kind or header or server.get("owned_by") or "server")


def _default_labels(artifacts: list[dict[str, Any]]) -> list[str]:
    labels = [default_label(a["server"]) for a in artifacts]
    if len(set(labels)) < len(labels):
        labels = [f"{label}-{i + 1}" for i, label in enumerate(labels)]
    return labels


def build_report(paths: Sequence[str | Path], labels: Sequence[str] | None = None,
                 slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None) -> ServingReport:
    """Read and combine ``bench-serve`` artifacts.

    ``labels`` name the servers (default: each artifact's ``--label``, else its server kind, numbered when
    two share one). With no SLO
    given, the artifacts' own SLOs are used, which must then agree.

    Raises:
        ReportError: no files, a file :func:`load_artifact` refuses, labels that do not match the files, an
            SLO <= 0, artifacts whose SLOs differ (and none given), or load points with no common axis.
    """
    if not paths:
        raise ReportError("no artifacts given")
    artifacts = [load_artifact(p) for p in paths]
    if labels is not None:
        labels = [str(label) for label in labels]
        if len(labels) != len(artifacts):
            raise ReportError(f"{len(labels)} labels for {len(artifacts)} artifacts")
        if len(set(labels)) != len(labels) or not all(labels):
            raise ReportError(f"labels must be distinct and non-empty, got {labels}")
    else:
        labels = _default_labels(artifacts)
    for name, value in (("slo_ttft_ms", slo_ttft_ms), ("slo_tpot_ms", slo_tpot_ms)):
        if value is not None and not value > 0:
            raise ReportError(f"{name} must be > 0, got {value}")
    if slo_ttft_ms is None and slo_tpot_ms is None:
        slos = {(a["settings"].get("slo_ttft_ms"), a["settings"].get("slo_tpot_ms")) for a in artifacts}
        if len(slos) > 1:
            raise ReportError(f"the artifacts were measured under different SLOs {sorted(slos, key=str)}; pass "
                              "--slo-ttft-ms and --slo-tpot-ms to judge them alike")
        slo_ttft_ms, slo_tpot_ms = next(iter(slos))
        recompute = False
    else:
        recompute = True
    axis = _axis(artifacts)
    notes = []
    prints = {a["workload"].get("fingerprint") for a in artifacts}
    shapes = {json.dumps({k: a["workload"].get(k) for k in ("endpoint", "num_requests", "prompt_len",
                                                             "output_len", "prompts_file", "seed")}, default=str)
              for a in artifacts}
    if len(prints) > 1 or len(shapes) > 1:
        notes.append("the artifacts' workloads differ (requests, lengths, seed or endpoint): compare with care")
    models = {a["server"].get("model") for a in artifacts}
    if len(models) > 1:
        notes.append(f"different model names: {', '.join(sorted(map(str, models)))}")
    rows = [row for label, a in zip(labels, artifacts)
            for row in point_rows(a, label, slo_ttft_ms if recompute else None, slo_tpot_ms if recompute else None)]
    created = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return ServingReport(artifacts, list(labels), rows, axis, slo_ttft_ms, slo_tpot_ms, notes, created)


# ---------------------------------------------------------------------------------------------- files
def safe_paths(paths: Sequence[Path], overwrite: bool) -> list[Path]:
    """The paths to write: ``paths`` themselves when ``overwrite`` or none of them exists; else the same
    names in a fresh subfolder named by the UTC time (``YYYYmmdd-HHMMSS``, ``-2``... if taken) of each
    path's folder, so an earlier result is never replaced silently."""
    paths = [Path(p) for p in paths]
    if overwrite or not any(p.exists() for p in paths):
        return paths
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    for n in range(1, 1000):
        name = stamp if n == 1 else f"{stamp}-{n}"
        moved = [p.parent / name / p.name for p in paths]
        if not any(p.parent.exists() for p in moved):
            return moved
    raise FileExistsError(f"no free timestamped folder next to {paths[0]}")  # pragma: no cover


# ---------------------------------------------------------------------------------------------- plots
_PANELS = {  # panel: (title, row key prefix or key, y unit)
    "ttft": ("Time to first token", "ttft_ms", "ms"),
    "tpot": ("Time per output token", "tpot_ms", "ms"),
    "itl": ("Inter-token latency", "itl_ms", "ms"),
    "throughput": ("Output throughput", "output_tokens_per_s", "output tokens/s"),
    "goodput": ("Goodput", "goodput_requests_per_s", "requests/s"),
}


def _x_values(report: ServingReport) -> tuple[list[Any], list[str], str]:
    """The load values in plotting order, their tick labels and the axis title. Points sit at equal
    spacing (a categorical axis): ``inf`` has a place, and ticks are the measured loads, never fractions."""
    if report.axis == "request_rate":
        values = sorted({r["request_rate"] for r in report.rows}, key=_rate)
        ticks = ["inf" if v is None else f"{v:g}" for v in values]
        return values, ticks, "request rate (requests/s, Poisson arrivals; inf: all at once)"
    values = sorted({r["concurrency"] for r in report.rows}, key=lambda v: math.inf if v is None else v)
    return values, ["none" if v is None else str(v) for v in values], "concurrency (most requests in flight)"


def _draw(ax: Any, report: ServingReport, panel: str) -> None:
    title, key, unit = _PANELS[panel]
    values, ticks, xlabel = _x_values(report)
    position = {v: i for i, v in enumerate(values)}
    for i, label in enumerate(report.labels):
        rows = [r for r in report.rows if r["label"] == label]
        xs = [position[r[report.axis]] for r in rows]
        color = f"C{i % 10}"

        def ys(column: str, rows: list[dict[str, Any]] = rows) -> list[float]:
            return [math.nan if r[column] is None else r[column] for r in rows]

        if panel in ("ttft", "tpot", "itl"):
            ax.plot(xs, ys(f"{key}_p50"), marker="o", color=color, label=f"{label} p50")
            ax.plot(xs, ys(f"{key}_p99"), marker="^", linestyle="--", color=color, label=f"{label} p99")
        elif panel == "goodput":
            ax.plot(xs, ys(key), marker="o", color=color, label=f"{label} goodput")
            ax.plot(xs, ys("requests_per_s"), marker=".", linestyle=":", color=color, label=f"{label} all requests")
        else:
            ax.plot(xs, ys(key), marker="o", color=color, label=label)
    if panel == "goodput":
        title += f" (TTFT <= {_num(report.slo_ttft_ms, 0)} ms, TPOT <= {_num(report.slo_tpot_ms, 0)} ms)"
    elif panel in ("ttft", "tpot", "itl"):
        title += " (p50 solid, p99 dashed)"
    ax.set_title(title, fontsize=10)
    ax.set_xticks(range(len(values)), ticks)
    ax.set_xlabel(xlabel, fontsize=9)
    ax.set_ylabel(unit)
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)


def _save(plt: Any, fig: Any, report: ServingReport, path: Path, width_chars: int) -> Path:
    footer = "\n".join(textwrap.wrap(report.context(), width_chars))
    lines = footer.count("\n") + 1
    height = fig.get_size_inches()[1]
    bottom = min(0.4, (lines * 0.16 + 0.15) / height)  # inches of 7-pt text, as a share of the figure
    fig.text(0.01, 0.01, footer, fontsize=7, va="bottom", ha="left", family="monospace")
    fig.tight_layout(rect=(0, bottom, 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _plot_suite(report: ServingReport, directory: Path, prefix: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(2, 2, figsize=(12, 9))
    for ax, panel in zip(axes.flat, ("ttft", "tpot", "throughput", "goodput")):
        _draw(ax, report, panel)
    fig.suptitle("Serving benchmark: " + " vs ".join(report.labels))
    out = [_save(plt, fig, report, directory / f"{prefix}_dashboard.png", 170)]
    for panel in _PANELS:
        fig, ax = plt.subplots(figsize=(8, 5.5))
        _draw(ax, report, panel)
        out.append(_save(plt, fig, report, directory / f"{prefix}_{panel}.png", 115))
    return out
