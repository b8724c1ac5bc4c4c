"""The benchmarking commands: ``bench`` (one model over batch sizes), ``compare`` (several backends) and
``bench-serve`` (load-test an OpenAI-compatible server), with their progress bar and artifact writing.

The functions are plain; :mod:`llminfer.cli` registers them on the Typer app. A bad flag value raises
typer.BadParameter (exit code 2); ``bench-serve`` exits 1 when every request failed.
"""

from __future__ import annotations

from typing import Annotated

import typer

from llminfer.cli.engine_options import EngineOptions, engine_options
from llminfer.cli.options import (
    ArtifactsDir,
    BatchSizes,
    CsvOut,
    JsonOut,
    LogLevel,
    MaxNew,
    PlotOpt,
    PlotSuite,
    PromptLen,
    Runs,
    Seed,
    Warmup,
    check_log_level,
    flag_error,
    load_engine,
    split_csv,
)
from llminfer.config import Backend


def _int_list(value: str, flag: str) -> list[int]:
    try:
        out = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise typer.BadParameter(f"{flag} takes comma-separated integers, got {value!r}") from None
    if not out or any(v <= 0 for v in out):
        raise typer.BadParameter(f"{flag} takes positive integers, got {value!r}")
    return out


class _Progress:
    """A rich progress bar driven by the benchmark's ``progress(label)`` callback: what runs now (backend,
    batch size, run), steps done of the total and the elapsed time. Nothing at all when stdout is not a
    terminal (pipes, CI logs, tests).

    Args:
        total: steps (each call of the callback starts one: a model load or a run).
        title: shown before the label (the model).
    """

    def __init__(self, total: int, title: str = "") -> None:
        import sys

        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            SpinnerColumn,
            TextColumn,
            TimeElapsedColumn,
        )

        self.bar = Progress(SpinnerColumn(), TextColumn(title, markup=False), TextColumn("{task.description}", markup=False),
                            BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), transient=True,
                            disable=not sys.stdout.isatty())
        self.task = self.bar.add_task("starting", total=total)
        self._steps = 0

    def __enter__(self):
        self.bar.__enter__()
        return self

    def __exit__(self, *exc):
        self.bar.__exit__(*exc)

    def __call__(self, label: str) -> None:
        """Mark the step before as done and show ``label`` as the one running now."""
        self.bar.update(self.task, completed=self._steps, description=label)
        self._steps += 1


def _plan_outputs(stem: str, artifacts_dir: str | None, json_out: str | None, csv_out: str | None,
                  plot: str | None, plot_suite_dir: str | None, overwrite: bool) -> dict:
    """Where each asked-for output goes, decided before the model loads: explicit paths that exist are
    refused without ``--overwrite``; a folder that holds earlier outputs gets a fresh timestamped subfolder.

    Returns ``{"json", "csv", "plot", "suite"}`` (only what was asked) and ``"moved"`` (notes).

    Raises:
        typer.BadParameter: an explicit path exists and ``--overwrite`` was not given.
    """
    from pathlib import Path

    from llminfer.benchmark import artifacts
    from llminfer.benchmark.plots import suite_names

    plan: dict = {"moved": []}
    try:
        for key, flag, value in (("json", "--json-out", json_out), ("csv", "--csv-out", csv_out),
                                 ("plot", "--plot", plot)):
            if value:
                if key == "plot":
                    artifacts.check_plot_path(value)
                plan[key] = artifacts.check_new(value, overwrite, flag)
                artifacts.check_writable_folder(plan[key].parent, flag)
        for flag, value in (("--artifacts-dir", artifacts_dir), ("--plot-suite-dir", plot_suite_dir)):
            if value:
                artifacts.check_writable_folder(value, flag)
    except (OSError, ValueError) as exc:  # FileExistsError is an OSError
        raise typer.BadParameter(str(exc)) from None
    stamp = artifacts.timestamp()
    art_names = [f"{stem}.{k}" for k in ("json", "csv") if k not in plan]
    folders = {}  # folder -> the names it will get
    if artifacts_dir and art_names:
        folders.setdefault(Path(artifacts_dir).resolve(), []).extend(art_names)
    if plot_suite_dir:
        folders.setdefault(Path(plot_suite_dir).resolve(), []).extend(suite_names(stem))
    chosen = {}
    for folder, names in folders.items():
        chosen[folder] = artifacts.fresh_folder(folder, names, overwrite, stamp)
        if chosen[folder] != folder:
            plan["moved"].append(f"{folder} already holds {stem} outputs; writing into {chosen[folder]} "
                                 "(--overwrite replaces them instead)")
    if artifacts_dir and art_names:
        folder = chosen[Path(artifacts_dir).resolve()]
        for name in art_names:
            plan[name.rsplit(".", 1)[1]] = folder / name
    if plot_suite_dir:
        plan["suite"] = chosen[Path(plot_suite_dir).resolve()]
    return plan


def _write_outputs(result, plan: dict, prefix: str) -> None:
    """Write what :func:`_plan_outputs` decided, and say where."""
    for note in plan["moved"]:
        typer.echo(f"note: {note}")
    if "json" in plan or "csv" in plan:
        paths = result.save_artifacts(None, json_out=plan.get("json"), csv_out=plan.get("csv"), overwrite=True)
        typer.echo("artifacts: " + " ".join(str(p) for p in paths.values()))
    if "plot" in plan:
        typer.echo(f"plot: {result.plot(plan['plot'])}")
    if "suite" in plan:
        typer.echo("plots: " + " ".join(str(p) for p in result.plot_suite(plan["suite"], prefix)))
    if not {"json", "csv", "plot", "suite"} & set(plan):
        typer.echo("no files written (--artifacts-dir, --json-out, --csv-out, --plot or --plot-suite-dir "
                   "writes them)")


def _check_settings(sizes: list[int], runs: int, max_new_tokens: int, warmup: int, prompt_len: int) -> None:
    from llminfer.benchmark.settings import check_settings

    try:
        check_settings(sizes, runs, max_new_tokens, warmup, prompt_len)
    except ValueError as exc:
        raise flag_error(str(exc), _SETTING_FLAGS) from None


_SETTING_FLAGS = {"batch sizes": "--batch-sizes", "runs": "--runs", "max_new_tokens": "--max-new-tokens",
                  "warmup": "--warmup", "prompt_len": "--prompt-len"}


Continuous = Annotated[bool, typer.Option("--continuous/--static", help="Continuous or static batching.")]
Overwrite = Annotated[bool, typer.Option("--overwrite", help="Replace existing output files (else a folder gets a "
                                         "fresh timestamped subfolder and an existing explicit path is an error).")]
#: The old spelling of ``--page-size`` (hidden; it counts when ``--page-size`` is left at its default).
PageSizeTokens = Annotated[int | None, typer.Option("--page-size-tokens", hidden=True)]


def _page_size(engine_opts: EngineOptions, page_size_tokens: int | None) -> int:
    """``--page-size``, or the old ``--page-size-tokens`` when ``--page-size`` is left at its default."""
    if page_size_tokens is not None and engine_opts.page_size == 16:
        return page_size_tokens
    return engine_opts.page_size


#: the engine flags bench and compare do not offer
_NOT_BENCHED = ("max_model_len", "hf_token", "local_files_only", "cache_dir", "quant", "adapter", "adapter_name",
                "compile_mode", "assistant_model", "spec_num_assistant_tokens", "spec_confidence_threshold",
                "spec_method", "spec_prompt_lookup_max", "spec_prompt_lookup_min")


@engine_options(exclude=("tp_size", "pp_size", *_NOT_BENCHED))
def bench(
    engine_opts: EngineOptions = EngineOptions(), batch_sizes: BatchSizes = "1,2,4,8", runs: Runs = 3,
    warmup: Warmup = 1, max_new_tokens: MaxNew = 64, prompt_len: PromptLen = 32, continuous: Continuous = True,
    paged_kv: Annotated[bool, typer.Option("--paged-kv/--no-paged-kv", help="Paged KV blocks, or one "
                                           "max_model_len region per sequence.")] = True,
    page_size_tokens: PageSizeTokens = None,
    artifacts_dir: ArtifactsDir = None, json_out: JsonOut = None, csv_out: CsvOut = None, plot: PlotOpt = None,
    plot_suite_dir: PlotSuite = None, overwrite: Overwrite = False,
) -> None:
    """Benchmark one model over batch sizes: latency percentiles over every request, throughput spread over
    runs, memory per batch size. Writes files only where asked (--artifacts-dir, --json-out, --csv-out,
    --plot, --plot-suite-dir)."""
    sizes = _int_list(batch_sizes, "--batch-sizes")
    _check_settings(sizes, runs, max_new_tokens, warmup, prompt_len)
    check_log_level(engine_opts.log_level)
    cfg = engine_opts.to_config(check=False, max_batch_size=max(engine_opts.max_batch_size, max(sizes)),
                                page_size=_page_size(engine_opts, page_size_tokens))
    cfg.cache.enable_paged_kv = paged_kv
    plan = _plan_outputs("benchmark", artifacts_dir, json_out, csv_out, plot, plot_suite_dir, overwrite)

    from llminfer.benchmark import Benchmarker
    from llminfer.benchmark.comparison import backend_progress
    from llminfer.benchmark.environment import (
        current_rss_bytes,
        preload_model_libraries,
        release_freed_memory,
    )

    preload_model_libraries()
    release_freed_memory()
    baseline = current_rss_bytes()
    backend = engine_opts.backend
    with _Progress(1 + len(sizes) * (runs + warmup), engine_opts.model or "built-in model") as progress:
        progress(f"{backend.value} · loading")
        with load_engine(cfg, engine_opts.log_level) as engine:
            try:
                result = Benchmarker(engine, prompt_len=prompt_len, baseline_rss_bytes=baseline).run(
                    sizes, runs, max_new_tokens, warmup, continuous,
                    progress=backend_progress(backend.value, progress))
            except ValueError as exc:
                raise typer.BadParameter(str(exc)) from None
    result.print_summary()
    _write_outputs(result, plan, "benchmark")


@engine_options(exclude=("backend", "attention_backend", *_NOT_BENCHED))
def compare(
    engine_opts: EngineOptions = EngineOptions(),
    backends: Annotated[str, typer.Option("--backends", help="Comma-separated: eager,compiled,vllm.")] = "eager",
    batch_sizes: BatchSizes = "1,4", runs: Runs = 2, warmup: Warmup = 1, max_new_tokens: MaxNew = 32,
    prompt_len: PromptLen = 32, continuous: Continuous = True, page_size_tokens: PageSizeTokens = None,
    compile_cudagraphs: Annotated[bool, typer.Option("--compile-cudagraphs", help="CUDA graphs for the "
                                                     "compiled backend (ignored, with a note, for the others).")]
    = False,
    artifacts_dir: ArtifactsDir = None, json_out: JsonOut = None, csv_out: CsvOut = None, plot: PlotOpt = None,
    plot_suite_dir: PlotSuite = None, overwrite: Overwrite = False,
) -> None:
    """Run the same benchmark on several backends, one engine at a time, each with its own memory figures.
    --tp-size / --pp-size apply to vllm and --compile-cudagraphs to compiled; the others ignore them with a
    note. A backend that cannot run here is reported as skipped."""
    import attrs

    names = split_csv(backends)
    for name in names:
        try:
            Backend(name)
        except ValueError:
            raise typer.BadParameter(f"--backends: unknown backend {name!r} (eager, compiled, vllm)") from None
    if not names or len(set(names)) != len(names):
        raise typer.BadParameter(f"--backends takes distinct backend names, got {backends!r}")
    sizes = _int_list(batch_sizes, "--batch-sizes")
    _check_settings(sizes, runs, max_new_tokens, warmup, prompt_len)
    check_log_level(engine_opts.log_level)
    # Each backend gets the settings that mean it (BackendComparison.config_for): --tp-size / --pp-size are
    # set after validate(), which would refuse them for the eager backend.
    base = engine_opts.to_config(check=False, max_batch_size=max(engine_opts.max_batch_size, max(sizes)),
                                 page_size=_page_size(engine_opts, page_size_tokens), tp_size=1, pp_size=1,
                                 compile_cudagraphs=compile_cudagraphs)
    base = attrs.evolve(base, tp_size=engine_opts.tp_size, pp_size=engine_opts.pp_size)
    plan = _plan_outputs("comparison", artifacts_dir, json_out, csv_out, plot, plot_suite_dir, overwrite)

    from llminfer.benchmark import BackendComparison
    from llminfer.logging import configure_logging

    configure_logging(engine_opts.log_level)
    comparison = BackendComparison(engine_opts.model, names, base)
    for name, notes in comparison.notes().items():
        for note in notes:
            typer.echo(f"note: {name}: {note}", err=True)
    with _Progress(len(names) * (1 + len(sizes) * (runs + warmup)), engine_opts.model or "built-in model") \
            as progress:
        try:
            result = comparison.run(sizes, runs, max_new_tokens, warmup, prompt_len, progress=progress,
                                    continuous=continuous)
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None
    result.print_table()
    if not result.results:
        raise typer.BadParameter("no backend could run here: " + "; ".join(f"{k}: {v}" for k, v in
                                                                           result.skipped.items()))
    _write_outputs(result, plan, "comparison")


def bench_serve(
    base_url: Annotated[str, typer.Option("--base-url", help="Server root, e.g. http://127.0.0.1:8000.")] =
    "http://127.0.0.1:8000",
    model: Annotated[str | None, typer.Option("--model", help="Model name to send (default: the server's first).")]
    = None,
    num_requests: Annotated[int, typer.Option("--num-requests", help="Requests to send (per load point).")] = 100,
    request_rate: Annotated[str, typer.Option("--request-rate", "--request-rates", help="Poisson arrivals per "
                                              "second (inf: all at once); a list such as 1,2,4,inf sweeps them.")]
    = "inf",
    concurrency: Annotated[str | None, typer.Option("--concurrency", "--max-concurrency", help="Most requests "
                                                    "in flight; a list such as 1,8,32 sweeps them.")] = None,
    prompt_len: Annotated[str, typer.Option("--prompt-len", help="Prompt words, MIN,MAX.")] = "16,128",
    output_len: Annotated[str, typer.Option("--output-len", help="max_tokens, MIN,MAX.")] = "16,128",
    prompts_file: Annotated[str | None, typer.Option("--prompts-file", help='JSONL of {"prompt", "max_tokens"}.')]
    = None,
    endpoint: Annotated[str, typer.Option("--endpoint", help="completions or chat.")] = "completions",
    api_key: Annotated[str | None, typer.Option("--api-key", help="Bearer token.")] = None,
    ignore_eos: Annotated[bool, typer.Option("--ignore-eos", help="Send ignore_eos=true (vLLM, llminfer).")] = False,
    slo_ttft_ms: Annotated[float, typer.Option("--slo-ttft-ms", help="TTFT objective for goodput (ms).")] = 1000.0,
    slo_tpot_ms: Annotated[float, typer.Option("--slo-tpot-ms", help="TPOT objective for goodput (ms).")] = 200.0,
    label: Annotated[str | None, typer.Option("--label", help="Name of this server in the artifact (bench-report's "
                                              "default label).")] = None,
    warmup_requests: Annotated[int, typer.Option("--warmup-requests", help="Requests sent first and left out "
                                                 "of the figures.")] = 1,
    seed: Seed = 0, artifacts_dir: ArtifactsDir = None, json_out: JsonOut = None, csv_out: CsvOut = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace earlier artifacts (default: a fresh "
                                            "timestamped subfolder).")] = False,
    log_level: LogLevel = "warning",
) -> None:
    """Load-test an OpenAI-compatible server (llminfer, vLLM, TGI, llama.cpp) and report TTFT/TPOT/ITL/E2E
    and goodput, once per load point of a sweep; the JSON artifact feeds bench-report."""
    from pathlib import Path

    from llminfer.benchmark.report import safe_paths
    from llminfer.benchmark.serving import run_serving_sweep_sync
    from llminfer.benchmark.serving_load import (
        ServingConfig,
        ServingWorkload,
        load_points,
        parse_concurrencies,
        parse_request_rates,
    )
    from llminfer.cli.report import ServeProgress

    check_log_level(log_level)
    from llminfer.logging import configure_logging

    configure_logging(log_level)
    if num_requests < 1:
        raise typer.BadParameter(f"--num-requests must be >= 1, got {num_requests}")
    if endpoint not in ("completions", "chat"):
        raise typer.BadParameter(f"--endpoint must be completions or chat, got {endpoint!r}")
    if warmup_requests < 0:
        raise typer.BadParameter(f"--warmup-requests must be >= 0, got {warmup_requests}")
    try:
        points = load_points(parse_request_rates(request_rate), parse_concurrencies(concurrency))
    except ValueError as exc:
        raise typer.BadParameter(f"--request-rate / --concurrency: {exc}") from None
    p_lo, p_hi = (_int_list(prompt_len, "--prompt-len") * 2)[:2]
    o_lo, o_hi = (_int_list(output_len, "--output-len") * 2)[:2]
    cfg = ServingConfig(base_url=base_url, model=model, endpoint=endpoint, api_key=api_key,
                        extra_body={"ignore_eos": True} if ignore_eos else {},
                        slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=slo_tpot_ms, label=label,
                        warmup_requests=warmup_requests)
    workload = ServingWorkload(num_requests=num_requests, prompt_len=(p_lo, p_hi), output_len=(o_lo, o_hi),
                               prompts_file=prompts_file, seed=seed or 0)
    from llminfer.benchmark import artifacts

    folder = Path(artifacts_dir) if artifacts_dir else None
    try:  # where the files go is decided before the run (as in bench): nothing measured is lost to a bad path
        explicit = {k: artifacts.check_new(v, overwrite, flag) for k, flag, v in
                    (("json", "--json-out", json_out), ("csv", "--csv-out", csv_out)) if v}
        for k, path in explicit.items():
            artifacts.check_writable_folder(path.parent, "--json-out" if k == "json" else "--csv-out")
        if folder is not None:
            artifacts.check_writable_folder(folder, "--artifacts-dir")
    except OSError as exc:
        raise typer.BadParameter(str(exc)) from None
    try:
        with ServeProgress() as progress:
            result = run_serving_sweep_sync(cfg, workload, points, progress)
    except (OSError, ValueError) as exc:
        raise typer.BadParameter(str(exc)) from None
    except Exception as exc:  # httpx errors: unreachable server, 401 without --api-key, ...
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        hint = " (is the server running?)" if type(exc).__name__ in ("ConnectError", "ConnectTimeout") else ""
        typer.echo(f"error: request to {base_url} failed: {type(exc).__name__}: {first}{hint}", err=True)
        raise typer.Exit(1) from None
    if all(p.summary["completed"] == 0 for p in result.points):
        first = next((r["error"] for p in result.points for r in p.requests if r.get("error")), "unknown error")
        typer.echo(f"error: all {num_requests * len(points)} requests failed; first error: {first}", err=True)
        raise typer.Exit(1)
    s = result.server
    typer.echo(f"server: {s['base_url']} ({s['kind']}{' ' + s['version'] if s.get('version') else ''}), "
               f"model {s['model']}")
    result.print_summary()
    if not (artifacts_dir or json_out or csv_out):
        typer.echo("artifacts: none written (pass --artifacts-dir DIR or --json-out FILE to keep them)")
        return
    in_folder = [k for k in ("json", "csv") if k not in explicit and folder is not None]
    targets = dict(explicit)
    if in_folder:
        moved = safe_paths([folder / f"serving.{k}" for k in in_folder], overwrite)
        targets.update(zip(in_folder, moved))
        if moved[0].parent != folder:
            typer.echo(f"note: {folder} already holds serving outputs; writing into {moved[0].parent} "
                       "(--overwrite replaces them instead)")
    try:
        paths = result.write(json_path=targets.get("json"), csv_path=targets.get("csv"))
    except OSError as exc:
        raise typer.BadParameter(f"cannot write the artifacts: {exc}") from None
    typer.echo("artifacts: " + " ".join(str(p) for p in paths.values()))
