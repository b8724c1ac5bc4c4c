"""Benchmarker: a repeatable offline benchmark of one engine over batch sizes (its result and table are
:mod:`llminfer.benchmark.results`'; several backends in turn, :mod:`llminfer.benchmark.comparison`).

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
import time
from collections.abc import Callable, Sequence
from typing import Any

import polars as pl
import torch

from llminfer.backends.registry import backends_with
from llminfer.benchmark.environment import MemoryProbe, environment
from llminfer.benchmark.metrics import itl_ms, trace_frame
from llminfer.benchmark.results import PERCENTILES, BenchmarkResult
from llminfer.benchmark.settings import check_settings
from llminfer.errors import EngineError


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

        The compiled backend first compiles every step shape (:meth:`~llminfer.engine.InferenceEngine.warmup`,
        as ``llminfer serve`` does): continuous batching packs steps by arrival, so a measured run can meet a
        token count its warm-up run did not, and compiling it there (seconds) would count in that run.

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
        engine.warmup()  # 0 graphs (and nothing done) outside the compiled backend
        engine.start()
        go = engine.run_batch_continuous if continuous else engine.run_batch
        device_wide = getattr(engine.cfg, "backend", None) in backends_with("external_engine")
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
