"""Run every benchmark suite in turn (what ``nox -s bench`` runs). Results land in bench/results/*.json.

    python bench/run_all.py [--quick]
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> int:
    quick = "--quick" in sys.argv
    suites = [
        ["bench_vs_hf.py", "--reps", "2" if quick else "3"],
        ["bench_scheduler.py", "--reps", "1" if quick else "2"] + (["--num-requests", "32"] if quick else []),
        ["bench_speculative.py", "--reps", "1" if quick else "2"],
    ]
    failed = 0
    for suite in suites:
        print(f"=== {' '.join(suite)}", flush=True)
        rc = subprocess.call([sys.executable, str(HERE / suite[0]), *suite[1:]], cwd=HERE)
        failed += rc != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
