"""The ``llminfer`` command line (Typer): run, stream, info, serve."""

from __future__ import annotations

import json
import sys
from typing import Annotated, Any

import typer

try:  # typer >= 0.20 vendors its own click; older versions use click itself
    from typer._click import exceptions as click_exc
except ImportError:  # pragma: no cover
    from click import exceptions as click_exc

from llminfer.config import Backend, CacheConfig, EngineConfig, QuantConfig, QuantMode, SchedulerConfig
from llminfer.errors import LLMInferError

app = typer.Typer(
    name="llminfer",
    help="llminfer: a compact LLM inference and benchmarking engine. Runs offline on a built-in tiny model "
    "when no --model is given.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    add_completion=False,
)

# ---------------------------------------------------------------------------- shared options
Model = Annotated[str | None, typer.Option("--model", "-m", help="Hugging Face model id or local folder "
                                           "(default: the built-in tiny model).")]
BackendOpt = Annotated[Backend, typer.Option("--backend", help="Backend that runs the model step.")]
Dtype = Annotated[str, typer.Option("--dtype", help="auto, float32, bfloat16 or float16.")]
Device = Annotated[str, typer.Option("--device", help="auto, cpu, cuda or cuda:N.")]
MaxNew = Annotated[int, typer.Option("--max-new-tokens", "-n", help="Tokens to generate at most.")]
Temp = Annotated[float, typer.Option("--temp", "--temperature", help="0 = greedy.")]
TopP = Annotated[float, typer.Option("--top-p", help="Nucleus sampling threshold in (0, 1].")]
TopK = Annotated[int, typer.Option("--top-k", help="Keep the k most likely tokens (0 = off).")]
Seed = Annotated[int | None, typer.Option("--seed", help="Seed of this request's sampler.")]
Stop = Annotated[str | None, typer.Option("--stop", help='Comma-separated stop strings, e.g. "a,b"; '
                                          r'\n and \t stand for a newline and a tab.')]
IgnoreEos = Annotated[bool, typer.Option("--ignore-eos", help="Keep generating past EOS.")]
BatchSize = Annotated[int, typer.Option("--max-batch-size", help="Most sequences in one step.")]
PageSize = Annotated[int, typer.Option("--page-size", help="KV block size in tokens.")]
NoPrefix = Annotated[bool, typer.Option("--no-prefix-cache", help="Switch automatic prefix caching off.")]
KVBytes = Annotated[int | None, typer.Option("--kv-cache-bytes", help="KV pool budget in bytes.")]
MaxLen = Annotated[int | None, typer.Option("--max-model-len", help="Context length in tokens.")]
Revision = Annotated[str | None, typer.Option("--revision", help="Model revision (branch, tag or commit).")]
HFToken = Annotated[str | None, typer.Option("--hf-token", help="Hugging Face token (never logged).")]
LocalOnly = Annotated[bool, typer.Option("--local-files-only", help="Never touch the network.")]
CacheDir = Annotated[str | None, typer.Option("--cache-dir", help="Hugging Face cache folder.")]
TrustRemote = Annotated[bool, typer.Option("--trust-remote-code", help="Allow model code from the hub.")]
TPSize = Annotated[int, typer.Option("--tp-size", help="Tensor-parallel size (vLLM backend only).")]
PPSize = Annotated[int, typer.Option("--pp-size", help="Pipeline-parallel size (vLLM backend only).")]
LogLevel = Annotated[str, typer.Option("--log-level", help="debug, info, warning or error.")]
MinP = Annotated[float, typer.Option("--min-p", help="Drop tokens below min_p x the top probability.")]
RepPen = Annotated[float, typer.Option("--repetition-penalty", help="> 0; 1 = off (HF semantics).")]
NoRepeat = Annotated[int, typer.Option("--no-repeat-ngram-size", help="Never repeat an n-gram of this size.")]
BadWords = Annotated[str | None, typer.Option("--bad-words", help='Comma-separated words never generated.')]
ForceWords = Annotated[str | None, typer.Option("--force-words", help='Comma-separated phrases that must appear.')]
NSamples = Annotated[int, typer.Option("--n", help="Number of samples of the prompt.")]
Logprobs = Annotated[int | None, typer.Option("--logprobs", help="Show each token's logprob and top-N.")]
Assistant = Annotated[str | None, typer.Option("--assistant-model", help="Draft model for speculative "
                                               "decoding (same tokenizer as --model; 'builtin' allowed).")]
SpecK = Annotated[int, typer.Option("--spec-num-assistant-tokens", help="Draft tokens verified per step.")]
SpecC = Annotated[float, typer.Option("--spec-confidence-threshold",
                                      help="Stop drafting when the draft's top probability is below this.")]
QuantOpt = Annotated[QuantMode, typer.Option("--quant", help="Weight quantization through bitsandbytes "
                                             "(none, nf4, fp4, int8).")]
AdapterOpt = Annotated[str | None, typer.Option("--adapter", help="LoRA adapter (PEFT folder or hub id) "
                                                "loaded on top of the model.")]
AdapterName = Annotated[str | None, typer.Option("--adapter-name", help="Name of the --adapter (default: "
                                                 "its folder's name).")]
CompileMode = Annotated[str, typer.Option("--compile-mode", help="Compiled backend: default, reduce-overhead "
                                          "or max-autotune.")]


def sampling_kwargs(max_new_tokens: int, temp: float, top_p: float, top_k: int, seed: int | None,
                    stop: str | None, ignore_eos: bool, min_p: float = 0.0, repetition_penalty: float = 1.0,
                    no_repeat_ngram_size: int = 0, bad_words: str | None = None, force_words: str | None = None,
                    logprobs: int | None = None) -> dict[str, Any]:
    """CLI flags → ``InferenceEngine.make_request`` keyword arguments."""
    return dict(max_new_tokens=max_new_tokens, temperature=temp, top_p=top_p, top_k=top_k, seed=seed,
                stop_sequences=[x.replace("\\n", "\n").replace("\\t", "\t") for x in _split(stop)],
                ignore_eos=ignore_eos, min_p=min_p,
                repetition_penalty=repetition_penalty, no_repeat_ngram_size=no_repeat_ngram_size,
                bad_words=_split(bad_words), force_words=_split(force_words), logprobs=logprobs)


def build_config(
    model: str | None, backend: Backend, dtype: str, device: str, max_batch_size: int = 16,
    page_size: int = 16, no_prefix_cache: bool = False, kv_cache_bytes: int | None = None,
    max_model_len: int | None = None, revision: str | None = None, hf_token: str | None = None,
    local_files_only: bool = False, cache_dir: str | None = None, trust_remote_code: bool = False,
    tp_size: int = 1, pp_size: int = 1, assistant_model: str | None = None, spec_num_assistant_tokens: int = 5,
    spec_confidence_threshold: float = 0.4, quant: QuantMode | str = QuantMode.NONE, **extra: Any,
) -> EngineConfig:
    """Turn CLI flags into a validated :class:`EngineConfig` (raises ConfigError naming the field)."""
    return EngineConfig(
        model_name=model, backend=backend, dtype=dtype, device=device, max_batch_size=max_batch_size,
        max_model_len=max_model_len,
        cache=CacheConfig(page_size_tokens=page_size, enable_prefix_cache=not no_prefix_cache,
                          kv_cache_memory_bytes=kv_cache_bytes),
        quant=QuantConfig(mode=quant), scheduler=SchedulerConfig(),
        hf_revision=revision, hf_token=hf_token, hf_local_files_only=local_files_only, hf_cache_dir=cache_dir,
        hf_trust_remote_code=trust_remote_code, tp_size=tp_size, pp_size=pp_size,
        assistant_model_name=assistant_model, speculative_num_assistant_tokens=spec_num_assistant_tokens,
        speculative_confidence_threshold=spec_confidence_threshold, **extra,
    ).validate()


def _split(value: str | None) -> list[str]:
    return [s for s in (value or "").split(",") if s]


def _check_log_level(level: str) -> None:
    if level.lower() not in ("debug", "info", "warning", "error"):
        raise typer.BadParameter(f"--log-level must be debug, info, warning or error, got {level!r}")


def _engine(cfg: EngineConfig, log_level: str, adapter: str | None = None, adapter_name: str | None = None):
    from llminfer.engine import InferenceEngine
    from llminfer.logging import configure_logging

    _check_log_level(log_level)
    configure_logging(log_level)
    engine = InferenceEngine(cfg).load()
    if adapter:
        engine.load_adapter(adapter, adapter_name)
    elif adapter_name:
        from llminfer.errors import ConfigError

        raise ConfigError("--adapter-name needs --adapter")
    return engine


def _stats_line(stats) -> str:
    spec = ""
    if stats.spec_acceptance_rate is not None:
        spec = f" | draft acceptance {stats.spec_acceptance_rate:.0%}"
    return (f"[latency {stats.total_latency_ms:.1f} ms | TTFT {stats.ttft_ms:.1f} ms | "
            f"{stats.throughput_tokens_per_sec:.1f} tok/s | prompt {stats.prompt_tokens} tok | "
            f"completion {stats.completion_tokens} tok | cached {stats.cached_tokens} tok{spec}]")


@app.command()
def run(
    prompt: Annotated[str, typer.Argument(help="The prompt text.")],
    model: Model = None, max_new_tokens: MaxNew = 64, temp: Temp = 0.0, top_p: TopP = 1.0, top_k: TopK = 0,
    seed: Seed = None, stop: Stop = None, ignore_eos: IgnoreEos = False, min_p: MinP = 0.0,
    repetition_penalty: RepPen = 1.0, no_repeat_ngram_size: NoRepeat = 0, bad_words: BadWords = None,
    force_words: ForceWords = None, n: NSamples = 1, logprobs: Logprobs = None,
    assistant_model: Assistant = None, spec_num_assistant_tokens: SpecK = 5, spec_confidence_threshold: SpecC = 0.4,
    backend: BackendOpt = Backend.EAGER, dtype: Dtype = "auto", device: Device = "auto",
    max_batch_size: BatchSize = 16, page_size: PageSize = 16, no_prefix_cache: NoPrefix = False,
    kv_cache_bytes: KVBytes = None, max_model_len: MaxLen = None, revision: Revision = None,
    hf_token: HFToken = None, local_files_only: LocalOnly = False, cache_dir: CacheDir = None,
    trust_remote_code: TrustRemote = False, tp_size: TPSize = 1, pp_size: PPSize = 1,
    quant: QuantOpt = QuantMode.NONE, adapter: AdapterOpt = None, adapter_name: AdapterName = None,
    compile_mode: CompileMode = "default",
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as one JSON object.")] = False,
    log_level: LogLevel = "warning",
) -> None:
    """Generate for one prompt; print the text, then one stats line."""
    cfg = build_config(model, backend, dtype, device, max_batch_size, page_size, no_prefix_cache, kv_cache_bytes,
                       max_model_len, revision, hf_token, local_files_only, cache_dir, trust_remote_code,
                       tp_size, pp_size, assistant_model, spec_num_assistant_tokens, spec_confidence_threshold,
                       quant=quant, compile_mode=compile_mode)
    kw = sampling_kwargs(max_new_tokens, temp, top_p, top_k, seed, stop, ignore_eos, min_p, repetition_penalty,
                         no_repeat_ngram_size, bad_words, force_words, logprobs)
    with _engine(cfg, log_level, adapter, adapter_name) as engine:
        results = engine.run_n(prompt, n=n, **kw)
        tokenizer = engine.tokenizer
    if as_json:
        import attrs

        payload = [attrs.asdict(r) for r in results]
        typer.echo(json.dumps(payload[0] if n == 1 else payload))
        return
    for i, result in enumerate(results):
        if n > 1:
            typer.echo(f"--- sample {i} ---")
        typer.echo(result.generated_text)
        if logprobs is not None:
            for lp in result.logprobs:
                alts = "  ".join(f"{tokenizer.decode([t])!r}:{v:.3f}" for t, v in lp.top)
                typer.echo(f"  {tokenizer.decode([lp.token_id])!r:>20} {lp.logprob:8.3f}   {alts}")
        typer.echo(_stats_line(result.stats))


@app.command()
def stream(
    prompt: Annotated[str, typer.Argument(help="The prompt text.")],
    model: Model = None, max_new_tokens: MaxNew = 64, temp: Temp = 0.0, top_p: TopP = 1.0, top_k: TopK = 0,
    seed: Seed = None, stop: Stop = None, ignore_eos: IgnoreEos = False, min_p: MinP = 0.0,
    repetition_penalty: RepPen = 1.0, no_repeat_ngram_size: NoRepeat = 0, bad_words: BadWords = None,
    force_words: ForceWords = None,
    assistant_model: Assistant = None, spec_num_assistant_tokens: SpecK = 5, spec_confidence_threshold: SpecC = 0.4,
    backend: BackendOpt = Backend.EAGER, dtype: Dtype = "auto", device: Device = "auto",
    page_size: PageSize = 16, no_prefix_cache: NoPrefix = False, kv_cache_bytes: KVBytes = None,
    max_model_len: MaxLen = None, revision: Revision = None, hf_token: HFToken = None,
    local_files_only: LocalOnly = False, cache_dir: CacheDir = None, trust_remote_code: TrustRemote = False,
    tp_size: TPSize = 1, pp_size: PPSize = 1, quant: QuantOpt = QuantMode.NONE, adapter: AdapterOpt = None,
    adapter_name: AdapterName = None, compile_mode: CompileMode = "default", log_level: LogLevel = "warning",
) -> None:
    """Print tokens as they arrive, then one stats line."""
    cfg = build_config(model, backend, dtype, device, 16, page_size, no_prefix_cache, kv_cache_bytes,
                       max_model_len, revision, hf_token, local_files_only, cache_dir, trust_remote_code,
                       tp_size, pp_size, assistant_model, spec_num_assistant_tokens, spec_confidence_threshold,
                       quant=quant, compile_mode=compile_mode)
    with _engine(cfg, log_level, adapter, adapter_name) as engine:
        final = None
        kw = sampling_kwargs(max_new_tokens, temp, top_p, top_k, seed, stop, ignore_eos, min_p,
                             repetition_penalty, no_repeat_ngram_size, bad_words, force_words)
        for chunk in engine.stream(prompt, **kw):
            sys.stdout.write(chunk.token)
            sys.stdout.flush()
            if chunk.is_final:
                final = chunk
    typer.echo("")
    if final is not None and final.stats is not None:
        typer.echo(_stats_line(final.stats))


@app.command()
def info(
    model: Model = None, backend: BackendOpt = Backend.EAGER, dtype: Dtype = "auto", device: Device = "auto",
    max_batch_size: BatchSize = 16, page_size: PageSize = 16, kv_cache_bytes: KVBytes = None,
    max_model_len: MaxLen = None, revision: Revision = None, hf_token: HFToken = None,
    local_files_only: LocalOnly = False, cache_dir: CacheDir = None, trust_remote_code: TrustRemote = False,
    tp_size: TPSize = 1, pp_size: PPSize = 1, quant: QuantOpt = QuantMode.NONE, adapter: AdapterOpt = None,
    adapter_name: AdapterName = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    log_level: LogLevel = "warning",
) -> None:
    """Print the environment, the model (architecture, parameters, dtype, weight bytes before and after
    quantization) and KV capacity."""
    cfg = build_config(model, backend, dtype, device, max_batch_size, page_size, False, kv_cache_bytes,
                       max_model_len, revision, hf_token, local_files_only, cache_dir, trust_remote_code,
                       tp_size, pp_size, quant=quant)
    engine = _engine(cfg, log_level, adapter, adapter_name)
    facts = engine.info()
    if as_json:
        typer.echo(json.dumps(facts))
        return
    width = max(len(k) for k in facts)
    for key, value in facts.items():
        if key.endswith("_bytes") and isinstance(value, int):
            value = f"{value:,} bytes ({value / 2**20:.1f} MiB)"
        elif key == "parameters":
            value = f"{value:,}"
        typer.echo(f"{key:<{width}}  {value}")


@app.command()
def serve(
    model: Model = None, backend: BackendOpt = Backend.EAGER,
    host: Annotated[str, typer.Option("--host", help="Address to bind (default: loopback only).")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="TCP port.", min=0, max=65535)] = 8000,
    max_batch_size: BatchSize = 16,
    batch_timeout_ms: Annotated[float, typer.Option("--batch-timeout-ms", help="How long the scheduler waits "
                                                    "to fill a batch (ms).")] = 5.0,
    max_queue_size: Annotated[int, typer.Option("--max-queue-size", min=0, help="Requests accepted beyond the "
                                                "running batch; more get HTTP 429 with Retry-After.")] = 1024,
    api_key: Annotated[str | None, typer.Option("--api-key", envvar="LLMINFER_API_KEY", help="Require "
                                                "`Authorization: Bearer KEY` on /v1 (env LLMINFER_API_KEY).")] = None,
    served_model_name: Annotated[str | None, typer.Option("--served-model-name", help="Model id clients see "
                                                          "(default: the model id).")] = None,
    dtype: Dtype = "auto", device: Device = "auto", page_size: PageSize = 16, no_prefix_cache: NoPrefix = False,
    kv_cache_bytes: KVBytes = None, max_model_len: MaxLen = None, revision: Revision = None,
    hf_token: HFToken = None, local_files_only: LocalOnly = False, cache_dir: CacheDir = None,
    trust_remote_code: TrustRemote = False, tp_size: TPSize = 1, pp_size: PPSize = 1,
    quant: QuantOpt = QuantMode.NONE, adapter: AdapterOpt = None, adapter_name: AdapterName = None,
    compile_mode: CompileMode = "default", log_level: LogLevel = "info",
) -> None:
    """Serve the OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/models, /healthz,
    /metrics) with uvicorn until Ctrl-C."""
    try:
        from llminfer.api import create_app, run_server
    except ImportError as exc:  # pragma: no cover - the serve extra is missing
        from llminfer.errors import BackendUnavailableError

        raise BackendUnavailableError(f"the server needs: pip install 'llminfer[serve]' ({exc})") from None
    cfg = build_config(model, backend, dtype, device, max_batch_size, page_size, no_prefix_cache, kv_cache_bytes,
                       max_model_len, revision, hf_token, local_files_only, cache_dir, trust_remote_code,
                       tp_size, pp_size, quant=quant, compile_mode=compile_mode,
                       batch_timeout_ms=batch_timeout_ms, served_model_name=served_model_name)
    engine = _engine(cfg, log_level, adapter, adapter_name)
    asgi_app = create_app(engine, api_key=api_key, max_queue_size=max_queue_size)
    run_server(asgi_app, host=host, port=port, log_level=log_level)


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


ArtifactsDir = Annotated[str | None, typer.Option("--artifacts-dir", help="Folder for the JSON/CSV artifacts.")]
JsonOut = Annotated[str | None, typer.Option("--json-out", help="Explicit path of the JSON artifact.")]
CsvOut = Annotated[str | None, typer.Option("--csv-out", help="Explicit path of the CSV artifact.")]
PlotOpt = Annotated[str | None, typer.Option("--plot", help="Write a 2x2 dashboard PNG here.")]
PlotSuite = Annotated[str | None, typer.Option("--plot-suite-dir", help="Write the dashboard and one PNG per "
                                               "metric into this folder.")]
BatchSizes = Annotated[str, typer.Option("--batch-sizes", help="Comma-separated batch sizes, e.g. 1,2,4,8.")]
Runs = Annotated[int, typer.Option("--runs", help="Measured runs per batch size (after warm-up).")]
Warmup = Annotated[int, typer.Option("--warmup", help="Warm-up runs per batch size (not measured).")]
PromptLen = Annotated[int, typer.Option("--prompt-len", help="Tokens per synthetic prompt.")]


@app.command()
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
) -> None:
    """Benchmark one model over batch sizes; print a summary table and write benchmark.json / .csv."""
    from llminfer.benchmark import Benchmarker

    sizes = _int_list(batch_sizes, "--batch-sizes")
    cfg = build_config(model, backend, dtype, device, max(max_batch_size, max(sizes)), page_size_tokens,
                       no_prefix_cache, kv_cache_bytes)
    cfg.cache.enable_paged_kv = paged_kv
    with _engine(cfg, log_level) as engine, _Progress(len(sizes) * (runs + warmup)) as progress:
        try:
            result = Benchmarker(engine, prompt_len=prompt_len).run(sizes, runs, max_new_tokens, warmup,
                                                                    continuous, progress=progress)
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None
    result.print_summary()
    _write_outputs(result, artifacts_dir, json_out, csv_out, plot, plot_suite_dir, "benchmark")


@app.command()
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

    _check_log_level(log_level)
    configure_logging(log_level)
    names = _split(backends)
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


@app.command("bench-serve")
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


def main(argv: list[str] | None = None) -> None:
    """Entry point: runs the Typer app; any user error becomes one line on stderr and exit code 1 or 2."""
    try:
        rc = app(args=argv, standalone_mode=False)  # returns the code of a typer.Exit
        if isinstance(rc, int) and rc:
            sys.exit(rc)
    except click_exc.NoArgsIsHelpError as exc:  # pragma: no cover - typer prints help itself
        typer.echo(exc.ctx.get_help() if exc.ctx else "", err=True)
        sys.exit(2)
    except click_exc.UsageError as exc:
        typer.echo(f"error: {exc.format_message()}", err=True)
        sys.exit(2)
    except click_exc.ClickException as exc:
        typer.echo(f"error: {exc.format_message()}", err=True)
        sys.exit(exc.exit_code or 1)
    except typer.Abort:
        typer.echo("error: aborted", err=True)
        sys.exit(130)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except LLMInferError as exc:
        typer.echo(f"error: {exc}", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        typer.echo("error: interrupted", err=True)
        sys.exit(130)
