"""The benchmarking commands: ``bench`` (one model over batch sizes), ``compare`` (several backends) and
``bench-serve`` (load-test an OpenAI-compatible server), with their progress bar and artifact writing.

The functions are plain; :mod:`llminfer.cli` registers them on the Typer app. A bad flag value raises
typer.BadParameter (exit code 2); ``bench-serve`` exits 1 when every request failed.
"""

from __future__ import annotations

from typing import Annotated

import typer

from llminfer.cli.options import (
    ArtifactsDir,
    AttnBackend,
    BackendOpt,
    BatchSize,
    BatchSizes,
    CsvOut,
    Device,
    Dtype,
    JsonOut,
    KVBytes,
    LogLevel,
    MaxNew,
    Model,
    NoPrefix,
    PlotOpt,
    PlotSuite,
    PPSize,
    PromptLen,
    Runs,
    Seed,
    TPSize,
    Warmup,
    build_config,
    check_log_level,
    load_engine,
    split_csv,
)
from llminfer.config import Backend, EngineConfig


def _int_list(value: str, flag: str) -> list[int]:
    try:
        out = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise typer.BadParameter(f"{flag} takes comma-separated integers, got {value!r}") from None
    if not out or any(v <= 0 for v in out):
        raise typer.BadParameter(f"{flag} takes positive integers, got {value!r}")
    return out


class _Progress:
    """A rich progress bar driven by the benchmark's ``progress(label)`` callback."""

    def __init__(self, total: int) -> None:
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), transient=True)
        self.task = self.bar.add_task("benchmark", total=total)

    def __enter__(self):
        self.bar.__enter__()
        return self

    def __exit__(self, *exc):
        self.bar.__exit__(*exc)

    def __call__(self, label: str) -> None:
        self.bar.update(self.task, advance=1, description=label)


def _write_outputs(result, artifacts_dir, json_out, csv_out, plot, plot_suite_dir, prefix: str) -> None:
    paths = result.save_artifacts(artifacts_dir or ".", json_out=json_out, csv_out=csv_out)
    typer.echo(f"artifacts: {paths['json']} {paths['csv']}")
    if plot:
        typer.echo(f"plot: {result.plot(plot)}")
    if plot_suite_dir:
        from llminfer.benchmark.plots import suite

        series = ({"llminfer": result.summary()} if hasattr(result, "summary")
                  else {n: r.summary() for n, r in result.results.items()})
        typer.echo("plots: " + " ".join(str(p) for p in suite(series, plot_suite_dir, prefix)))



def bench(
    model: Model = None, batch_sizes: BatchSizes = "1,2,4,8", runs: Runs = 3, warmup: Warmup = 1,
    max_new_tokens: MaxNew = 64, prompt_len: PromptLen = 32,
    continuous: Annotated[bool, typer.Option("--continuous/--static", help="Continuous or static batching.")] = True,
    paged_kv: Annotated[bool, typer.Option("--paged-kv/--no-paged-kv", help="Paged KV blocks, or one "
                                           "max_model_len region per sequence.")] = True,
    page_size_tokens: Annotated[int, typer.Option("--page-size-tokens", help="KV block size in tokens.")] = 16,
    backend: BackendOpt = Backend.EAGER, dtype: Dtype = "auto", device: Device = "auto",
    max_batch_size: BatchSize = 16, no_prefix_cache: NoPrefix = False, kv_cache_bytes: KVBytes = None,
    artifacts_dir: ArtifactsDir = None, json_out: JsonOut = None, csv_out: CsvOut = None, plot: PlotOpt = None,
    plot_suite_dir: PlotSuite = None, log_level: LogLevel = "warning",
    attention_backend: AttnBackend = "auto",
) -> None:
    """Benchmark one model over batch sizes; print a summary table and write benchmark.json / .csv."""
    from llminfer.benchmark import Benchmarker

    sizes = _int_list(batch_sizes, "--batch-sizes")
    cfg = build_config(model=model, backend=backend, dtype=dtype, device=device,
                       max_batch_size=max(max_batch_size, max(sizes)), page_size=page_size_tokens,
                       no_prefix_cache=no_prefix_cache, kv_cache_bytes=kv_cache_bytes,
                       attention_backend=attention_backend)
    cfg.cache.enable_paged_kv = paged_kv
    with load_engine(cfg, log_level) as engine, _Progress(len(sizes) * (runs + warmup)) as progress:
        try:
            result = Benchmarker(engine, prompt_len=prompt_len).run(sizes, runs, max_new_tokens, warmup,
                                                                    continuous, progress=progress)
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None
    result.print_summary()
    _write_outputs(result, artifacts_dir, json_out, csv_out, plot, plot_suite_dir, "benchmark")


def compare(
    model: Model = None,
    backends: Annotated[str, typer.Option("--backends", help="Comma-separated: eager,compiled,vllm.")] = "eager",
    batch_sizes: BatchSizes = "1,4", runs: Runs = 2, warmup: Warmup = 1, max_new_tokens: MaxNew = 32,
    prompt_len: PromptLen = 32, dtype: Dtype = "auto", device: Device = "auto", tp_size: TPSize = 1,
    pp_size: PPSize = 1,
    compile_cudagraphs: Annotated[bool, typer.Option("--compile-cudagraphs", help="CUDA graphs for the "
                                                     "compiled backend.")] = False,
    artifacts_dir: ArtifactsDir = None, json_out: JsonOut = None, csv_out: CsvOut = None, plot: PlotOpt = None,
    plot_suite_dir: PlotSuite = None, log_level: LogLevel = "warning",
) -> None:
    """Run the same benchmark on several backends; a backend that cannot run here is reported as skipped."""
    from llminfer.benchmark import BackendComparison
    from llminfer.logging import configure_logging

    check_log_level(log_level)
    configure_logging(log_level)
    names = split_csv(backends)
    for name in names:
        try:
            Backend(name)
        except ValueError:
            raise typer.BadParameter(f"--backends: unknown backend {name!r} (eager, compiled, vllm)") from None
    sizes = _int_list(batch_sizes, "--batch-sizes")
    base = EngineConfig(model_name=model, dtype=dtype, device=device, max_batch_size=max(16, max(sizes)),
                        compile_cudagraphs=compile_cudagraphs)
    if tp_size > 1 or pp_size > 1:
        base = EngineConfig(**{**{f: getattr(base, f) for f in ("model_name", "dtype", "device", "max_batch_size",
                                                              "compile_cudagraphs")},
                               "tp_size": tp_size, "pp_size": pp_size, "backend": Backend.VLLM})
    with _Progress(len(names) * len(sizes) * (runs + warmup)) as progress:
        try:
            result = BackendComparison(model, names, base).run(sizes, runs, max_new_tokens, warmup, prompt_len,
                                                               progress=progress)
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None
    result.print_table()
    if result.results:
        _write_outputs(result, artifacts_dir, json_out, csv_out, plot, plot_suite_dir, "comparison")
    else:
        raise typer.BadParameter("no backend could run here: " + "; ".join(f"{k}: {v}" for k, v in
                                                                           result.skipped.items()))


def bench_serve(
    base_url: Annotated[str, typer.Option("--base-url", help="Server root, e.g. http://127.0.0.1:8000.")] =
    "http://127.0.0.1:8000",
    model: Annotated[str | None, typer.Option("--model", help="Model name to send (default: the server's first).")]
    = None,
    num_requests: Annotated[int, typer.Option("--num-requests", help="Requests to send.")] = 100,
    request_rate: Annotated[float, typer.Option("--request-rate", help="Poisson arrivals per second (inf: all "
                                                "at once).")] = float("inf"),
    concurrency: Annotated[int | None, typer.Option("--concurrency", help="Most requests in flight.")] = None,
    prompt_len: Annotated[str, typer.Option("--prompt-len", help="Prompt words, MIN,MAX.")] = "16,128",
    output_len: Annotated[str, typer.Option("--output-len", help="max_tokens, MIN,MAX.")] = "16,128",
    prompts_file: Annotated[str | None, typer.Option("--prompts-file", help='JSONL of {"prompt", "max_tokens"}.')]
    = None,
    endpoint: Annotated[str, typer.Option("--endpoint", help="completions or chat.")] = "completions",
    api_key: Annotated[str | None, typer.Option("--api-key", help="Bearer token.")] = None,
    ignore_eos: Annotated[bool, typer.Option("--ignore-eos", help="Send ignore_eos=true (vLLM, llminfer).")] = False,
    slo_ttft_ms: Annotated[float, typer.Option("--slo-ttft-ms", help="TTFT objective for goodput (ms).")] = 1000.0,
    slo_tpot_ms: Annotated[float, typer.Option("--slo-tpot-ms", help="TPOT objective for goodput (ms).")] = 200.0,
    seed: Seed = 0, artifacts_dir: ArtifactsDir = None, json_out: JsonOut = None, csv_out: CsvOut = None,
) -> None:
    """Load-test an OpenAI-compatible server (llminfer, vLLM, TGI) and report TTFT/TPOT/ITL/E2E and goodput."""
    from llminfer.benchmark.serving import ServingConfig, ServingWorkload, run_serving_benchmark_sync

    if num_requests < 1:
        raise typer.BadParameter(f"--num-requests must be >= 1, got {num_requests}")
    if concurrency is not None and concurrency < 1:
        raise typer.BadParameter(f"--concurrency must be >= 1 (omit it for no limit), got {concurrency}")
    if endpoint not in ("completions", "chat"):
        raise typer.BadParameter(f"--endpoint must be completions or chat, got {endpoint!r}")
    p_lo, p_hi = (_int_list(prompt_len, "--prompt-len") * 2)[:2]
    o_lo, o_hi = (_int_list(output_len, "--output-len") * 2)[:2]
    cfg = ServingConfig(base_url=base_url, model=model, request_rate=request_rate, concurrency=concurrency,
                        endpoint=endpoint, api_key=api_key, extra_body={"ignore_eos": True} if ignore_eos else {},
                        slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=slo_tpot_ms)
    workload = ServingWorkload(num_requests=num_requests, prompt_len=(p_lo, p_hi), output_len=(o_lo, o_hi),
                               prompts_file=prompts_file, seed=seed or 0)
    try:
        result = run_serving_benchmark_sync(cfg, workload)
    except (OSError, ValueError) as exc:
        raise typer.BadParameter(str(exc)) from None
    except Exception as exc:  # httpx errors: unreachable server, 401 without --api-key, ...
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise typer.BadParameter(f"request to {base_url} failed: {type(exc).__name__}: {first}") from None
    if result.summary["completed"] == 0:
        first = next((r["error"] for r in result.requests if r.get("error")), "unknown error")
        typer.echo(f"error: all {num_requests} requests failed; first error: {first}", err=True)
        raise typer.Exit(1)
    result.print_summary()
    paths = result.save_artifacts(artifacts_dir or ".", json_out=json_out, csv_out=csv_out)
    typer.echo(f"artifacts: {paths['json']} {paths['csv']}")
