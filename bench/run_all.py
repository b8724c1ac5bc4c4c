"""Run every benchmark suite in turn (what ``nox -s bench`` runs), then print a table of the ratios.
Each suite writes bench/results/<name>.json; each ratio is measured side by side within one suite run.

    python bench/run_all.py [--quick] [--only vs_hf,scheduler,...] [--list] [--suite-timeout-s S] [--no-fork]

``--quick`` passes each suite its own small workload (a few repetitions, small batches, short outputs:
minutes for the whole suite on 2 cores); its ratios show that every suite runs, not the figures the
targets are about. Progress goes to stdout per suite: which one, n/N, its time and the total elapsed.

To add a suite: append a :class:`Suite` to :data:`SUITES` (a script in bench/ that writes
``results/<file>.json`` and understands ``--quick``, e.g. through ``common.parse_args``), and the figures
the table should show to :data:`RATIOS`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import runpy
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
#: The trained model of the quality suites, as bench/common.py names it (not imported: run_all.py stays light).
TRAINED_MODEL = os.environ.get("LLMINFER_BENCH_TRAINED_MODEL", "llminfer/smollm2-135m-instruct")


@dataclass(frozen=True)
class Suite:
    """One benchmark script: ``args`` always, plus ``quick_args`` under ``--quick``."""

    name: str
    script: str
    args: tuple[str, ...] = ()
    quick_args: tuple[str, ...] = ("--quick",)

    def argv(self, quick: bool) -> list[str]:
        return [self.script, *self.args, *(self.quick_args if quick else ())]


@dataclass(frozen=True)
class Ratio:
    """A row of the final table: ``keys`` looked up in ``results/<file>`` (a key may be a callable that
    picks one from the object at that level), with the target the figure is meant to meet."""

    label: str
    file: str
    keys: tuple
    target: str


SUITES: list[Suite] = [
    Suite("vs_hf", "bench_vs_hf.py"),
    Suite("scheduler", "bench_scheduler.py"),
    Suite("speculative", "bench_speculative.py"),
    Suite("tracing", "bench_tracing.py"),
    Suite("serving", "bench_serving.py"),
    Suite("compiled", "bench_compiled.py"),
    Suite("argmax_screen", "bench_argmax_screen.py"),
    Suite("quant", "bench_quant.py"),
    Suite("dtype", "bench_dtype.py"),
    Suite("structured", "bench_structured.py"),
    Suite("step_metadata", "bench_step_metadata.py", quick_args=("--quick", "--reps", "1")),
    Suite("step_profile", "bench_step_profile.py", args=("--json-out",), quick_args=("--quick", "--reps", "1")),
    Suite("cpu_kernels", "bench_cpu_kernels.py"),
    # On the trained model (common.TRAINED_MODEL): prompt lookup, quantization accuracy, API quality.
    Suite("speculative_lookup", "bench_speculative.py", args=("--model", TRAINED_MODEL),
          quick_args=("--quick", "--new-tokens", "32")),
    Suite("quant_trained", "bench_quant.py", args=("--model", TRAINED_MODEL)),
    Suite("quality", "bench_quality.py"),
]


def _largest_batch(results: dict) -> str:
    return max(results, key=lambda k: int(k.split("_")[1]))


def _slowest_batch(results: dict) -> str:
    return min(results, key=lambda k: results[k]["speed_ratio_compiled_over_eager"])


def _kernel_case(case: str, rows: int):
    """Picks ``bench_cpu_kernels.py``'s product row for ``case`` at ``rows`` activation rows."""
    return lambda products: next(i for i, r in enumerate(products) if r["case"] == case and r["rows"] == rows)


RATIOS: list[Ratio] = [
    Ratio("llminfer / HF generate (batch 32, 32+64 tokens)", "llminfer_vs_hf.json", ("ratio_llminfer_over_hf",),
          ">= 1.0"),
    Ratio("mixed workload: llminfer / HF static batches", "scheduler_kv.json", ("mixed", "ratio_vs_hf_static"),
          ">= 1.6"),
    Ratio("  same, priority = longest output first", "scheduler_kv.json",
          ("mixed", "ratio_longest_first_vs_hf_static"), "report"),
    Ratio("mixed workload: llminfer / transformers CB", "scheduler_kv.json", ("mixed", "ratio_vs_hf_continuous"),
          ">= 1.5"),
    Ratio("shared 1k prefix: TTFT warm cache / cache off", "scheduler_kv.json",
          ("shared_prefix", "ratio_warm_over_off"), "<= 0.25"),
    Ratio("0% hits: throughput cache on / off", "scheduler_kv.json", ("zero_hit", "ratio_on_over_off"), ">= 0.97"),
    Ratio("tracing on / off throughput", "tracing.json", ("ratio_on_over_off",), ">= 0.98"),
    Ratio("served (32 streams) / in-process throughput", "serving.json", ("ratio_served_over_in_process",),
          ">= 0.9"),
    Ratio("speculative (draft = target) / plain", "speculative.json", ("speed_ratio_vs_plain", "draft=target"),
          "report"),
    Ratio("speculative (draft = 2-layer) / plain", "speculative.json", ("speed_ratio_vs_plain", "draft=2-layer"),
          "report"),
    Ratio("compiled / eager tokens/s, batch 1 (CPU)", "compiled_vs_eager.json",
          ("results", "batch_1", "speed_ratio_compiled_over_eager"), "report"),
    Ratio("compiled / eager tokens/s, largest batch (CPU)", "compiled_vs_eager.json",
          ("results", _largest_batch, "speed_ratio_compiled_over_eager"), "report"),
    Ratio("compiled / eager tokens/s, slowest batch (CPU)", "compiled_vs_eager.json",
          ("results", _slowest_batch, "speed_ratio_compiled_over_eager"), ">= 0.95 (checked)"),
    Ratio("argmax screen on / off, greedy batch 1 (CPU)", "argmax_screen.json",
          ("results", "batch_1", "speed_ratio_on_over_off"), ">= 1.0"),
    Ratio("int8-wo / fp32 decode speed, batch 1 (CPU)", "quant.json", ("speedup_vs_fp32", "int8-wo"), ">= 1.6"),
    Ratio("int8-wo top-1 agreement with fp32 (teacher-forced)", "quant.json",
          ("accuracy_teacher_forced", "int8-wo", "top1_agreement"), ">= 0.95"),
    Ratio("dtype=auto / bf16 decode speed, batch 1 (CPU)", "dtype_auto.json",
          ("speed_ratio_auto_over_bf16", "batch_1"), ">= 2 on AVX2"),
    Ratio("dtype=auto / bf16 decode speed, largest batch (CPU)", "dtype_auto.json",
          ("speed_ratio_auto_over_bf16", _largest_batch), ">= 2 on AVX2"),
    Ratio("mixed workload, half JSON Schema / unconstrained", "structured.json",
          ("throughput", "ratio_constrained_over_unconstrained"), ">= 0.9"),
    Ratio("grammar mask time / step time (constrained run)", "structured.json", ("mask", "share_of_step"),
          "report"),
    Ratio("step metadata: tensor ops / loop, 32 decode rows", "step_metadata.json",
          ("builder", "decode_32x1k", "ratio_after_over_before"), "< 1.0"),
    Ratio("step metadata: tensor ops / loop, 2048-token chunk", "step_metadata.json",
          ("builder", "prefill_2048_over_1k", "ratio_after_over_before"), "< 1.0"),
    Ratio("CPU step time, tensor-op metadata / loop", "step_metadata.json", ("step", "ratio_after_over_before"),
          "<= 1.0"),
    Ratio("batch-1 fp32 decode step / memory-bandwidth floor", "step_profile.json",
          ("cases", 0, "plain_over_floor"), "report"),
    Ratio("prompt lookup / plain, summarise workload (trained)", "speculative_lookup.json",
          ("speed_ratio_vs_plain", "prompt-lookup"), ">= 1.3"),
    Ratio("int8-wo top-1 agreement with fp32 (trained model)", "quant_trained.json",
          ("accuracy_teacher_forced", "int8-wo", "top1_agreement"), ">= 0.99"),
    Ratio("  same, unquantized bf16 (yardstick)", "quant_trained.json",
          ("accuracy_teacher_forced", "bf16", "top1_agreement"), "report"),
    Ratio("tool calls right, tool_choice required (trained)", "quality.json", ("tool_calls_right", "required"),
          "report"),
    Ratio("JSON Schema capitals right (trained)", "quality.json", ("json_schema", "capital_right"), "report"),
    Ratio("lm-eval local multiple choice acc (trained)", "quality.json", ("lm_eval", "acc,none"), "> 0.33"),
    Ratio("torch / CPU kernel: 56 fp32 layers, 1 row", "cpu_kernels.json",
          ("products", _kernel_case("layers_fp32", 1), "torch_over_kernel"), "> 1.0"),
    Ratio("torch / CPU kernel: int8 LM head, 1 row", "cpu_kernels.json",
          ("products", _kernel_case("head_int8", 1), "torch_over_kernel"), "> 1.0"),
    Ratio("torch / CPU kernel: int8 LM head, 32 rows", "cpu_kernels.json",
          ("products", _kernel_case("head_int8", 32), "torch_over_kernel"), "> 1.0"),
    Ratio("torch / CPU kernel: decode attention, batch 32", "cpu_kernels.json",
          ("attention", 2, "torch_over_kernel"), "> 1.0"),
]


def _get(path: Path, *keys):
    try:
        value = json.loads(path.read_text())
        for k in keys:
            value = value[k(value) if callable(k) else k]
        return value
    except (OSError, KeyError, IndexError, TypeError, ValueError):
        return None


def summary_table(results: Path = RESULTS) -> str:
    lines = [f"{'figure':52s} {'ratio':>8s}  target"]
    for row in RATIOS:
        v = _get(results / row.file, *row.keys)
        lines.append(f"{row.label:52s} {'-' if v is None else f'{v:8.3f}':>8s}  {row.target}")
    return "\n".join(lines)


COMPILED_MIN_RATIO = 0.95
"""The compiled backend may be at most 5 % slower than eager at any batch ``bench_compiled.py`` measured."""


def failed_checks(results: Path = RESULTS) -> list[str]:
    """The ratio checks that fail a full run (not ``--quick``, whose tiny model's ratios are not figures): one
    line each. A suite that wrote no file fails nothing here (its own exit code counts)."""
    out = []
    compiled = _get(results / "compiled_vs_eager.json", "results") or {}
    for key, row in sorted(compiled.items()):
        ratio = row.get("speed_ratio_compiled_over_eager") if isinstance(row, dict) else None
        if ratio is not None and ratio < COMPILED_MIN_RATIO:
            out.append(f"compiled / eager tokens/s at {key.replace('_', ' ')} is {ratio:.3f} < {COMPILED_MIN_RATIO} "
                       "(bench/results/compiled_vs_eager.json)")
    return out


def preload() -> None:
    """Import what every suite imports (torch, transformers' Qwen2 code, llminfer's engine): about 7 s per
    interpreter on 2 cores, paid once when the suites run in forked children (:func:`run_forked`). Nothing
    here runs a parallel op, so the children's OpenMP thread pools start fresh."""
    import torch  # noqa: F401
    import transformers.models.qwen2.modeling_qwen2  # noqa: F401

    import llminfer.assembly  # noqa: F401


def run_forked(script: Path, args: list[str], timeout_s: float | None) -> int:
    """Run ``script`` as ``__main__`` with ``args`` in a forked child of this process (which has run
    :func:`preload`) and return its exit code, as ``subprocess.call`` would: each suite still gets its own
    process, so no state leaks from one suite into the next.

    Raises:
        subprocess.TimeoutExpired: the child ran past ``timeout_s`` seconds (it is killed first).
    """
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the parent's code
        code = 1
        try:
            os.setpgid(0, 0)  # its own process group: a timeout stops the servers a suite started too
            os.chdir(script.parent)
            sys.argv = [str(script), *args]
            sys.path.insert(0, str(script.parent))
            runpy.run_path(str(script), run_name="__main__")
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except KeyboardInterrupt:
            code = 130
        except BaseException:  # noqa: BLE001 - print it as the interpreter would, then exit 1
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return os.waitstatus_to_exitcode(status)
            if deadline is not None and time.monotonic() > deadline:
                _stop_group(pid, signal.SIGKILL)
                raise subprocess.TimeoutExpired(str(script), timeout_s)
            time.sleep(0.2)
    except KeyboardInterrupt:  # Ctrl-C reaches only the terminal's process group: pass it on
        _stop_group(pid, signal.SIGINT)
        raise


def _stop_group(pid: int, sig: int) -> None:
    """Send ``sig`` to the child's process group, then reap the child (SIGKILL after 10 s)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, sig)
    for _ in range(50):
        if os.waitpid(pid, os.WNOHANG)[0]:
            return
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    os.waitpid(pid, 0)


def _children_cpu_s() -> float:
    """User + system CPU seconds of the finished child processes so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _clock(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    return f"{m}m{s:02d}s"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="each suite's small workload (minutes in all)")
    ap.add_argument("--only", default=None, help="comma-separated suites: " + ",".join(s.name for s in SUITES))
    ap.add_argument("--list", action="store_true", help="list the suites and their commands, run nothing")
    ap.add_argument("--suite-timeout-s", type=float, default=None, help="stop a suite that runs longer")
    ap.add_argument("--fork", action=argparse.BooleanOptionalAction, default=hasattr(os, "fork"),
                    help="run each suite in a forked child of a process that imported torch and transformers "
                    "once (default where os.fork exists; --no-fork: a fresh interpreter per suite)")
    args = ap.parse_args(argv)
    names = [s.name for s in SUITES]
    only = args.only.split(",") if args.only else None
    unknown = sorted(set(only or ()) - set(names))
    if unknown:
        ap.error(f"--only: unknown suite(s) {', '.join(unknown)} (known: {', '.join(names)})")
    chosen = [s for s in SUITES if only is None or s.name in only]
    if args.list:
        for s in chosen:
            print(f"{s.name:14s} python bench/{' '.join(s.argv(args.quick))}")
        return 0
    t0 = time.monotonic()
    if args.fork:
        preload()
    outcome: list[tuple[str, str, float]] = []
    for i, suite in enumerate(chosen, 1):
        head = f"=== [{i}/{len(chosen)}] {suite.name}"
        if not (HERE / suite.script).exists():
            print(f"{head}: {suite.script} not found, skipped", flush=True)
            outcome.append((suite.name, "missing", 0.0, 0.0))
            continue
        print(f"{head}: python bench/{' '.join(suite.argv(args.quick))}  (elapsed {_clock(time.monotonic() - t0)})",
              flush=True)
        start, cpu0 = time.monotonic(), _children_cpu_s()
        try:
            if args.fork:
                rc = run_forked(HERE / suite.script, suite.argv(args.quick)[1:], args.suite_timeout_s)
            else:
                rc = subprocess.call([sys.executable, str(HERE / suite.script), *suite.argv(args.quick)[1:]],
                                     cwd=HERE, timeout=args.suite_timeout_s)
            status = "ok" if rc == 0 else f"failed (exit {rc})"
        except subprocess.TimeoutExpired:
            status = f"timed out after {args.suite_timeout_s:g} s"
        took, cpu = time.monotonic() - start, _children_cpu_s() - cpu0
        outcome.append((suite.name, status, took, cpu))
        print(f"--- [{i}/{len(chosen)}] {suite.name}: {status} in {took:.1f} s, {cpu:.1f} CPU-s "
              f"(elapsed {_clock(time.monotonic() - t0)})", flush=True)
    print(f"\n{'suite':14s} {'seconds':>8s} {'CPU-s':>8s}  status")
    for name, status, took, cpu in outcome:
        print(f"{name:14s} {took:8.1f} {cpu:8.1f}  {status}")
    print(f"{'total':14s} {time.monotonic() - t0:8.1f} {sum(o[3] for o in outcome):8.1f}  "
          f"(CPU-s: user + system time of the suites, less exposed to other load than seconds)")
    print("\n" + summary_table())
    failed = [] if args.quick else failed_checks()
    for line in failed:
        print(f"ratio check failed: {line}")
    if args.quick:
        print("(--quick: each suite's small workload; the ratios show the suites run, not the targeted figures)")
    return 1 if failed or any(o[1] not in ("ok", "missing") for o in outcome) else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("run_all: interrupted", file=sys.stderr)
        sys.exit(130)
