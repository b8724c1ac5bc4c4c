#!/usr/bin/env bash
# The device check in one command (see bench/gpu_check.py for what it measures and the wheel recipe).
#   bash bench/gpu_check.sh            # on the GPU machine: writes $OUT/gpu_check.json (or bench/results/)
#   bash bench/gpu_check.sh --dry-run  # on CPU: every code path, tiny shapes, Triton interpreter
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
if ! "$PY" -c "import attrs, cattrs, anyio, structlog, polars, typer, xgrammar, safetensors" 2>/dev/null; then
  if [ -d bench/wheels ]; then
    "$PY" -m pip install --no-index --find-links bench/wheels -q \
      attrs cattrs anyio structlog polars typer xgrammar safetensors
  else
    echo "gpu_check: llminfer's dependencies are missing and bench/wheels is absent (recipe: bench/gpu_check.py)" >&2
    exit 2
  fi
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
exec timeout 480 "$PY" bench/gpu_check.py "$@"
