"""``dtype="auto"`` on CPU by measurement: time the loaded model in each candidate dtype, keep the faster.

Why: the CPU flags alone were right on one machine and wrong on the next. On a 2-core AMD EPYC (Zen 4,
AVX-512 BF16, no AMX) oneDNN reports native bf16, so the flag rule picked bf16, yet a trained 135M Llama ran
slower in bf16 than in fp32 (issue 35; ``bench/bench_dtype.py`` measures it). Which is faster depends on the
CPU, the model's shape, the kernels built here and the thread count, so it is measured once and remembered.

What is measured (:func:`measure_dtypes`): for each candidate the model is loaded and prepared exactly as the
engine will run it (llminfer's CPU kernels, the prepacked head), then, alternating between candidates for
``rounds`` rounds so that a load change hits both alike, one prefill chunk of :data:`PREFILL_TOKENS` tokens
and :data:`DECODE_STEPS` batch-1 decode steps at a context of :data:`PREFILL_TOKENS`, each on a scratch KV
cache, twice: with the full logits a sampled request needs, and as a greedy request runs them (through the
argmax screen, :mod:`llminfer.kernels.argmax_screen`, where the engine attaches one: an fp32 head, or a bf16
head on llminfer's bf16 kernel, so greedy decode can favour one dtype while sampled decode favours the other).
A candidate's cost is
``prefill + DECODE_WEIGHT x (GREEDY_SHARE x greedy step + (1 - GREEDY_SHARE) x sampled step)`` in ms (the
best of its rounds): a request of 128 prompt tokens and 128 new tokens, greedy or sampled alike (greedy is
llminfer's default, ``temperature=0``; OpenAI clients sample by default). The cheaper one wins; a tie within
2 % keeps the flag rule's choice. The eager path is what is timed (the compiled backend compiles later; its
products are the same kernels).

When it runs: ``dtype="auto"`` on CPU, no bitsandbytes quantization, the eager or compiled backend, a
half-precision checkpoint (an fp32 checkpoint stays fp32: no default lowers a model's precision) on a CPU
with a native half type (the flag rule, :func:`llminfer.models.loading.resolve_dtype`, names it), and the
fp32 copy fits in a quarter of the available memory (both copies are loaded at once while measuring).
Otherwise, or when measuring fails, the flag rule's choice stands. ``LLMINFER_DTYPE_PROBE=0`` turns it off.

The choice is cached in ``$LLMINFER_CACHE_DIR/dtype_choice-v3.json``, keyed by the CPU model, torch's ISA
level, the model's shape (architecture, hidden size, layers, heads, intermediate size, vocabulary), the
thread count and whether llminfer's kernels and the argmax screen are on, with the figures it was made from (``llminfer info`` shows them as ``dtype_reason`` and
``dtype_probe``).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from llminfer.env import env_flag

ENV = "LLMINFER_DTYPE_PROBE"
PREFILL_TOKENS = 128
DECODE_STEPS = 3
DECODE_WEIGHT = 128
#: The share of greedy requests the cost assumes (the rest sample from the full logits).
GREEDY_SHARE = 0.5
CACHE_FILE = "dtype_choice-v3.json"  # v2: greedy steps timed through the argmax screen; v3: bf16 heads screened too
TIE = 0.02


def probe_enabled() -> bool:
    """False when ``$LLMINFER_DTYPE_PROBE`` is ``0`` / ``false`` / ``off`` / ``no``."""
    return env_flag(ENV)


def shape_key(model_config: Any, threads: int, settings: str = "") -> str:
    """What the choice depends on besides the CPU: the architecture, the model's shape, the thread count, and
    ``settings`` (the engine settings that change what is timed: llminfer's kernels, the argmax screen)."""
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    parts = [getattr(text, "model_type", "?")] + [str(getattr(text, a, "?")) for a in (
        "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
        "vocab_size", "tie_word_embeddings")]
    return "/".join(parts) + f"/threads={threads}" + (f"/{settings}" if settings else "")


def cpu_key() -> str:
    """The CPU model and torch's ISA level (the kernels built for it)."""
    from llminfer.kernels.cpu_info import cpu_model

    return f"{cpu_model() or 'unknown cpu'}/{torch.backends.cpu.get_cpu_capability()}"


def cache_path() -> Path:
    from llminfer.models import default_cache_dir

    return default_cache_dir() / CACHE_FILE


def cached_choice(key: str, path: Path | None = None) -> dict[str, Any] | None:
    """The cached measurement for ``key``: ``{"choice", "figures", ...}`` as :func:`store_choice` wrote it.
    None when absent, when the file is unreadable, or when the record is not of that shape (a file edited or
    written by another version): the model is then measured again."""
    path = path or cache_path()
    try:
        record = json.loads(path.read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        return None
    return record if _well_formed(record) else None


def _well_formed(record: Any) -> bool:
    if not isinstance(record, dict) or not isinstance(record.get("choice"), str):
        return False
    figures = record.get("figures")
    return isinstance(figures, dict) and bool(figures) and all(
        isinstance(f, dict) and all(isinstance(f.get(k), (int, float)) for k in ("prefill_ms", "decode_step_ms"))
        for f in figures.values())


def store_choice(key: str, record: dict[str, Any], path: Path | None = None) -> None:
    """Add ``record`` under ``key`` to the cache file (written atomically, under an OS file lock so that
    processes storing at once keep each other's keys; errors are ignored: the next load measures again)."""
    import fcntl  # the probe runs on CPUs of POSIX hosts only (dtype="auto" on a CPU device)

    path = path or cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                data = json.loads(path.read_text())
                if not isinstance(data, dict):
                    data = {}
            except (OSError, ValueError):
                data = {}
            data[key] = record
            tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
            tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
            os.replace(tmp, path)
    except OSError:
        pass


def time_model(model: torch.nn.Module, dtype: torch.dtype, attention_backend: str, device: torch.device,
               clock: Callable[[], float] = time.perf_counter, argmax_screen: bool = False) -> tuple[float, float, float]:
    """One prefill chunk of :data:`PREFILL_TOKENS` tokens, then the fastest of :data:`DECODE_STEPS` batch-1
    decode steps after it with full logits, then (``argmax_screen`` and a head the screen takes, as
    :func:`~llminfer.kernels.argmax_screen.attach_argmax_screen` decides; it stays attached) the fastest of as
    many greedy steps through the screen, on a scratch KV cache.

    Returns:
        ``(prefill_ms, decode_step_ms, greedy_step_ms)``; ``greedy_step_ms`` is ``decode_step_ms`` where no
        screen is attached.
    """
    from llminfer.backends.attention import PagedKVCache
    from llminfer.backends.hf import run_packed
    from llminfer.kernels.prepack import argmax_only
    from llminfer.kv.sizing import kv_geometry

    layers, kv_heads, head_dim = kv_geometry(model.config)
    block = 16
    n = PREFILL_TOKENS + 2 * DECODE_STEPS
    blocks = list(range(-(-n // block)))
    cache = PagedKVCache(layers, len(blocks), block, kv_heads, head_dim, dtype, device)
    t0 = clock()
    run_packed(model, cache, [[1] * PREFILL_TOKENS], [0], [blocks], [PREFILL_TOKENS - 1], device, attention_backend)
    prefill = clock() - t0

    def decode_steps(first: int) -> float:
        times = []
        for i in range(first, first + DECODE_STEPS):
            t0 = clock()
            run_packed(model, cache, [[1]], [i], [blocks], [0], device, attention_backend)
            times.append(clock() - t0)
        return min(times) * 1e3

    decode = decode_steps(PREFILL_TOKENS)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not (argmax_screen and device.type == "cpu" and head is not None and _screened(head)):
        return prefill * 1e3, decode, decode
    with argmax_only(head, [0]):
        greedy = decode_steps(PREFILL_TOKENS + DECODE_STEPS)
    return prefill * 1e3, decode, greedy


def _screened(head: torch.nn.Module) -> bool:
    """Whether ``head`` has an argmax screen: measured and attached at its first timing, kept for the later
    rounds (attaching times the head's copies, about a second for a 151k x 512 head)."""
    if hasattr(head, "argmax_screen_probe_ms"):
        return getattr(head, "argmax_screen", None) is not None
    return _attach_screen(head)


def _attach_screen(head: torch.nn.Module) -> bool:
    from llminfer.kernels.argmax_screen import attach_argmax_screen

    return attach_argmax_screen(head)


def measure_dtypes(candidates: Sequence[torch.dtype], prepare: Callable[[torch.dtype], tuple[Any, str]],
                   device: torch.device, rounds: int = 2,
                   timer: Callable[..., tuple[float, float, float]] = time_model) -> tuple[dict[torch.dtype, Any], dict]:
    """Load each candidate with ``prepare(dtype) -> (model, attention_backend)`` and time them alternately with
    ``timer(model, dtype, attention_backend, device) -> (prefill_ms, decode_step_ms, greedy_step_ms)``.

    Returns:
        ``(models, figures)``: the prepared models by dtype, and per dtype name ``{"prefill_ms",
        "decode_step_ms", "greedy_step_ms", "cost_ms"}`` (each time the best of ``rounds``).
    """
    models = {dt: prepare(dt) for dt in candidates}
    best: dict[torch.dtype, tuple[float, ...]] = {}
    for dt, (model, attn) in models.items():  # a first call builds kernels and caches: not counted
        timer(model, dt, attn, device)
    for _ in range(rounds):
        for dt, (model, attn) in models.items():
            times = tuple(timer(model, dt, attn, device))
            old = best.get(dt)
            best[dt] = times if old is None else tuple(map(min, old, times))
    figures = {str(dt).replace("torch.", ""): {
        "prefill_ms": round(p, 2), "decode_step_ms": round(d, 3), "greedy_step_ms": round(g, 3),
        "cost_ms": round(p + DECODE_WEIGHT * (GREEDY_SHARE * g + (1 - GREEDY_SHARE) * d), 1)}
        for dt, (p, d, g) in best.items()}
    return models, figures


def pick(figures: dict[str, dict[str, float]], flag_choice: str) -> str:
    """The cheapest dtype name in ``figures``; ``flag_choice`` where it is within :data:`TIE` of it."""
    cheapest = min(figures, key=lambda k: figures[k]["cost_ms"])
    if flag_choice in figures and figures[flag_choice]["cost_ms"] <= figures[cheapest]["cost_ms"] * (1 + TIE):
        return flag_choice
    return cheapest
