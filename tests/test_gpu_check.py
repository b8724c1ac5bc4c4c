"""bench/gpu_check.py --dry-run: every section of the device check runs on CPU (tiny shapes, Triton kernels
in the interpreter, the CUDA-graph runner without capture) and writes one JSON with all its figures."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("triton")
BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.mark.slow
def test_dry_run_writes_every_figure(tmp_path):
    spec = importlib.util.spec_from_file_location("gpu_check", BENCH / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    out = tmp_path / "gpu_check.json"
    gpu_check.main(["--dry-run", "--out", str(out)])
    data = json.loads(out.read_text())
    for name in ("exactness", "model", "bandwidth", "throughput"):
        assert "error" not in data[name] and "skipped" not in data[name], (name, data[name])
    assert data["exactness"]["all_match"] is True
    assert data["exactness"]["llama"]["cuda_graphs"]["replayed_steps"] > 0
    bw = data["bandwidth"]
    assert bw["copy_bandwidth_bytes_per_s"] > 0 and 0 < bw["graphs_on"]["bandwidth_utilisation"]
    assert bw["graphs_on"]["weight_bytes"] > bw["graphs_on"]["kv_bytes"] > 0
    tp = data["throughput"]
    for runner in ("llminfer", "hf_static", "hf_continuous"):
        assert "error" not in tp[runner], (runner, tp[runner])
        assert tp[runner]["output_tokens"] == tp["requested_output_tokens"]
    assert tp["ratio_llminfer_over_hf_static"] > 0 and tp["ratio_llminfer_over_hf_continuous"] > 0
