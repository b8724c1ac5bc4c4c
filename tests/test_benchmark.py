"""Benchmark metrics on synthetic traces with known answers, the serving load generator against a stub
server with known delays (bounds that hold however loaded the machine is), artifacts against their JSON
Schemas, plots, and the offline benchmarks on a core whose backend owns scheduling (the fake vLLM of
``helpers.FakeVLLM``)."""

from __future__ import annotations

import json
import socket
import time

import polars as pl
import pytest

from llminfer import Backend, EngineConfig, InferenceEngine
from llminfer.benchmark import BackendComparison, Benchmarker, itl_ms, request_metrics, summarize, trace_frame
from llminfer.benchmark.artifacts import validate
from llminfer.benchmark.serving import ServingConfig, ServingWorkload, run_serving_benchmark_sync
from llminfer.cli import main
from llminfer.logging import reset_logging

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


def test_random_token_prompts_lengths_and_seed():
    from llminfer.benchmark.runner import random_token_prompts

    fixed = random_token_prompts(3, 5, 100, seed=7)
    assert [len(p) for p in fixed] == [5, 5, 5] and fixed == random_token_prompts(3, 5, 100, seed=7)
    assert random_token_prompts(3, [5, 5, 5], 100, seed=7) == fixed
    mixed = random_token_prompts(3, [2, 0, 4], 100, seed=7)
    assert [len(p) for p in mixed] == [2, 0, 4] and all(10 <= t < 100 for p in mixed for t in p)
    with pytest.raises(ValueError, match="2 prompt lengths for 3 prompts"):
        random_token_prompts(3, [1, 2], 100, seed=0)


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
    """Bounds that hold however loaded the machine is: the stub's sleeps never end early (up to the clock's
    resolution, which asyncio allows), so every client measurement is at least what the stub waited, and
    the figures agree with each other. Nothing is bounded from above: a busy machine only adds time.

    Client-measured TPOT has no such floor: a first chunk read late (the client busy) shortens
    ``e2e - ttft``; its floor is stated as ``e2e >= TTFT + (TOKENS - 1) * TPOT`` instead."""
    cfg = ServingConfig(base_url=stub_server, model="stub", endpoint="chat", concurrency=4,
                        slo_ttft_ms=1000, slo_tpot_ms=100)
    result = run_serving_benchmark_sync(cfg, ServingWorkload(num_requests=8, seed=1))
    slack_ms = TOKENS * time.get_clock_info("monotonic").resolution * 1e3  # one timer resolution per sleep
    ttft_floor, e2e_floor = TTFT_S * 1e3 - slack_ms, (TTFT_S + (TOKENS - 1) * TPOT_S) * 1e3 - slack_ms
    s = result.summary
    assert s["completed"] == 8 and s["failed"] == 0 and s["num_requests"] == 8
    assert s["output_tokens"] == 8 * TOKENS
    for r in result.requests:
        assert r["ok"] and r["error"] is None
        assert r["output_tokens"] == TOKENS and r["chunks"] == TOKENS  # the role-only chunk is not a token
        assert r["ttft_ms"] >= ttft_floor
        assert r["e2e_ms"] >= r["ttft_ms"] and r["e2e_ms"] >= e2e_floor
        assert r["tpot_ms"] >= 0
        assert r["tpot_ms"] * (TOKENS - 1) == pytest.approx(r["e2e_ms"] - r["ttft_ms"], rel=1e-6, abs=1e-3)
    for m in ("ttft_ms", "tpot_ms", "e2e_ms", "itl_ms"):
        assert s[f"{m}_p99"] >= s[f"{m}_p95"] >= s[f"{m}_p50"] >= 0
    assert s["ttft_ms_p50"] >= ttft_floor and s["e2e_ms_p50"] >= e2e_floor
    # 8 requests, at most 4 in flight, each at least e2e_floor long: at least two of them back to back.
    assert s["duration_s"] * 1e3 >= 2 * e2e_floor
    assert s["output_tokens_per_s"] == pytest.approx(s["output_tokens"] / s["duration_s"])
    assert s["requests_per_s"] == pytest.approx(8 / s["duration_s"])
    assert 0 <= s["goodput_requests_per_s"] <= s["requests_per_s"]
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


def test_benchmarker_compiles_every_step_shape_before_its_first_run(monkeypatch):
    """A compiled backend's graphs are all compiled before anything is timed (a shape first met inside a measured
    run once cost that run 13.9 s): ``engine.warmup()`` comes before the first batch."""
    calls: list[str] = []
    monkeypatch.setattr(InferenceEngine, "warmup", lambda self: calls.append("warmup") or 0)
    engine = InferenceEngine(EngineConfig(max_batch_size=2)).load()
    try:
        go = engine.run_batch_continuous
        monkeypatch.setattr(engine, "run_batch_continuous", lambda *a, **k: calls.append("batch") or go(*a, **k))
        Benchmarker(engine, prompt_len=4).run(batch_sizes=[1], num_runs=1, max_new_tokens=2, warmup=0)
    finally:
        engine.close()
    assert calls == ["warmup", "batch"]


def test_benchmarker_artifacts_validate_and_agree(bench_result, tmp_path):
    paths = bench_result.save_artifacts(tmp_path)
    payload = json.loads(paths["json"].read_text())
    validate(payload, "benchmark")
    validate(payload["config"], "config")
    csv = pl.read_csv(paths["csv"])
    assert csv.height == 2 and len(payload["runs"]) == 4  # 2 batch sizes x 2 runs, warm-up excluded
    assert len(payload["requests"]) == (1 + 2) * 2 and [r["n_requests"] for r in payload["summary"]] == [2, 4]
    for row, summary in zip(csv.to_dicts(), payload["summary"]):
        for key in ("batch_size", "n_requests", "output_tokens_per_s", "latency_p50_ms", "latency_p99_ms",
                    "peak_memory_mb"):
            assert row[key] == pytest.approx(summary[key])
        assert row["memory_kind"] == summary["memory_kind"] == "rss_peak_minus_loaded"
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


# ---------------------------------------------------------------------------------------------- any core
def test_benchmarker_on_a_core_that_owns_scheduling(fake_vllm, tmp_path):
    """vLLM's core: no model and no KV manager on the engine; the benchmark uses the facade only."""
    engine = InferenceEngine(EngineConfig(backend=Backend.VLLM, batch_timeout_ms=0)).load()
    assert engine.model is None and engine.kv_manager is None
    try:
        result = Benchmarker(engine, prompt_len=8).run(batch_sizes=[2], num_runs=1, max_new_tokens=4, warmup=1)
    finally:
        engine.close()
    assert fake_vllm.resets == 2  # a cold prefix cache before the warm-up and before the measured run
    assert len(fake_vllm.seen) == 4 and all(p["max_tokens"] == 4 and p["ignore_eos"] for p in fake_vllm.seen)
    (run,) = result.runs
    assert run["batch_size"] == 2 and run["output_tokens"] == 2 * 4
    assert run["output_tokens_per_s"] > 0 and run["wall_s"] > 0
    (row,) = result.summary().to_dicts()
    assert row["n_requests"] == 2 and row["latency_p99_ms"] >= row["latency_p50_ms"] > 0 and row["ttft_mean_ms"] > 0
    assert row["tpot_mean_ms"] is not None and row["tpot_mean_ms"] > 0
    assert row["itl_p50_ms"] is not None  # from the stage trace
    assert result.config["backend"] == "vllm"
    payload = json.loads(result.save_artifacts(tmp_path)["json"].read_text())
    validate(payload, "benchmark")


def test_comparison_runs_a_core_that_owns_scheduling(fake_vllm, tmp_path):
    result = BackendComparison(None, ["eager", "vllm"]).run(batch_sizes=[1], num_runs=1, max_new_tokens=3,
                                                           warmup=0, prompt_len=8)
    assert result.skipped == {} and list(result.results) == ["eager", "vllm"]
    table = result.table()
    assert table["backend"].to_list() == ["eager", "vllm"]
    vllm_row = table.filter(pl.col("backend") == "vllm").to_dicts()[0]
    assert vllm_row["output_tokens_per_s"] > 0 and vllm_row["latency_p50_ms"] > 0
    assert result.results["vllm"].runs[0]["output_tokens"] == 3
    assert fake_vllm.resets == 1
    payload = json.loads(result.save_artifacts(tmp_path)["json"].read_text())
    validate(payload, "comparison")
    assert set(payload["backends"]) == {"eager", "vllm"} and payload["skipped"] == {}


def test_cli_compare_on_a_core_that_owns_scheduling(fake_vllm, tmp_path, capsys):
    try:
        main(["compare", "--backends", "eager,vllm", "--batch-sizes", "1", "--runs", "1", "--warmup", "0",
              "--max-new-tokens", "2", "--prompt-len", "4", "--artifacts-dir", str(tmp_path)])
    finally:
        reset_logging()  # the CLI bound logging to the captured stderr
    out = capsys.readouterr().out
    assert "skipped" not in out and "vllm" in out
    payload = json.loads((tmp_path / "comparison.json").read_text())
    assert set(payload["backends"]) == {"eager", "vllm"} and payload["skipped"] == {}
    assert pl.read_csv(tmp_path / "comparison.csv")["backend"].to_list() == ["eager", "vllm"]
