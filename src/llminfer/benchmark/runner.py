"""Benchmarker and BackendComparison: repeatable offline benchmarks with artifacts.

What is measured, per configuration (one batch size on one backend):

* every request of every measured run is one sample: the latency percentiles (p50 / p95 / p99, linear
  interpolation between closest ranks, as numpy's default) of end-to-end latency, TTFT, TPOT and ITL are
  over all ``batch_size x num_runs`` requests (``n_requests``), never per batch then a median of runs;
* throughput is per run (output tokens actually delivered / the run's wall time), reported as the median
  over runs with the min and max as its spread;
* memory is measured per configuration (see :class:`~llminfer.benchmark.environment.MemoryProbe`): the peak
  is reset before the configuration's first run, and every figure names its ``memory_kind``.

Warm-up runs are excluded from every figure (their memory counts: a first-use compile or allocation is
memory the configuration needs), the prefix cache is reset and prompts are fresh random token ids for every
run (so no run is flattered by cache hits), and CUDA is synchronised before every clock read.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import polars as pl
import torch

from llminfer.benchmark import artifacts
from llminfer.benchmark.environment import (
    MEMORY_KINDS,
    MemoryProbe,
    current_rss_bytes,
    environment,
    preload_model_libraries,
    release_freed_memory,
)
from llminfer.benchmark.metrics import itl_ms, trace_frame
from llminfer.benchmark.settings import check_settings
from llminfer.config import Backend, EngineConfig
from llminfer.errors import EngineError, LLMInferError

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


def _sync(device: Any) -> None:
    if torch.cuda.is_available() and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def percentiles(values: Sequence[float | None], name: str) -> dict[str, float | None]:
    """``{name_p50_ms, name_p95_ms, name_p99_ms, name_mean_ms}`` over ``values`` (ms; None entries are left
    out; all None when nothing is left). Linear interpolation between closest ranks (numpy's default)."""
    col = pl.Series(name, [v for v in values if v is not None], dtype=pl.Float64)
    out: dict[str, float | None] = {}
    for q in PERCENTILES:
        out[f"{name}_p{q}_ms"] = float(col.quantile(q / 100, interpolation="linear")) if len(col) else None
    out[f"{name}_mean_ms"] = float(col.mean()) if len(col) else None  # type: ignore[arg-type]
    return out


def _utc_now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


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


class Benchmarker:
    """Measures an engine over batch sizes, on any core (llminfer's own, or one whose backend owns
    scheduling such as vLLM): it only uses the engine's facade (``vocab_size``, ``reset_prefix_cache()``,
    ``tracer``, ``info()``, ``cfg``, ``device``, the run methods), never the model or the KV manager.

    Args:
        engine: a loaded :class:`~llminfer.engine.InferenceEngine` (started on first use).
        prompt_len: tokens per synthetic prompt (random token ids, fresh each run).
        prompts: fixed prompts instead (cycled to fill each batch); then the prefix cache is still reset.
        clock: seconds, monotonic (``time.perf_counter``); the runs' wall time and so their throughput.
        baseline_rss_bytes: resident memory before the engine was loaded (``current_rss_bytes()`` taken then);
            on CPU the memory figures are above it (``rss_peak_minus_preload``), else above the memory when
            :meth:`run` starts (``rss_peak_minus_loaded``).
    """

    def __init__(self, engine: Any, prompt_len: int = 32, prompts: Sequence[str | Sequence[int]] | None = None,
                 seed: int = 0, clock: Callable[[], float] = time.perf_counter,
                 baseline_rss_bytes: int | None = None) -> None:
        self.engine = engine
        self.prompt_len = prompt_len
        self.prompts = list(prompts) if prompts else None
        self.seed = seed
        self.clock = clock
        self.baseline_rss_bytes = baseline_rss_bytes

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

    def _check_capacity(self, batch_sizes: Sequence[int], max_new_tokens: int) -> None:
        """Refuse a batch whose sequences cannot all hold their KV at once: a benchmark of preemption
        thrash (or of a queue) would not measure that batch size.

        Raises:
            ValueError: the largest batch needs more KV tokens than the pool holds.
        """
        cache_stats = getattr(self.engine, "cache_stats", None)
        stats = cache_stats() if cache_stats is not None else {}
        blocks, block_size = stats.get("blocks_total"), stats.get("block_size")
        if not blocks or not block_size:
            return  # a backend that does not report its pool (vLLM sizes its own)
        if self.prompts and any(isinstance(p, str) for p in self.prompts):
            return  # their token counts are known only once tokenized; the engine refuses what never fits
        longest = max(len(p) for p in self.prompts) if self.prompts else self.prompt_len
        per_seq = -(-(longest + max_new_tokens) // block_size)
        running = getattr(getattr(self.engine, "cfg", None), "max_batch_size", None) or max(batch_sizes)
        size = min(max(batch_sizes), running)  # the rest of a larger batch waits in the queue
        if size * per_seq > blocks:
            raise ValueError(f"batch size {size} needs {size * per_seq} KV blocks of {block_size} tokens at once; "
                             f"the KV pool holds {blocks} (lower the batch size or raise --kv-cache-bytes)")

    def run(self, batch_sizes: Sequence[int] = (1, 2, 4, 8), num_runs: int = 3, max_new_tokens: int = 64,
            warmup: int = 1, continuous: bool = True, ignore_eos: bool = True,
            progress: Callable[[str], None] | None = None) -> BenchmarkResult:
        """Run ``warmup`` + ``num_runs`` batches per batch size.

        Args:
            continuous: through the continuous-batching scheduler (``run_batch_continuous``) or static
                batches (``run_batch``).
            ignore_eos: generate exactly ``max_new_tokens`` (EOS ignored) so runs are comparable.
            progress: called with a short label (``"batch 4 · run 2/5"``) before each run (the CLI drives a
                progress bar with it).

        Raises:
            ValueError: empty ``batch_sizes``, a non-positive size / count / length, or a negative warm-up.
            EngineError: no vocabulary size to draw random prompts from, the trace ring overflowed, or the
                backend failed.
            InvalidRequestError, CapacityError: a batch the engine refuses (see
                :meth:`~llminfer.engine.InferenceEngine.run`).
        """
        check_settings(batch_sizes, num_runs, max_new_tokens, warmup, None if self.prompts else self.prompt_len)
        engine = self.engine
        self._check_capacity(batch_sizes, max_new_tokens)
        engine.start()
        go = engine.run_batch_continuous if continuous else engine.run_batch
        device_wide = getattr(engine.cfg, "backend", None) is Backend.VLLM
        # vLLM on CPU: the processes it started; without any known (a stand-in), this process's own memory
        worker_pids = getattr(getattr(engine, "backend", None), "worker_pids", None)
        if device_wide and not worker_pids and str(engine.device) == "cpu":
            device_wide = False
        runs: list[dict[str, Any]] = []
        requests: list[dict[str, Any]] = []
        configs: list[dict[str, Any]] = []
        seed = self.seed
        for size in batch_sizes:
            probe = MemoryProbe(engine.device, self.baseline_rss_bytes, device_wide=device_wide,
                                worker_pids=worker_pids)
            probe.start()
            itl: list[float] = []
            for i in range(warmup + num_runs):
                seed += 1
                prompts = self._batch(size, seed)
                engine.reset_prefix_cache()  # through the core's inbox: done (and cold) when it returns
                engine.tracer.clear()
                # Every event of the run must be kept: a few per request, one per token, four per step.
                prompt_tokens = max((len(p) for p in prompts), default=0)
                engine.tracer.ensure_capacity(size * (max_new_tokens + 16) + 4 * (max_new_tokens + prompt_tokens) * size)
                if progress:
                    progress(f"batch {size} · warm-up {i + 1}/{warmup}" if i < warmup
                             else f"batch {size} · run {i - warmup + 1}/{num_runs}")
                _sync(engine.device)
                t0 = self.clock()
                results = go(prompts, max_new_tokens=max_new_tokens, ignore_eos=ignore_eos)
                _sync(engine.device)
                wall = self.clock() - t0
                if i < warmup:
                    continue
                if engine.tracer.dropped:
                    raise EngineError(f"the trace ring overflowed by {engine.tracer.dropped} events during a "
                                      "benchmark run; its metrics would be wrong")
                if engine.tracer.enabled:
                    itl += itl_ms(trace_frame(engine.tracer.snapshot())).to_list()
                run = i - warmup
                generated = 0
                for j, r in enumerate(results):
                    st = r.stats
                    generated += st.completion_tokens
                    requests.append({
                        "batch_size": size, "run": run, "index": j, "e2e_ms": st.total_latency_ms,
                        "ttft_ms": st.ttft_ms if st.completion_tokens else None,
                        "tpot_ms": ((st.total_latency_ms - st.ttft_ms) / (st.completion_tokens - 1)
                                    if st.completion_tokens > 1 else None),
                        "queue_ms": st.queue_time_ms, "prompt_tokens": st.prompt_tokens,
                        "output_tokens": st.completion_tokens,
                    })
                runs.append({"batch_size": size, "run": run, "n_requests": len(results), "wall_s": wall,
                             "output_tokens": generated, "output_tokens_per_s": generated / wall if wall > 0 else None})
            configs.append(_config_row(size, num_runs, [r for r in requests if r["batch_size"] == size],
                                       [r for r in runs if r["batch_size"] == size], itl, probe.stop()))
        info = engine.info()
        return BenchmarkResult(
            runs=runs,
            requests=requests,
            configs=configs,
            settings={"batch_sizes": list(batch_sizes), "num_runs": num_runs, "max_new_tokens": max_new_tokens,
                      "warmup": warmup, "mode": "continuous" if continuous else "static",
                      "prompt_len": None if self.prompts else self.prompt_len, "ignore_eos": ignore_eos},
            config=engine.cfg.to_dict(),
            environment=environment(),
            info={k: info[k] for k in ("model", "architecture", "parameters", "dtype", "dtype_reason", "dtype_probe", "num_threads", "threads_mode", "weight_bytes", "kv_blocks",
                                       "kv_block_size", "kv_bytes", "device") if k in info},
        )


def _config_row(size: int, num_runs: int, requests: list[dict[str, Any]], runs: list[dict[str, Any]],
                itl: list[float], memory: dict[str, Any]) -> dict[str, Any]:
    """One configuration's summary row (:data:`SUMMARY_COLUMNS`) from its requests, runs and memory."""
    tps = pl.Series([r["output_tokens_per_s"] for r in runs if r["output_tokens_per_s"] is not None],
                    dtype=pl.Float64)
    row: dict[str, Any] = {"batch_size": size, "n_runs": num_runs, "n_requests": len(requests)}
    row |= percentiles([r["e2e_ms"] for r in requests], "latency")
    row |= percentiles([r["ttft_ms"] for r in requests], "ttft")
    row |= percentiles([r["tpot_ms"] for r in requests], "tpot")
    row |= percentiles(itl, "itl")
    row |= {"output_tokens_per_s": float(tps.median()) if len(tps) else None,  # type: ignore[arg-type]
            "output_tokens_per_s_min": float(tps.min()) if len(tps) else None,  # type: ignore[arg-type]
            "output_tokens_per_s_max": float(tps.max()) if len(tps) else None}  # type: ignore[arg-type]
    return row | memory


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
                       f"output tok/s, x{mine / theirs:.2f}): check for recompiles and eager fallbacks in its "
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


def backend_progress(backend: str, progress: Callable[[str], None]) -> Callable[[str], None]:
    """``progress`` with the backend's name before each label; on the compiled backend the first run says it
    compiles (torch.compile's first call takes seconds to minutes, and would look like a hang)."""
    first = [backend == Backend.COMPILED.value]

    def label(msg: str) -> None:
        if first[0]:
            first[0] = False
            msg += " (compiling on first use)"
        progress(f"{backend} · {msg}")

    return label


def _cuda_device(device: str) -> bool:
    return device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())


class BackendComparison:
    """The same prompts and settings on several backends, one engine at a time (freed in between).

    Settings that mean one backend only are applied to it alone and ignored, with a note in
    :attr:`ComparisonResult.notes`, for the others: ``tp_size`` / ``pp_size`` (vLLM; the other backends run on
    one device) and ``compile_cudagraphs`` (the compiled backend; vLLM captures its own CUDA graphs and the
    eager backend has ``cuda_graphs``).

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

    def config_for(self, backend: Backend) -> tuple[EngineConfig, list[str]]:
        """The config ``backend`` runs with, and a note for each setting ignored for it."""
        base = self.config
        cfg = attrs.evolve(base, model_name=self.model_name, backend=backend)
        notes: list[str] = []
        if backend is not Backend.VLLM and (base.tp_size > 1 or base.pp_size > 1):
            notes.append(f"--tp-size {base.tp_size} / --pp-size {base.pp_size} apply to vllm only; "
                         f"{backend.value} runs on one device")
            cfg = attrs.evolve(cfg, tp_size=1, pp_size=1)
        if base.compile_cudagraphs:
            if backend is Backend.EAGER:
                notes.append("--compile-cudagraphs applies to the compiled backend only; eager replays its "
                             "decode steps as CUDA graphs on its own (cuda_graphs, on by default on CUDA)")
                cfg = attrs.evolve(cfg, compile_cudagraphs=False)
            elif backend is Backend.VLLM:
                notes.append("--compile-cudagraphs applies to the compiled backend only; vLLM captures its own "
                             "CUDA graphs")
                cfg = attrs.evolve(cfg, compile_cudagraphs=False)
            elif not _cuda_device(base.device):
                notes.append("--compile-cudagraphs has no effect here: CUDA graphs need a CUDA device")
        return cfg, notes

    def notes(self) -> dict[str, list[str]]:
        """``{backend: notes}`` for the backends with a setting ignored for them (see :meth:`config_for`)."""
        out = {b.value: self.config_for(b)[1] for b in self.backends}
        return {k: v for k, v in out.items() if v}

    def run(self, batch_sizes: Sequence[int] = (1, 4), num_runs: int = 2, max_new_tokens: int = 32,
            warmup: int = 1, prompt_len: int = 32, progress: Callable[[str], None] | None = None,
            continuous: bool = True) -> ComparisonResult:
        """Benchmark each backend with :class:`Benchmarker`, one engine at a time. Before each backend loads,
        freed memory is handed back and the process's resident memory is taken as that backend's baseline, so
        its memory figures are its own (``rss_peak_minus_preload`` on CPU; on CUDA the device peak is reset).

        A backend that cannot load or run here (any :class:`~llminfer.errors.LLMInferError`, e.g.
        ``BackendUnavailableError`` without vLLM) is skipped with its reason; the others still run.

        Args:
            progress: called with ``"<backend> · loading"`` before each load and ``"<backend> · batch B ·
                run i/n"`` before each run.

        Raises:
            ValueError: bad benchmark settings (see :meth:`Benchmarker.run`), before any backend runs.
            Exception: anything else a backend raises is a bug, not a reason to skip, and propagates (the
                engine is closed first).
        """
        from llminfer.engine import InferenceEngine

        check_settings(batch_sizes, num_runs, max_new_tokens, warmup, prompt_len)
        results: dict[str, BenchmarkResult] = {}
        skipped: dict[str, str] = {}
        notes: dict[str, list[str]] = {}
        preload_model_libraries()
        for backend in self.backends:
            cfg, backend_notes = self.config_for(backend)
            if backend_notes:
                notes[backend.value] = backend_notes
            release_freed_memory()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            baseline = current_rss_bytes()
            if progress:
                progress(f"{backend.value} · loading")
            try:
                engine = InferenceEngine(cfg.validate()).load()
            except LLMInferError as exc:
                skipped[backend.value] = str(exc)
                continue
            bench = None
            try:
                bench = Benchmarker(engine, prompt_len=prompt_len, baseline_rss_bytes=baseline)
                label = backend_progress(backend.value, progress) if progress else None
                results[backend.value] = bench.run(batch_sizes, num_runs, max_new_tokens, warmup, continuous,
                                                   progress=label)
            except LLMInferError as exc:
                skipped[backend.value] = str(exc)
            finally:
                engine.close()
                del engine, bench  # collected by release_freed_memory() before the next backend's baseline
        return ComparisonResult(results, skipped, environment(), notes)
