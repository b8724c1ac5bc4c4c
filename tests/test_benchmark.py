"""Benchmark metrics on synthetic traces with known answers, the serving load generator against a stub
server with known delays, artifacts against their JSON Schemas, and plots."""

from __future__ import annotations

import json
import socket
import time

import polars as pl
import pytest

from llminfer import EngineConfig, InferenceEngine
from llminfer.benchmark import BackendComparison, Benchmarker, itl_ms, request_metrics, summarize, trace_frame
from llminfer.benchmark.artifacts import validate
from llminfer.benchmark.serving import ServingConfig, ServingWorkload, run_serving_benchmark_sync

MS = 1_000_000


def synthetic_trace():
    """Two requests with hand-computed answers (times in ms)."""
    ev = []
    # r1: arrives 0, queued 1, scheduled 3, prefill done 10, tokens at 12, 17, 22, 27 (4 tokens), done 27.
    ev += [("r1", "tokenize", "arrived", 0, 0), ("r1", "scheduler", "queued", 1 * MS, 8),
           ("r1", "scheduler", "first_scheduled", 3 * MS, 4), ("r1", "scheduler", "prefill_done", 10 * MS, 8),
           ("r1", "sink", "first_token", 12 * MS, 1), ("r1", "sink", "token", 17 * MS, 1),
           ("r1", "sink", "token", 22 * MS, 1), ("r1", "sink", "token", 27 * MS, 1),
           ("r1", "sink", "finished", 27 * MS, 0)]
    # r2: arrives 5, two tokens per delivery (speculative): 2 at 25, 2 at 35, done 35.
    ev += [("r2", "tokenize", "arrived", 5 * MS, 0), ("r2", "scheduler", "queued", 5 * MS, 4),
           ("r2", "scheduler", "first_scheduled", 15 * MS, 0), ("r2", "scheduler", "prefill_done", 20 * MS, 4),
           ("r2", "sink", "first_token", 25 * MS, 2), ("r2", "sink", "token", 35 * MS, 2),
           ("r2", "sink", "finished", 35 * MS, 0)]
    ev += [("__step__", "step", "step_start", 2 * MS, 12)]
    return trace_frame(ev)


def test_metrics_on_synthetic_trace():
    per = {r["request_id"]: r for r in request_metrics(synthetic_trace()).to_dicts()}
    r1, r2 = per["r1"], per["r2"]
    assert r1["ttft_ms"] == 12 and r1["e2e_ms"] == 27 and r1["output_tokens"] == 4
    assert r1["tpot_ms"] == pytest.approx((27 - 12) / 3)
    assert r1["queue_ms"] == 2 and r1["prefill_ms"] == 7 and r1["decode_ms"] == 17
    assert r1["prompt_tokens"] == 8 and r1["cached_tokens"] == 4
    assert r2["ttft_ms"] == 20 and r2["e2e_ms"] == 30 and r2["output_tokens"] == 4
    assert r2["tpot_ms"] == pytest.approx(10 / 3)
    assert sorted(itl_ms(synthetic_trace()).to_list()) == [5.0, 5.0, 5.0, 10.0]
    s = summarize(synthetic_trace())
    assert s["num_requests"] == 2 and s["output_tokens"] == 8
    assert s["span_s"] == pytest.approx(0.035)
    assert s["output_tokens_per_s"] == pytest.approx(8 / 0.035)
    assert s["prefix_cache_hit_rate"] == 0.5 and s["prefix_cache_token_hit_rate"] == pytest.approx(4 / 12)
    assert s["ttft_ms_p50"] == pytest.approx(16)


def test_unfinished_requests_are_left_out():
    frame = trace_frame([("x", "tokenize", "arrived", 0, 0), ("x", "sink", "first_token", 5 * MS, 1)])
    assert request_metrics(frame).height == 0


# ---------------------------------------------------------------------------------------------- serving
TTFT_S, TPOT_S, TOKENS = 0.25, 0.05, 8


@pytest.fixture(scope="module")
def stub_server():
    """tests/stub_sse_server.py in its own process (its timing must not share a GIL with the client)."""
    import subprocess
    import sys
    from pathlib import Path

    import httpx

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    script = Path(__file__).with_name("stub_sse_server.py")
    proc = subprocess.Popen([sys.executable, str(script), str(port), str(TTFT_S), str(TPOT_S), str(TOKENS)])
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            httpx.get(url, timeout=1)
            break
        except httpx.HTTPError:
            time.sleep(0.1)
    yield url
    proc.terminate()
    proc.wait(10)


def test_serving_benchmark_measures_known_delays(stub_server, tmp_path):
    cfg = ServingConfig(base_url=stub_server, model="stub", endpoint="chat", concurrency=4,
                        slo_ttft_ms=1000, slo_tpot_ms=100)
    result = run_serving_benchmark_sync(cfg, ServingWorkload(num_requests=8, seed=1))
    s = result.summary
    assert s["completed"] == 8 and s["failed"] == 0
    assert s["ttft_ms_p50"] == pytest.approx(TTFT_S * 1000, rel=0.10)
    assert s["tpot_ms_p50"] == pytest.approx(TPOT_S * 1000, rel=0.10)
    assert s["output_tokens"] == 8 * TOKENS
    assert s["goodput_requests_per_s"] == pytest.approx(s["requests_per_s"])
    paths = result.save_artifacts(tmp_path)
    payload = json.loads(paths["json"].read_text())
    validate(payload, "serving")
    csv = pl.read_csv(paths["csv"])
    assert csv.height == 8 and csv["output_tokens"].to_list() == [r["output_tokens"] for r in payload["requests"]]


def test_serving_benchmark_counts_failures():
    cfg = ServingConfig(base_url="http://127.0.0.1:9", model="x", timeout_s=2)  # nothing listens on port 9
    result = run_serving_benchmark_sync(cfg, ServingWorkload(num_requests=3))
    assert result.summary["failed"] == 3 and result.summary["completed"] == 0


# ---------------------------------------------------------------------------------------------- offline
@pytest.fixture(scope="module")
def bench_result():
    engine = InferenceEngine(EngineConfig(max_batch_size=4)).load()
    try:
        yield Benchmarker(engine, prompt_len=8).run(batch_sizes=[1, 2], num_runs=2, max_new_tokens=6)
    finally:
        engine.close()


def test_benchmarker_artifacts_validate_and_agree(bench_result, tmp_path):
    paths = bench_result.save_artifacts(tmp_path)
    payload = json.loads(paths["json"].read_text())
    validate(payload, "benchmark")
    validate(payload["config"], "config")
    csv = pl.read_csv(paths["csv"])
    assert csv.height == 4  # 2 batch sizes x 2 runs, warm-up excluded
    for row, run in zip(csv.to_dicts(), payload["runs"]):
        for key in ("batch_size", "output_tokens", "output_tokens_per_s", "latency_p50_ms"):
            assert row[key] == pytest.approx(run[key])
    assert all(r["output_tokens"] == r["batch_size"] * 6 for r in payload["runs"])  # generated, not requested


def test_plots_are_png(bench_result, tmp_path):
    files = bench_result.plot_suite(tmp_path, prefix="x")
    names = sorted(p.name for p in files)
    assert names == ["x_dashboard.png", "x_latency.png", "x_memory.png", "x_throughput.png", "x_ttft.png"]
    for p in files:
        data = p.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
        width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
        assert (width, height) == ((1100, 800) if "dashboard" in p.name else (600, 400))


def test_comparison_skips_unavailable_backend(tmp_path):
    result = BackendComparison(None, ["eager", "vllm"]).run(batch_sizes=[1], num_runs=1, max_new_tokens=3)
    assert "eager" in result.results and "vllm" in result.skipped
    assert "pip install" in result.skipped["vllm"]
    paths = result.save_artifacts(tmp_path)
    payload = json.loads(paths["json"].read_text())
    validate(payload, "comparison")
    assert pl.read_csv(paths["csv"])["backend"].to_list() == ["eager"]
    text = result.print_table()
    assert "vllm: skipped" in text
