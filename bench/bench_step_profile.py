"""Where a decode step's time goes, next to the memory-bandwidth floor (CPU, fp32, the ~114M bench model).

For batch 1 and batch 32 pure-decode steps, greedy, and batch 32 sampled at temperature 1 (what a server's
clients get unless they set a temperature), two runs of the same workload in one process:

* ``plain``: only the backend's ``execute`` is timed (two clock reads a step): the step period (one
  ``execute`` start to the next) and the time inside ``execute``;
* ``split``: timers on every part of the step (forward hooks on the linear layers, wrappers around the
  model's forward (``packing.forward_logits``), the registered attention function, the metadata builder
  and the sampler), which add their own cost (compare its period with ``plain``'s).

The split's parts (ms per step):

* ``linear_attn``: q/k/v/o projections; ``linear_mlp``: gate/up/down; ``lm_head``;
* ``attention``: the paged attention function (KV write, block gather, masked attention);
* ``model_other``: the rest of the forward (embedding, norms, RoPE, residual adds);
* ``metadata``: building the step's attention metadata; ``sampling``: :func:`~llminfer.sampling.sample`;
* ``backend_other``: the rest of ``execute`` (packing the token lists, logits slicing, sampling states);
* ``overhead``: the period outside ``execute``: scheduler, step output, the event loop's thread hop, and
  whatever the detokenizer and sink stages take from the same cores.

The floor: bytes one step must read (every weight once, the LM head's tied embedding counted once, plus K/V
of the batch's mean context) over the copy bandwidth measured in the same run (``Tensor.copy_`` of a large
buffer, read + written bytes per second, as ``bench/gpu_check.py`` measures it).

    python bench/bench_step_profile.py [--quick] [--reps 3] [--json-out]   (--json-out: bench/results/step_profile.json)
    python bench/bench_step_profile.py --before-after [--quick] [--reps 5] [--json-out]
        (the step changes side by side; --json-out: bench/results/step_profile_before_after.json)
    python bench/bench_step_profile.py --before-after decoder-loop [--quick] [--reps 5] [--json-out]
        (transformers' model forward against llminfer's decoder loop, alternating;
         --json-out: bench/results/step_profile_decoder_loop.json)
    python bench/bench_step_profile.py --before-after decode-stack --quant int8-wo [--quick] [--reps 5]
        (the decoder loop's Python layers against the decode stack's one op for all layers, alternating;
         --json-out: bench/results/step_profile_decode_stack.json)
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from gpu_check import copy_bandwidth, decode_bytes_per_step

from common import BENCH_VOCAB, bench_model_path, environment, random_prompts, save
from llminfer import CacheConfig, EngineConfig, InferenceEngine
from llminfer.backends import base as backend_base
from llminfer.backends import packing
from llminfer.backends.attention import ATTN_IMPLEMENTATION, paged_attention_forward
from llminfer.backends.decoder_loop import use_decode_stack, use_decoder_loop
from llminfer.benchmark.environment import StealMeter
from llminfer.config import QuantConfig, QuantMode
from llminfer.logging import configure_logging

PARTS = ("linear_attn", "linear_mlp", "lm_head", "attention", "model_other", "metadata", "sampling",
         "backend_other", "overhead")
_ATTN_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP_PROJ = ("gate_proj", "up_proj", "down_proj")


def bandwidth_floor_ms(bytes_per_step: float, bandwidth_bytes_per_s: float) -> float:
    """The fastest a step can be if it only streams its bytes once: ``bytes / bandwidth`` in ms.

    Raises:
        ValueError: a bandwidth that is not positive.
    """
    if bandwidth_bytes_per_s <= 0:
        raise ValueError(f"bandwidth must be positive, got {bandwidth_bytes_per_s}")
    return bytes_per_step / bandwidth_bytes_per_s * 1e3


def split_from_timings(parts_s: dict[str, float], execute_s: float, period_s: float) -> dict[str, float]:
    """One step's split in ms, from the raw timer sums of :class:`StepTimers` (seconds).

    ``parts_s`` holds ``forward`` (the whole model call) and the timed parts inside it and inside
    ``execute``; ``model_other`` is the forward less its timed parts, ``backend_other`` is ``execute`` less
    forward, metadata and sampling, ``overhead`` the period less ``execute`` (each clamped at 0: timer
    granularity).
    """
    inside = sum(parts_s.get(k, 0.0) for k in ("linear_attn", "linear_mlp", "lm_head", "attention"))
    forward = parts_s.get("forward", 0.0)
    out = {k: parts_s.get(k, 0.0) * 1e3 for k in ("linear_attn", "linear_mlp", "lm_head", "attention",
                                                   "metadata", "sampling")}
    out["model_other"] = max(0.0, forward - inside) * 1e3
    out["backend_other"] = max(0.0, execute_s - forward - parts_s.get("metadata", 0.0)
                               - parts_s.get("sampling", 0.0)) * 1e3
    out["overhead"] = max(0.0, period_s - execute_s) * 1e3
    return out


def _is_decode(plan: Any) -> bool:
    return bool(plan.sequences) and all(len(s.token_ids) == 1 and s.start_position > 0 for s in plan.sequences)


class StepTimers:
    """Timers on one engine's eager backend; per pure-decode step, the period, ``execute`` time and (with
    ``split``) the parts (seconds). :meth:`install` patches, :meth:`remove` undoes it."""

    def __init__(self, engine: InferenceEngine, split: bool) -> None:
        self.engine, self.split = engine, split
        self.steps: list[dict[str, Any]] = []  # {"start", "execute", "decode", "parts"}
        self._parts: dict[str, float] = defaultdict(float)
        self._undo: list[Any] = []

    def _timed(self, part: str, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._parts[part] += time.perf_counter() - t0
        return wrapper

    def install(self) -> StepTimers:
        backend = self.engine.backend
        execute = backend.execute

        def timed_execute(plan):
            self._parts = defaultdict(float)
            t0 = time.perf_counter()
            out = execute(plan)
            self.steps.append({"start": t0, "execute": time.perf_counter() - t0, "decode": _is_decode(plan),
                               "parts": dict(self._parts), "size": len(plan.sequences)})
            return out

        backend.execute = timed_execute
        self._undo.append(lambda: delattr(backend, "execute"))
        if not self.split:
            return self
        from transformers import AttentionInterface

        # where the eager step looks them up: packing builds the attention metadata, the base class samples
        for module, name, part in ((packing, "build_metadata", "metadata"), (packing, "forward_logits", "forward"),
                                   (backend_base, "sample", "sampling")):
            fn = getattr(module, name)
            setattr(module, name, self._timed(part, fn))
            self._undo.append(lambda module=module, name=name, fn=fn: setattr(module, name, fn))
        AttentionInterface.register(ATTN_IMPLEMENTATION, self._timed("attention", paged_attention_forward))
        self._undo.append(lambda: AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward))
        model = backend.model
        for name, module in model.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            part = ("linear_attn" if leaf in _ATTN_PROJ else "linear_mlp" if leaf in _MLP_PROJ
                    else "lm_head" if leaf == "lm_head" else None)
            if part is not None:
                self._hook(module, part)
        return self

    def _hook(self, module: torch.nn.Module, part: str) -> None:
        starts: list[float] = []

        def pre(*_):
            starts.append(time.perf_counter())

        def post(*_):
            self._parts[part] += time.perf_counter() - starts.pop()

        handles = (module.register_forward_pre_hook(pre), module.register_forward_hook(post))
        self._undo.extend(h.remove for h in handles)

    def remove(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()

    def decode_rows(self, batch: int) -> list[dict[str, float]]:
        """Per pure-decode step of ``batch`` sequences followed by another step: its split (ms), with
        ``period_ms`` and ``execute_ms``."""
        rows = []
        for cur, nxt in zip(self.steps, self.steps[1:]):
            if cur["decode"] and cur["size"] == batch:
                period = nxt["start"] - cur["start"]
                row = split_from_timings(cur["parts"], cur["execute"], period) if self.split else {}
                rows.append({**row, "period_ms": period * 1e3, "execute_ms": cur["execute"] * 1e3})
        return rows


@contextmanager
def timers(engine: InferenceEngine, split: bool) -> Iterator[StepTimers]:
    t = StepTimers(engine, split).install()
    try:
        yield t
    finally:
        t.remove()


@contextmanager
def before_changes(engine: InferenceEngine) -> Iterator[None]:
    """The step as it was before this suite's changes, for side-by-side runs in one process: the LM head's
    weight row-major (as loaded) and greedy rows through torch's ``argmax``."""
    from llminfer.sampling import sampler

    weight = engine.backend.model.get_output_embeddings().weight
    column_major, argmax = weight.t().is_contiguous(), sampler.argmax_rows
    with torch.no_grad():
        weight.data = weight.data.contiguous()
    sampler.argmax_rows = lambda x: x.argmax(dim=-1).tolist()
    try:
        yield
    finally:
        sampler.argmax_rows = argmax
        if column_major:
            with torch.no_grad():
                weight.data = weight.data.t().contiguous().t()


@contextmanager
def _switched_off(engine: InferenceEngine, switch: Callable[[torch.nn.Module, bool], bool]) -> Iterator[None]:
    """``switch(model, False)`` on the engine's model thread for the block, then the previous setting back."""
    model = engine.backend.model
    was = engine.model_thread.call(switch, model, False)
    try:
        yield
    finally:
        engine.model_thread.call(switch, model, was)


def without_decoder_loop(engine: InferenceEngine) -> AbstractContextManager[None]:
    """The eager step through transformers' own ``model(...)`` instead of llminfer's decoder loop."""
    return _switched_off(engine, use_decoder_loop)


def without_decode_stack(engine: InferenceEngine) -> AbstractContextManager[None]:
    """The eager all-decode step through the decoder loop's Python layers instead of the decode stack's one op."""
    return _switched_off(engine, use_decode_stack)


BEFORE = {"step": before_changes, "decoder-loop": without_decoder_loop, "decode-stack": without_decode_stack}


def compare_before_after(engine: InferenceEngine, batch: int, prompt_len: int, new_tokens: int, reps: int,
                         seed: int, change: str = "step") -> dict[str, Any]:
    """Median decode period (ms/step) before and after ``change`` (a key of :data:`BEFORE`), alternating runs
    of the same workload."""
    periods: dict[str, list[float]] = {"before": [], "after": []}
    for rep in range(reps):
        for label in ("before", "after"):
            prompts = random_prompts(batch, prompt_len, BENCH_VOCAB, seed=seed + rep)
            ctx = BEFORE[change](engine) if label == "before" else nullcontext()
            with ctx, timers(engine, False) as t:
                engine.run_batch_continuous(prompts, max_new_tokens=new_tokens, ignore_eos=True)
            rows = t.decode_rows(batch)
            periods[label].append(statistics.median(r["period_ms"] for r in rows))
    before, after = (statistics.median(periods[k]) for k in ("before", "after"))
    return {"batch": batch, "ms_per_step_before": before, "ms_per_step_after": after,
            "ratio_after_over_before": after / before, "runs_ms": periods}


def _medians(rows: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]} if rows else {}


def profile_batch(engine: InferenceEngine, batch: int, prompt_len: int, new_tokens: int, reps: int,
                  seed: int, plain_only: bool = False, temperature: float = 0.0) -> dict[str, Any]:
    """Median per-step figures over ``reps`` alternating plain/split runs of ``batch`` requests (greedy, or
    sampled at ``temperature``)."""
    plain_rows: list[dict[str, float]] = []
    split_rows: list[dict[str, float]] = []
    for rep in range(reps):
        for split in (False,) if plain_only else (False, True):
            prompts = random_prompts(batch, prompt_len, BENCH_VOCAB, seed=seed + 2 * rep + split)
            with timers(engine, split) as t:
                engine.run_batch_continuous(prompts, max_new_tokens=new_tokens, ignore_eos=True,
                                            temperature=temperature)
            (split_rows if split else plain_rows).extend(t.decode_rows(batch))
    return {"batch": batch, "prompt_tokens": prompt_len, "new_tokens": new_tokens, "temperature": temperature,
            "decode_steps_measured": {"plain": len(plain_rows), "split": len(split_rows)},
            "plain": _medians(plain_rows), "split": _medians(split_rows)}


def _label(case: dict[str, Any]) -> str:
    return f"batch {case['batch']}" + (f" T={case['temperature']:g}" if case.get("temperature") else "")


def print_table(results: dict[str, Any]) -> None:
    cases = results["cases"]
    head = f"{'ms/step':<16}" + "".join(f"{_label(c):>12}{'%':>6}" for c in cases)
    print(head)
    print("-" * len(head))
    for part in PARTS + ("period_ms",):
        cells = ""
        for c in cases:
            split = c["split"]
            v = split.get(part, float("nan"))
            pct = 100 * v / split["period_ms"] if split.get("period_ms") else float("nan")  # nan: --plain-only
            cells += f"{v:>12.2f}{pct:>6.1f}"
        print(f"{'split period' if part == 'period_ms' else part:<16}{cells}")
    for label, key in (("plain period", ("plain", "period_ms")), ("plain execute", ("plain", "execute_ms")),
                       ("floor (weights+KV)", ("floor_ms",)), ("plain / floor", ("plain_over_floor",))):
        cells = ""
        for c in cases:
            v = c
            for k in key:
                v = v.get(k, float("nan")) if isinstance(v, dict) else float("nan")
            cells += f"{v:>12.2f}{'':>6}"
        print(f"{label:<16}{cells}")
    print(f"copy bandwidth {results['copy_bandwidth_bytes_per_s'] / 1e9:.2f} GB/s (read + written); "
          f"load average before {results['loadavg_before']}, after {results['loadavg_after']}; "
          f"steal {_pct(results.get('steal_pct'))}")


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.1f} %"


def _loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def run(quick: bool, reps: int, plain_only: bool = False, compare: str | None = None,
        quant: str = "none", dtype: str = "float32") -> dict[str, Any]:
    configure_logging("warning")
    torch.set_num_threads(int(os.environ.get("LLMINFER_BENCH_THREADS", "2")))
    load_before = _loadavg()
    steal = StealMeter()
    cfg = EngineConfig(model_name=str(bench_model_path()), dtype=dtype, device="cpu", max_batch_size=32,
                       batch_timeout_ms=0, attention_backend=os.environ.get("LLMINFER_BENCH_ATTENTION", "auto"),
                       cache=CacheConfig(page_size_tokens=16, kv_cache_memory_bytes=256 << 20),
                       quant=QuantConfig(mode=QuantMode(quant)))
    engine = InferenceEngine(cfg).load().start()
    try:
        engine.run_batch_continuous(random_prompts(2, 16, BENCH_VOCAB, seed=99), max_new_tokens=4)  # warm-up
        shapes = [(1, 128, 16 if quick else 48), (32, 128, 8 if quick else 24)]
        # Sampled rows (temperature 1, OpenAI's default, which a server's clients get unless they set one):
        # the sampler's draw over the vocabulary shows in ``sampling``.
        sampled = [(32, 128, 8 if quick else 24, 1.0)]
        cases = []
        if compare:
            out = [compare_before_after(engine, b, p, n, reps, seed=1000 * (i + 1), change=compare)
                   for i, (b, p, n) in enumerate(shapes)]
            for c in out:
                print(f"batch {c['batch']}: before {c['ms_per_step_before']:.1f} ms/step, after "
                      f"{c['ms_per_step_after']:.1f} ms/step, after/before {c['ratio_after_over_before']:.2f} "
                      f"(runs {c['runs_ms']})")
            name = "step_profile_before_after" if compare == "step" else f"step_profile_{compare.replace('-', '_')}"
            return {"benchmark": name, "change": compare, "cases": out, "reps": reps, "quick": quick,
                    "loadavg_before": load_before, "loadavg_after": _loadavg(), "steal_pct": steal.pct(),
                    "environment": environment()}
        # On the engine's model thread: a copy this large on this thread would start a second OpenMP team,
        # and libgomp would then throttle the engine's team for the rest of the run (see csrc/thread_pool.h).
        measure = (engine.model_thread.call if engine.model_thread is not None else lambda f, *a: f(*a))
        bw = measure(copy_bandwidth, "cpu", False, 256 << 20, 4 if quick else 10)
        for i, (batch, prompt_len, new_tokens, temperature) in enumerate([(*s, 0.0) for s in shapes] + sampled):
            case = profile_batch(engine, batch, prompt_len, new_tokens, reps, seed=100 * (i + 1),
                                 plain_only=plain_only, temperature=temperature)
            moved = decode_bytes_per_step(engine.backend.model, prompt_len + new_tokens / 2)
            moved["kv_bytes"] *= batch
            moved["total_bytes"] = moved["weight_bytes"] + moved["kv_bytes"]
            case.update(moved)
            case["floor_ms"] = bandwidth_floor_ms(moved["total_bytes"], bw)
            if case["plain"]:
                case["plain_over_floor"] = case["plain"]["period_ms"] / case["floor_ms"]
            cases.append(case)
    finally:
        engine.close()
    return {"benchmark": "step_profile", "dtype": dtype, "quant": quant, "reps": reps, "quick": quick,
            "copy_bandwidth_bytes_per_s": bw, "cases": cases,
            "loadavg_before": load_before,
            "loadavg_after": _loadavg(),
            "steal_pct": steal.pct(),
            "environment": environment()}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer tokens per run")
    ap.add_argument("--reps", type=int, default=3, help="alternating plain/split runs per batch size")
    ap.add_argument("--json-out", action="store_true", help="write bench/results/step_profile.json")
    ap.add_argument("--plain-only", action="store_true", help="no split runs: the step period alone "
                    "(for before/after comparisons of two source trees)")
    ap.add_argument("--before-after", nargs="?", const="step", choices=sorted(BEFORE), default=None,
                    help="instead: the decode period before a change and after, alternating: 'step' (the "
                    "default) is this suite's step changes (row-major fp32 LM head, torch argmax), "
                    "'decoder-loop' transformers' model forward against llminfer's decoder loop, "
                    "'decode-stack' the loop's Python layers against the decode stack's one op")
    ap.add_argument("--quant", default="none", help="weight quantization of the model (--quant of llminfer: "
                    "none, int8-wo, int4-wo, ...)")
    ap.add_argument("--dtype", default="float32", help="the model's dtype (float32, bfloat16, auto)")
    args = ap.parse_args(argv)
    results = run(args.quick, args.reps, args.plain_only, args.before_after, args.quant, args.dtype)
    if args.before_after:
        print(f"load average before {results['loadavg_before']}, after {results['loadavg_after']}; "
              f"steal {_pct(results.get('steal_pct'))}")
    else:
        print_table(results)
    if args.json_out:
        print(f"-> {save(results['benchmark'], results)}")
    return results


if __name__ == "__main__":
    main()
