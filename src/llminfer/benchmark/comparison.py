"""BackendComparison: the same benchmark on several backends, one engine at a time, each with its own
memory baseline; a backend that cannot run here is skipped with its reason.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs
import torch

from llminfer.backends.registry import backend_spec, backends_with
from llminfer.benchmark.environment import (
    current_rss_bytes,
    environment,
    preload_model_libraries,
    release_freed_memory,
)
from llminfer.benchmark.results import BenchmarkResult, ComparisonResult, plot, print_table
from llminfer.benchmark.runner import Benchmarker
from llminfer.benchmark.settings import check_settings
from llminfer.config import Backend, EngineConfig
from llminfer.errors import LLMInferError


def backend_progress(backend: str, progress: Callable[[str], None]) -> Callable[[str], None]:
    """``progress`` with the backend's name before each label; on the compiled backend the first run says it
    compiles (torch.compile's first call takes seconds to minutes, and would look like a hang)."""
    first = [backend in backends_with("compiles")]

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
        if not backend_spec(backend).multi_device and (base.tp_size > 1 or base.pp_size > 1):
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
