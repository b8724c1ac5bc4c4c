"""``llminfer bench-report``: combine ``bench-serve`` artifacts from several servers into one comparison
(a table, and with ``--out-dir`` a JSON / CSV of it and a plot suite), and the progress display of
``bench-serve`` (:class:`ServeProgress`).

Nothing heavy is imported at module level (polars, matplotlib, httpx load inside the functions), so
``llminfer --help`` stays fast. A bad input is one ``error:`` line and exit code 2.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from llminfer.cli.options import LogLevel, check_log_level


class ServeProgress:
    """A rich progress display for ``bench-serve``: one bar per load point with requests done / total,
    failures, requests in flight, the point's request rate / concurrency and the elapsed time.
    Off (a no-op) when stdout is not a terminal."""

    def __init__(self, enabled: bool | None = None, console: Any = None) -> None:
        self.enabled = sys.stdout.isatty() if enabled is None else enabled
        self.console = console  # a rich Console (default: stdout's)
        self.bar: Any = None
        self.tasks: dict[int, Any] = {}

    def __enter__(self) -> ServeProgress:
        if self.enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("{task.fields[extra]}"), TimeElapsedColumn(), transient=True,
                                console=self.console)
            self.bar.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)

    def __call__(self, state: Any) -> None:
        """Take a :class:`llminfer.benchmark.serving.SweepProgress`."""
        if self.bar is None:
            return
        if state.point_index not in self.tasks:
            desc = f"[{state.point_index + 1}/{state.num_points}] {state.point.label()}"
            self.tasks[state.point_index] = self.bar.add_task(desc, total=state.total, extra="")
        extra = f"in flight {state.in_flight}" + (f", {state.failed} failed" if state.failed else "")
        self.bar.update(self.tasks[state.point_index], completed=state.done, extra=extra)


def bench_report(
    files: Annotated[list[str], typer.Argument(help="bench-serve JSON artifacts (serving.json), one per server.",
                                               show_default=False)],
    labels: Annotated[str | None, typer.Option("--labels", help="Comma-separated server names, one per file "
                                               "(default: each artifact's --label, else its server kind).")] = None,
    out_dir: Annotated[str | None, typer.Option("--out-dir", help="Write report.json, report.csv and the "
                                                "report_*.png plots here (nothing is written without it).")]
    = None,
    slo_ttft_ms: Annotated[float | None, typer.Option("--slo-ttft-ms", help="TTFT objective for goodput (ms; "
                                                      "default: the artifacts' own).")] = None,
    slo_tpot_ms: Annotated[float | None, typer.Option("--slo-tpot-ms", help="TPOT objective for goodput (ms; "
                                                      "default: the artifacts' own).")] = None,
    no_plots: Annotated[bool, typer.Option("--no-plots", help="With --out-dir: only the JSON and CSV.")] = False,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an earlier report in --out-dir "
                                            "(default: write into a fresh timestamped subfolder).")] = False,
    log_level: LogLevel = "warning",
) -> None:
    """Compare bench-serve results of several servers (llminfer, vLLM, llama.cpp, TGI, ...): a table of
    TTFT / TPOT / ITL percentiles, throughput and goodput per server and load point, and plots."""
    from llminfer.benchmark.report import ReportError, build_report
    from llminfer.logging import configure_logging

    check_log_level(log_level)
    configure_logging(log_level)

    names = None
    if labels is not None:
        names = [n.strip() for n in labels.split(",")]
    try:
        report = build_report(files, names, slo_ttft_ms, slo_tpot_ms)
    except ReportError as exc:
        raise typer.BadParameter(str(exc)) from None
    report.print_table()
    if out_dir:
        try:
            written = report.save(out_dir, overwrite=overwrite, plots=not no_plots)
        except OSError as exc:
            raise typer.BadParameter(f"--out-dir {out_dir}: {exc.strerror or exc}") from None
        if written and written[0].parent.resolve() != Path(out_dir).resolve():
            typer.echo(f"note: {out_dir} already holds a report; writing into {written[0].parent} "
                       "(--overwrite replaces it instead)")
        typer.echo(f"report: {written[0].parent}/ " + " ".join(p.name for p in written))
