"""Benchmarker and BackendComparison: repeatable offline benchmarks with artifacts.

Every figure comes from the engine's stage traces (see :mod:`llminfer.benchmark.metrics`): output tokens
are the tokens actually delivered, warm-up runs are excluded, the prefix cache is reset and prompts are
fresh random token ids for every run (so no run is flattered by cache hits), and CUDA is synchronised
before every clock read.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import polars as pl
import torch

from llminfer.benchmark import artifacts
from llminfer.benchmark.environment import environment, peak_memory_bytes
from llminfer.benchmark.metrics import summarize, trace_frame
from llminfer.config import Backend, EngineConfig
from llminfer.errors import EngineError, LLMInferError

SUMMARY_COLUMNS = ["batch_size", "latency_p50_ms", "latency_p95_ms", "latency_p99_ms", "ttft_mean_ms",
                   "tpot_mean_ms", "output_tokens_per_s", "peak_rss_mb"]


def _sync(device: Any) -> None:
    if torch.cuda.is_available() and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def random_token_prompts(n: int, length: int | Sequence[int], vocab_size: int, seed: int) -> list[list[int]]:
    """``n`` prompts of random token ids in ``[10, vocab_size)`` (a fixed seed: reproducible), each
    ``length`` tokens long, or ``length[i]`` for prompt ``i`` when ``length`` is a sequence of ``n``.

    Raises:
        ValueError: a sequence of lengths that is not ``n`` long, or a negative length.
    """
    lengths = [length] * n if isinstance(length, int) else [int(k) for k in length]
    if len(lengths) != n:
        raise ValueError(f"{len(lengths)} prompt lengths for {n} prompts")
    if any(k < 0 for k in lengths):
        raise ValueError(f"prompt lengths must be >= 0, got {min(lengths)}")
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, max(11, vocab_size), (k,), generator=g).tolist() for k in lengths]


@attrs.define
class BenchmarkResult:
    """Per-run rows plus the settings, config and environment they were measured under."""

    runs: list[dict[str, Any]]
    settings: dict[str, Any]
    config: dict[str, Any]
    environment: dict[str, Any]
    info: dict[str, Any] = attrs.field(factory=dict)

    def to_polars(self) -> pl.DataFrame:
        """One row per measured run (warm-up excluded)."""
        return pl.DataFrame(self.runs)

    def summary(self) -> pl.DataFrame:
        """Median over runs, one row per batch size (the columns of :data:`SUMMARY_COLUMNS`)."""
        df = self.to_polars()
        return (
            df.group_by("batch_size")
            .agg(pl.col(c).median() for c in SUMMARY_COLUMNS[1:])
            .sort("batch_size")
            .select(SUMMARY_COLUMNS)
        )

    def print_summary(self, title: str | None = None) -> str:
        """Print (and return) the summary table: batch size, latency p50/p95/p99, TTFT, tok/s, memory."""
        text = format_table(self.summary(), title or f"llminfer benchmark — {self.settings.get('mode', '')}")
        print(text)
        return text

    def plot(self, path: str | Path) -> Path:
        """A 2x2 dashboard PNG (throughput, latency, TTFT, memory by batch size)."""
        from llminfer.benchmark.plots import dashboard

        return dashboard({"llminfer": self.summary()}, path)

    def plot_suite(self, directory: str | Path, prefix: str = "benchmark") -> list[Path]:
        """``<prefix>_dashboard.png``, ``_throughput.png``, ``_latency.png``, ``_ttft.png``, ``_memory.png``."""
        from llminfer.benchmark.plots import suite

        return suite({"llminfer": self.summary()}, directory, prefix)

    def to_json_dict(self) -> dict[str, Any]:
        return {
            "schema_version": 1,
            "kind": "benchmark",
            "settings": self.settings,
            "config": self.config,
            "environment": self.environment,
            "info": self.info,
            "runs": self.runs,
            "summary": self.summary().to_dicts(),
        }

    def save_artifacts(self, directory: str | Path = ".", json_out: str | Path | None = None,
                       csv_out: str | Path | None = None) -> dict[str, Path]:
        """Write ``benchmark.json`` and ``benchmark.csv`` (the per-run rows) into ``directory`` (or the
        explicit paths). Returns the paths."""
        return artifacts.write(self.to_json_dict(), self.to_polars(), directory, "benchmark", json_out, csv_out)


def format_table(df: pl.DataFrame, title: str = "") -> str:
    """A plain fixed-width table of a frame (numbers to one decimal)."""
    cols = df.columns
    rows = [[("-" if v is None else f"{v:.1f}" if isinstance(v, float) else str(v)) for v in r] for r in df.rows()]
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(cols)]
    line = "  ".join(c.rjust(w) for c, w in zip(cols, widths))
    out = [title, line, "-" * len(line)] if title else [line, "-" * len(line)]
    out += ["  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in rows]
    return "\n".join(out)


def check_settings(batch_sizes: Sequence[int], num_runs: int, max_new_tokens: int, warmup: int,
                   prompt_len: int | None) -> None:
    """Check benchmark settings (``prompt_len`` None: fixed prompts are given).

    Raises:
        ValueError: empty ``batch_sizes``, a non-positive size / count / length, or a negative warm-up.
    """
    if not batch_sizes or any(b <= 0 for b in batch_sizes):
        raise ValueError("batch sizes must be positive integers")
    if num_runs <= 0:
        raise ValueError(f"runs must be >= 1, got {num_runs}")
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    if prompt_len is not None and prompt_len <= 0:
        raise ValueError(f"prompt_len must be >= 1, got {prompt_len}")


class Benchmarker:
    """Measures an engine over batch sizes, on any core (llminfer's own, or one whose backend owns
    scheduling such as vLLM): it only uses the engine's facade (``vocab_size``, ``reset_prefix_cache()``,
    ``tracer``, ``info()``, the run methods), never the model or the KV manager.

    Args:
        engine: a loaded :class:`~llminfer.engine.InferenceEngine` (started on first use).
        prompt_len: tokens per synthetic prompt (random token ids, fresh each run).
        prompts: fixed prompts instead (cycled to fill each batch); then the prefix cache is still reset.
    """

    def __init__(self, engine: Any, prompt_len: int = 32, prompts: Sequence[str | Sequence[int]] | None = None,
                 seed: int = 0) -> None:
        self.engine = engine
        self.prompt_len = prompt_len
        self.prompts = list(prompts) if prompts else None
        self.seed = seed

    def _vocab_size(self) -> int:
        """The model's vocabulary (its config), else the tokenizer's: known on every core, vLLM's too.

        Raises:
            EngineError: neither the model config nor the tokenizer gives a vocabulary size.
        """
        engine = self.engine
        vocab = engine.vocab_size
        if not vocab:
            with contextlib.suppress(TypeError):
                vocab = len(engine.tokenizer)
        if not vocab:
            raise EngineError("cannot make random prompts: the model config has no vocab_size and the "
                              "tokenizer no length; pass prompts= instead")
        return int(vocab)

    def _batch(self, size: int, run_seed: int) -> list[Any]:
        if self.prompts:
            return [self.prompts[i % len(self.prompts)] for i in range(size)]
        return random_token_prompts(size, self.prompt_len, self._vocab_size(), run_seed)

    def run(self, batch_sizes: Sequence[int] = (1, 2, 4, 8), num_runs: int = 3, max_new_tokens: int = 64,
            warmup: int = 1, continuous: bool = True, ignore_eos: bool = True,
            progress: Callable[[str], None] | None = None) -> BenchmarkResult:
        """Run ``warmup`` + ``num_runs`` batches per batch size.

        Args:
            continuous: through the continuous-batching scheduler (``run_batch_continuous``) or static
                batches (``run_batch``).
            ignore_eos: generate exactly ``max_new_tokens`` (EOS ignored) so runs are comparable.
            progress: called with a short label before each run (the CLI drives a progress bar with it).

        Raises:
            ValueError: empty ``batch_sizes``, a non-positive size / count / length, or a negative warm-up.
            EngineError: no vocabulary size to draw random prompts from, or the backend failed.
            InvalidRequestError, CapacityError: a batch the engine refuses (see
                :meth:`~llminfer.engine.InferenceEngine.run`).
        """
        check_settings(batch_sizes, num_runs, max_new_tokens, warmup, None if self.prompts else self.prompt_len)
        engine = self.engine
        engine.start()
        go = engine.run_batch_continuous if continuous else engine.run_batch
        runs: list[dict[str, Any]] = []
        seed = self.seed
        for size in batch_sizes:
            for i in range(warmup + num_runs):
                seed += 1
                prompts = self._batch(size, seed)
                engine.reset_prefix_cache()  # through the core's inbox: done (and cold) when it returns
                engine.tracer.clear()
                # Every event of the run must be kept: a few per request, one per token, four per step.
                prompt_tokens = max((len(p) for p in prompts), default=0)
                engine.tracer.ensure_capacity(size * (max_new_tokens + 16) + 4 * (max_new_tokens + prompt_tokens) * size)
                if progress:
                    progress(f"batch {size} {'warm-up' if i < warmup else f'run {i - warmup + 1}'}")
                _sync(engine.device)
                t0 = time.perf_counter()
                results = go(prompts, max_new_tokens=max_new_tokens, ignore_eos=ignore_eos)
                _sync(engine.device)
                wall = time.perf_counter() - t0
                if i < warmup:
                    continue
                if engine.tracer.dropped:
                    raise EngineError(f"the trace ring overflowed by {engine.tracer.dropped} events during a "
                                      "benchmark run; its metrics would be wrong")
                trace = trace_frame(engine.tracer.snapshot())
                s = summarize(trace) if engine.tracer.enabled else {}
                generated = sum(r.stats.completion_tokens for r in results)
                e2e = pl.DataFrame({"e2e": [r.stats.total_latency_ms for r in results]})["e2e"]
                mem = peak_memory_bytes(engine.device)
                runs.append({
                    "batch_size": size,
                    "run": i - warmup,
                    "wall_s": wall,
                    "output_tokens": generated,
                    "output_tokens_per_s": generated / wall,
                    "latency_p50_ms": float(e2e.quantile(0.5, "linear")),
                    "latency_p95_ms": float(e2e.quantile(0.95, "linear")),
                    "latency_p99_ms": float(e2e.quantile(0.99, "linear")),
                    "ttft_mean_ms": sum(r.stats.ttft_ms for r in results) / len(results),
                    "tpot_mean_ms": s.get("tpot_ms_mean"),
                    "itl_p50_ms": s.get("itl_ms_p50"),
                    "queue_mean_ms": s.get("queue_ms_mean"),
                    "peak_rss_mb": mem["peak_rss_bytes"] / 2**20,
                    "peak_device_mb": None if mem["peak_device_bytes"] is None else mem["peak_device_bytes"] / 2**20,
                })
        info = engine.info()
        return BenchmarkResult(
            runs=runs,
            settings={"batch_sizes": list(batch_sizes), "num_runs": num_runs, "max_new_tokens": max_new_tokens,
                      "warmup": warmup, "mode": "continuous" if continuous else "static",
                      "prompt_len": None if self.prompts else self.prompt_len, "ignore_eos": ignore_eos},
            config=engine.cfg.to_dict(),
            environment=environment(),
            info={k: info[k] for k in ("model", "architecture", "parameters", "dtype", "dtype_reason", "weight_bytes", "kv_blocks",
                                       "kv_block_size", "kv_bytes", "device") if k in info},
        )


@attrs.define
class ComparisonResult:
    """Per backend: a :class:`BenchmarkResult`, or the reason it was skipped."""

    results: dict[str, BenchmarkResult]
    skipped: dict[str, str]
    environment: dict[str, Any]

    def table(self) -> pl.DataFrame:
        frames = [r.summary().with_columns(pl.lit(name).alias("backend")) for name, r in self.results.items()]
        if not frames:
            return pl.DataFrame(schema={"backend": pl.Utf8, **{c: pl.Float64 for c in SUMMARY_COLUMNS}})
        return pl.concat(frames).select(["backend", *SUMMARY_COLUMNS])

    def print_table(self) -> str:
        return print_table(self)

    def plot(self, path: str | Path) -> Path:
        return plot(self, path)

    def to_json_dict(self) -> dict[str, Any]:
        return {
            "schema_version": 1,
            "kind": "comparison",
            "environment": self.environment,
            "backends": {name: {k: v for k, v in r.to_json_dict().items() if k not in ("environment",)}
                         for name, r in self.results.items()},
            "skipped": self.skipped,
            "table": self.table().to_dicts(),
        }

    def save_artifacts(self, directory: str | Path = ".", json_out: str | Path | None = None,
                       csv_out: str | Path | None = None) -> dict[str, Path]:
        """``comparison.json`` and ``comparison.csv`` (the summary table, one row per backend and batch)."""
        return artifacts.write(self.to_json_dict(), self.table(), directory, "comparison", json_out, csv_out)


def _as_comparison(results: ComparisonResult | Mapping[str, BenchmarkResult]) -> ComparisonResult:
    if isinstance(results, ComparisonResult):
        return results
    if isinstance(results, Mapping) and all(isinstance(r, BenchmarkResult) for r in results.values()):
        return ComparisonResult(dict(results), {}, environment())
    raise TypeError(f"expected a ComparisonResult or a mapping of backend name to BenchmarkResult, "
                    f"got {type(results).__name__}")


def print_table(results: ComparisonResult | Mapping[str, BenchmarkResult]) -> str:
    """Print (and return) the comparison table, then one line per skipped backend with its reason.

    Raises:
        TypeError: ``results`` is neither a :class:`ComparisonResult` nor ``{backend: BenchmarkResult}``.
    """
    results = _as_comparison(results)
    text = format_table(results.table(), "llminfer backend comparison")
    for name, reason in results.skipped.items():
        text += f"\n{name}: skipped — {reason}"
    print(text)
    return text


def plot(results: ComparisonResult | Mapping[str, BenchmarkResult], path: str | Path) -> Path:
    """A 2x2 dashboard PNG with one line per backend (throughput, latency, TTFT, memory against batch size);
    returns its path.

    Raises:
        TypeError: as :func:`print_table`.
    """
    from llminfer.benchmark.plots import dashboard

    results = _as_comparison(results)
    return dashboard({name: r.summary() for name, r in results.results.items()}, path)


class BackendComparison:
    """The same prompts and settings on several backends, one engine at a time (freed in between).

    Args:
        model_name: model id or folder (None: the built-in model).
        backends: backend names or :class:`Backend` members.
        config: a base :class:`EngineConfig` (its ``model_name`` and ``backend`` are replaced).
    """

    def __init__(self, model_name: str | None = None, backends: Sequence[str | Backend] = ("eager",),
                 config: EngineConfig | None = None) -> None:
        self.model_name = model_name
        self.backends = [Backend(b) if not isinstance(b, Backend) else b for b in backends]
        self.config = config or EngineConfig()

    # The description's spelling: ``BackendComparison.print_table(results)``, ``BackendComparison.plot(results,
    # path)``; the same functions as :func:`print_table`, :func:`plot` and the methods of ComparisonResult.
    print_table = staticmethod(print_table)
    plot = staticmethod(plot)

    def run(self, batch_sizes: Sequence[int] = (1, 4), num_runs: int = 2, max_new_tokens: int = 32,
            warmup: int = 1, prompt_len: int = 32,
            progress: Callable[[str], None] | None = None) -> ComparisonResult:
        """Benchmark each backend with :class:`Benchmarker`, one engine at a time.

        A backend that cannot load or run here (any :class:`~llminfer.errors.LLMInferError`, e.g.
        ``BackendUnavailableError`` without vLLM) is skipped with its reason; the others still run.

        Raises:
            ValueError: bad benchmark settings (see :meth:`Benchmarker.run`), before any backend runs.
            Exception: anything else a backend raises is a bug, not a reason to skip, and propagates (the
                engine is closed first).
        """
        from llminfer.engine import InferenceEngine

        check_settings(batch_sizes, num_runs, max_new_tokens, warmup, prompt_len)
        results: dict[str, BenchmarkResult] = {}
        skipped: dict[str, str] = {}
        for backend in self.backends:
            cfg = attrs.evolve(self.config, model_name=self.model_name, backend=backend)
            try:
                engine = InferenceEngine(cfg.validate()).load()
            except LLMInferError as exc:
                skipped[backend.value] = str(exc)
                continue
            try:
                bench = Benchmarker(engine, prompt_len=prompt_len)
                label = (lambda msg, b=backend.value: progress(f"{b}: {msg}")) if progress else None
                results[backend.value] = bench.run(batch_sizes, num_runs, max_new_tokens, warmup, progress=label)
            except LLMInferError as exc:
                skipped[backend.value] = str(exc)
            finally:
                engine.close()
                del engine
        return ComparisonResult(results, skipped, environment())
