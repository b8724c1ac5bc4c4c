"""Run every benchmark suite in turn (what ``nox -s bench`` runs), then print a table of the ratios.
Each suite writes bench/results/<name>.json; each ratio is measured side by side within one suite run.

    python bench/run_all.py [--quick] [--only vs_hf,scheduler,speculative,tracing,compiled,quant,structured,step_metadata]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"


def suites(quick: bool) -> dict[str, list[str]]:
    reps = "1" if quick else "2"
    return {
        "vs_hf": ["bench_vs_hf.py", "--reps", "2" if quick else "3"],
        "scheduler": ["bench_scheduler.py", "--reps", reps] + (["--num-requests", "32"] if quick else []),
        "speculative": ["bench_speculative.py", "--reps", reps],
        "tracing": ["bench_tracing.py", "--reps", "2" if quick else "3"],
        "serving": ["bench_serving.py"] + (["--num-requests", "32"] if quick else []),
        "compiled": ["bench_compiled.py", "--reps", reps],
        "quant": ["bench_quant.py"] + (["--quick"] if quick else []),
        "structured": ["bench_structured.py", "--reps", reps] + (["--num-requests", "32"] if quick else []),
        "step_metadata": ["bench_step_metadata.py", "--reps", reps] + (["--quick"] if quick else []),
    }


def _get(path: Path, *keys):
    try:
        value = json.loads(path.read_text())
        for k in keys:
            value = value[k]
        return value
    except (OSError, KeyError, TypeError, ValueError):
        return None


def summary_table() -> str:
    rows = [
        ("llminfer / HF generate (batch 32, 32+64 tokens)", RESULTS / "llminfer_vs_hf.json",
         ("ratio_llminfer_over_hf",), ">= 1.0"),
        ("mixed workload: llminfer / HF static batches", RESULTS / "scheduler_kv.json",
         ("mixed", "ratio_vs_hf_static"), ">= 1.6"),
        ("  same, priority = longest output first", RESULTS / "scheduler_kv.json",
         ("mixed", "ratio_longest_first_vs_hf_static"), "report"),
        ("mixed workload: llminfer / transformers CB", RESULTS / "scheduler_kv.json",
         ("mixed", "ratio_vs_hf_continuous"), ">= 1.5"),
        ("shared 1k prefix: TTFT warm cache / cache off", RESULTS / "scheduler_kv.json",
         ("shared_prefix", "ratio_warm_over_off"), "<= 0.25"),
        ("0% hits: throughput cache on / off", RESULTS / "scheduler_kv.json",
         ("zero_hit", "ratio_on_over_off"), ">= 0.97"),
        ("tracing on / off throughput", RESULTS / "tracing.json", ("ratio_on_over_off",), ">= 0.98"),
        ("served (32 streams) / in-process throughput", RESULTS / "serving.json",
         ("ratio_served_over_in_process",), ">= 0.9"),
        ("speculative (draft = target) / plain", RESULTS / "speculative.json",
         ("speed_ratio_vs_plain", "draft=target"), "report"),
        ("speculative (draft = 2-layer) / plain", RESULTS / "speculative.json",
         ("speed_ratio_vs_plain", "draft=2-layer"), "report"),
        ("compiled / eager tokens/s, batch 1 (CPU)", RESULTS / "compiled_vs_eager.json",
         ("results", "batch_1", "speed_ratio_compiled_over_eager"), "report"),
        ("compiled / eager tokens/s, batch 32 (CPU)", RESULTS / "compiled_vs_eager.json",
         ("results", "batch_32", "speed_ratio_compiled_over_eager"), "report"),
        ("int8-wo / fp32 decode speed, batch 1 (CPU)", RESULTS / "quant.json",
         ("speedup_vs_fp32", "int8-wo"), ">= 1.6"),
        ("int8-wo top-1 agreement with fp32 (teacher-forced)", RESULTS / "quant.json",
         ("accuracy_teacher_forced", "int8-wo", "top1_agreement"), ">= 0.95"),
        ("mixed workload, half JSON Schema / unconstrained", RESULTS / "structured.json",
         ("throughput", "ratio_constrained_over_unconstrained"), ">= 0.9"),
        ("grammar mask time / step time (constrained run)", RESULTS / "structured.json",
         ("mask", "share_of_step"), "report"),
        ("step metadata: tensor ops / loop, 32 decode rows", RESULTS / "step_metadata.json",
         ("builder", "decode_32x1k", "ratio_after_over_before"), "< 1.0"),
        ("step metadata: tensor ops / loop, 2048-token chunk", RESULTS / "step_metadata.json",
         ("builder", "prefill_2048_over_1k", "ratio_after_over_before"), "< 1.0"),
        ("CPU step time, tensor-op metadata / loop", RESULTS / "step_metadata.json",
         ("step", "ratio_after_over_before"), "<= 1.0"),
    ]
    lines = [f"{'figure':52s} {'ratio':>8s}  target"]
    for label, path, keys, target in rows:
        v = _get(path, *keys)
        lines.append(f"{label:52s} {'-' if v is None else f'{v:8.3f}':>8s}  {target}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer repetitions and requests")
    ap.add_argument("--only", default=None, help="comma-separated suites: " + ",".join(suites(False)))
    args = ap.parse_args(argv)
    quick = args.quick
    only = set(args.only.split(",")) if args.only else None
    failed = 0
    for name, suite in suites(quick).items():
        if only and name not in only:
            continue
        if not (HERE / suite[0]).exists():
            print(f"=== {name}: {suite[0]} not found, skipped", flush=True)
            continue
        print(f"=== {name}: {' '.join(suite)}", flush=True)
        rc = subprocess.call([sys.executable, str(HERE / suite[0]), *suite[1:]], cwd=HERE)
        failed += rc != 0
    print("\n" + summary_table())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
