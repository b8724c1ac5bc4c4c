"""The cross-server report: ``llminfer bench-serve`` sweeps two live loopback servers (the stub of known
delays in its own process, and llminfer itself), then ``llminfer bench-report`` combines the two artifacts.
Known-answer goodput on synthetic artifacts, and the one-line errors for bad inputs."""

from __future__ import annotations

import contextlib
import json
import math
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import polars as pl
import pytest

import llminfer
from llminfer import EngineConfig, InferenceEngine
from llminfer.api import create_app, serve_in_thread
from llminfer.benchmark.artifacts import validate
from llminfer.benchmark.report import ReportError, build_report, load_artifact, safe_paths
from llminfer.benchmark.serving import ServingResult
from llminfer.benchmark.serving_load import LoadPoint, load_points, parse_concurrencies, parse_request_rates
from llminfer.cli import main
from llminfer.cli.report import ServeProgress
from llminfer.logging import reset_logging

PNG = b"\x89PNG\r\n\x1a\n"


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == PNG and data[12:16] == b"IHDR"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def _cli(args: list[str], capsys) -> tuple[int, str, str]:
    try:
        main(args)
        code = 0
    except SystemExit as exc:
        code = exc.code or 0
    finally:
        reset_logging()
    out = capsys.readouterr()
    return code, out.out, out.err


# Longer than test_benchmark's stub: the 15 % bounds below then leave 120 ms of TTFT for the loopback, the
# client and a busy machine's scheduling, and 12 ms x 8 gaps of TPOT for a first token read late.
TTFT_S, TPOT_S, TOKENS = 0.8, 0.08, 9


@contextlib.contextmanager
def stub_server():
    """tests/stub_sse_server.py in its own process (its sleeps must not share a GIL with the client)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    script = Path(__file__).with_name("stub_sse_server.py")
    proc = subprocess.Popen([sys.executable, str(script), str(port), str(TTFT_S), str(TPOT_S), str(TOKENS)])
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                httpx.get(url, timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.slow
def test_report_of_two_live_servers(tmp_path, capsys):
    stub_dir = tmp_path / "stub"
    with stub_server() as stub_url:
        code, out, err = _cli(["bench-serve", "--base-url", stub_url, "--num-requests", "4", "--concurrency", "1,4",
                               "--label", "stub", "--artifacts-dir", str(stub_dir)], capsys)
    assert code == 0, err
    assert "in flight" not in out and "\r" not in out  # no progress display without a terminal
    assert pl.read_csv(stub_dir / "serving.csv")["concurrency"].to_list() == [1, 4]  # one row per load point
    ours = tmp_path / "llminfer.json"
    engine = InferenceEngine(EngineConfig(max_batch_size=8, batch_timeout_ms=1))
    with serve_in_thread(create_app(engine)) as our_url:
        code, out, err = _cli(["bench-serve", "--base-url", our_url, "--num-requests", "3", "--concurrency", "1,4",
                               "--prompt-len", "4,12", "--output-len", "2,4", "--ignore-eos", "--json-out",
                               str(ours)], capsys)
    capsys.readouterr()  # the server's shutdown log line
    assert code == 0, err
    assert not (tmp_path / "serving.csv").exists()  # only the file asked for

    stub_art, our_art = json.loads((stub_dir / "serving.json").read_text()), json.loads(ours.read_text())
    for art in (stub_art, our_art):
        validate(art, "serving")
        assert [p["load"] for p in art["points"]] == [{"request_rate": None, "concurrency": c} for c in (1, 4)]
    assert stub_art["server"] | {"models": None} == {
        "label": "stub", "base_url": stub_url, "model": "stub", "models": None, "owned_by": "stub-org",
        "server_header": "stub-sse/1.0", "kind": "unknown", "version": None}
    assert our_art["server"]["kind"] == "llminfer" and our_art["server"]["version"] == llminfer.__version__
    assert our_art["server"]["model"] == "llminfer/tiny-qwen2" and our_art["environment"]["side"] == "client"
    assert stub_art["workload"]["fingerprint"] != our_art["workload"]["fingerprint"]  # other lengths

    out_dir = tmp_path / "report"
    code, out, err = _cli(["bench-report", str(stub_dir / "serving.json"), str(ours), "--labels", "stub,ours",
                           "--out-dir", str(out_dir), "--slo-ttft-ms", "1000", "--slo-tpot-ms", "200"], capsys)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split()[:4] == ["server", "load", "ok/err", "TTFT"]
    assert [line.split()[:3] for line in lines[1:5]] == [["stub", "inf", "c=1"], ["stub", "inf", "c=4"],
                                                          ["ours", "inf", "c=1"], ["ours", "inf", "c=4"]]
    assert "workloads differ" in out and "different model names" in out

    payload = json.loads((out_dir / "report.json").read_text())
    validate(payload, "serving_report")
    assert payload["axis"] == "concurrency" and payload["slo"] == {"ttft_ms": 1000, "tpot_ms": 200}
    assert [s["label"] for s in payload["sources"]] == ["stub", "ours"]
    rows = payload["rows"]
    assert [(r["label"], r["concurrency"]) for r in rows] == [("stub", 1), ("stub", 4), ("ours", 1), ("ours", 4)]
    assert [(r["completed"], r["failed"]) for r in rows] == [(4, 0), (4, 0), (3, 0), (3, 0)]
    for r in rows[:2]:  # the stub's injected delays, measured through the whole chain, within 15 %
        assert TTFT_S * 1e3 * 0.85 <= r["ttft_ms_p50"] <= TTFT_S * 1e3 * 1.15, r
        assert TPOT_S * 1e3 * 0.85 <= r["tpot_ms_p50"] <= TPOT_S * 1e3 * 1.15, r
        assert r["ttft_ms_p99"] >= r["ttft_ms_p50"] and r["tpot_ms_p99"] >= r["tpot_ms_p50"]
        assert r["goodput_requests_per_s"] == pytest.approx(r["requests_per_s"])  # every request met the SLO
        assert r["output_tokens_per_s"] == pytest.approx(4 * TOKENS / r["duration_s"])
    for r in rows[2:]:
        assert r["server_kind"] == "llminfer" and r["ttft_ms_p50"] > 0 and r["output_tokens_per_s"] > 0
    assert pl.read_csv(out_dir / "report.csv")["label"].to_list() == ["stub", "stub", "ours", "ours"]
    for name in ("dashboard", "ttft", "tpot", "itl", "throughput", "goodput"):
        size = _png_size((out_dir / f"report_{name}.png").read_bytes())
        assert size == ((1200, 900) if name == "dashboard" else (800, 550))

    # An SLO below the stub's TTFT: none of its requests is good, whatever the machine's load.
    strict = build_report([stub_dir / "serving.json"], slo_ttft_ms=TTFT_S * 1e3 / 2)
    assert [r["goodput_requests_per_s"] for r in strict.rows] == [0.0, 0.0]
    assert strict.labels == ["stub"]


# ---------------------------------------------------------------------------------------------- synthetic
def _artifact(loads, ttft=(100.0, 200.0, 300.0, 400.0), tpot=(10.0, 20.0, 30.0, 40.0), duration_s=2.0,
              kind="vllm", slo=(1000.0, 200.0), fingerprint="f00d"):
    reqs = [{"request_id": f"r{i}", "ok": True, "ttft_ms": a, "tpot_ms": b, "e2e_ms": a + 9 * b,
             "output_tokens": 10} for i, (a, b) in enumerate(zip(ttft, tpot))]
    summary = {"num_requests": 4, "completed": 4, "failed": 0, "duration_s": duration_s, "ttft_ms_p50": 250.0,
               "ttft_ms_p99": 397.0, "tpot_ms_p50": 25.0, "tpot_ms_p99": 39.7, "itl_ms_p50": 25.0,
               "itl_ms_p99": 40.0, "e2e_ms_p50": 475.0, "output_tokens_per_s": 20.0, "requests_per_s": 2.0,
               "goodput_requests_per_s": 2.0, "slo_ttft_ms": slo[0], "slo_tpot_ms": slo[1]}
    return {"schema_version": 2, "kind": "serving", "created": "2026-12-01T10:00:00+00:00",
            "server": {"base_url": "http://h:1", "model": "m", "kind": kind, "version": "1.0"},
            "workload": {"endpoint": "completions", "num_requests": 4, "prompt_len": [1, 2], "output_len": [10, 10],
                         "seed": 0, "fingerprint": fingerprint},
            "settings": {"endpoint": "completions", "slo_ttft_ms": slo[0], "slo_tpot_ms": slo[1], "points": loads},
            "environment": {}, "points": [{"load": ld, "summary": dict(summary), "requests": reqs} for ld in loads]}


def _write(tmp_path, name, payload):
    path = tmp_path / name
    path.write_text(payload if isinstance(payload, str) else json.dumps(payload))
    return path


RATES = [{"request_rate": r, "concurrency": 8} for r in (4.0, 1.0, None)]


def test_goodput_is_recomputed_under_the_given_slo(tmp_path):
    a = _write(tmp_path, "a.json", _artifact(RATES))
    b = _write(tmp_path, "b.json", _artifact(RATES[:2], kind="tgi"))
    report = build_report([a, b], slo_ttft_ms=250, slo_tpot_ms=25)
    assert report.axis == "request_rate" and report.labels == ["vllm", "tgi"] and report.notes == []
    assert [(r["label"], r["request_rate"]) for r in report.rows] == [
        ("vllm", 1.0), ("vllm", 4.0), ("vllm", None), ("tgi", 1.0), ("tgi", 4.0)]  # inf last
    # TTFT <= 250 and TPOT <= 25: requests 0 and 1 of 4, over 2 s.
    assert {r["goodput_requests_per_s"] for r in report.rows} == {1.0}
    assert {r["good_fraction"] for r in report.rows} == {0.5}
    assert build_report([a, b], slo_tpot_ms=15).rows[0]["goodput_requests_per_s"] == 0.5  # TPOT alone
    assert build_report([a]).rows[0]["goodput_requests_per_s"] == 2.0  # no SLO given: the artifact's figure
    assert "inf" in report.format_table().splitlines()[3]
    validate(report.to_json_dict(), "serving_report")


def test_a_one_point_artifact_of_the_python_api_is_read(tmp_path):
    point = ServingResult(requests=[{"ok": True, "ttft_ms": 5.0, "tpot_ms": 1.0, "e2e_ms": 9.0, "output_tokens": 3}],
                          summary={"num_requests": 1, "completed": 1, "failed": 0, "duration_s": 1.0,
                                   "ttft_ms_p50": 5.0, "tpot_ms_p50": 1.0, "e2e_ms_p50": 9.0,
                                   "output_tokens_per_s": 3.0, "goodput_requests_per_s": 1.0},
                          settings={"base_url": "http://x", "model": "m", "num_requests": 1, "request_rate": None,
                                    "concurrency": 2}, environment={})
    art = load_artifact(_write(tmp_path, "v1.json", point.to_json_dict()))
    assert art["points"][0]["load"] == {"request_rate": None, "concurrency": 2}
    assert art["server"]["base_url"] == "http://x"


def test_report_files_are_never_overwritten_silently(tmp_path):
    a = _write(tmp_path, "a.json", _artifact(RATES))
    report = build_report([a])
    first = report.save(tmp_path / "out", plots=False)
    assert [p.relative_to(tmp_path).as_posix() for p in first] == ["out/report.json", "out/report.csv"]
    second = report.save(tmp_path / "out", plots=False)
    assert second[0].parent.parent == tmp_path / "out" and second[0].parent.name[:8].isdigit()
    third = report.save(tmp_path / "out", plots=False)
    assert third[0].parent not in (second[0].parent, tmp_path / "out")  # a fresh folder each time
    assert report.save(tmp_path / "out", overwrite=True, plots=False) == first
    assert safe_paths([tmp_path / "nothing.json"], overwrite=False) == [tmp_path / "nothing.json"]


@pytest.mark.parametrize("case, message", [
    ("missing", "no such file"),
    ("not_json", "not valid JSON"),
    ("other_kind", "not a bench-serve artifact (kind 'benchmark'"),
    ("future", "schema version 9 is not supported"),
    ("no_points", "'points' must be a non-empty list"),
    ("no_summary_key", "summary lacks ttft_ms_p50"),
    ("both_axes", "incompatible artifacts: their load points vary both request rate and concurrency"),
    ("labels", "1 labels for 2 artifacts"),
    ("slos", "different SLOs"),
])
def test_bench_report_errors_are_one_line(case, message, tmp_path, capsys):
    good = _write(tmp_path, "good.json", _artifact(RATES))
    art = _artifact(RATES)
    extra: list[str] = []
    if case == "missing":
        path = tmp_path / "nope.json"
    elif case == "not_json":
        path = _write(tmp_path, "bad.json", "{not json")
    elif case == "other_kind":
        path = _write(tmp_path, "bad.json", {"schema_version": 1, "kind": "benchmark"})
    elif case == "future":
        path = _write(tmp_path, "bad.json", {**art, "schema_version": 9})
    elif case == "no_points":
        path = _write(tmp_path, "bad.json", {**art, "points": []})
    elif case == "no_summary_key":
        del art["points"][1]["summary"]["ttft_ms_p50"]
        path = _write(tmp_path, "bad.json", art)
    elif case == "both_axes":
        path = _write(tmp_path, "bad.json", _artifact([{"request_rate": None, "concurrency": c} for c in (1, 2)]))
    elif case == "labels":
        path, extra = good, ["--labels", "one"]
    else:
        path = _write(tmp_path, "bad.json", _artifact(RATES, slo=(500.0, 50.0)))
    code, out, err = _cli(["bench-report", str(good), str(path), *extra], capsys)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err
    with pytest.raises(ReportError, match="no artifacts"):
        build_report([])


def test_load_points_and_bench_serve_flag_errors(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert parse_request_rates("1,2.5,inf") == [1.0, 2.5, math.inf] and parse_concurrencies(None) == [None]
    assert load_points([1.0, 4.0], [8]) == [LoadPoint(1.0, 8), LoadPoint(4.0, 8)]
    assert LoadPoint().label() == "rate inf, concurrency -"
    for bad in ("0", "x", "-1,2", "nan"):
        with pytest.raises(ValueError):
            parse_request_rates(bad)
    with pytest.raises(ValueError, match="not both"):
        load_points([1.0, 2.0], [1, 2])
    # Refused before any request is sent (nothing listens on port 9).
    for args, message in ((["--request-rates", "1,2", "--concurrency", "1,2"], "not both"),
                          (["--concurrency", "0"], "concurrencies must be >= 1"),
                          (["--request-rate", "fast"], "comma-separated numbers or inf")):
        code, _, err = _cli(["bench-serve", "--base-url", "http://127.0.0.1:9", *args], capsys)
        assert code == 2 and message in err and err.count("\n") == 1, err
    code, _, err = _cli(["bench-serve", "--base-url", "http://127.0.0.1:9"], capsys)  # no /v1/models to ask
    assert code == 1 and "request to http://127.0.0.1:9 failed: ConnectError" in err and err.count("\n") == 1
    assert "is the server running?" in err
    Path("taken.json").write_text("{}")  # an explicit path that exists: refused before any request
    code, _, err = _cli(["bench-serve", "--base-url", "http://127.0.0.1:9", "--model", "m", "--json-out",
                         "taken.json"], capsys)
    assert code == 2 and "--json-out taken.json exists" in err and Path("taken.json").read_text() == "{}"
    code, out, err = _cli(["bench-serve", "--base-url", "http://127.0.0.1:9", "--model", "m", "--num-requests", "2",
                           "--concurrency", "1,2", "--json-out", "never.json"], capsys)
    assert code == 1 and err.startswith("error: all 4 requests failed; first error: ConnectError") and out == ""
    assert not Path("never.json").exists()
    with ServeProgress() as progress:  # stdout is pytest's capture, not a terminal
        assert progress.bar is None


def test_progress_shows_each_load_point():
    import io

    from rich.console import Console

    from llminfer.benchmark.serving import SweepProgress

    points = load_points([1.0, 4.0], [8])
    with ServeProgress(enabled=True, console=Console(file=io.StringIO(), force_terminal=True)) as progress:
        progress(SweepProgress(0, 2, points[0], 0, 5, 0, 0))
        progress(SweepProgress(0, 2, points[0], 3, 5, 1, 2))
        progress(SweepProgress(1, 2, points[1], 1, 5, 0, 4))
        tasks = progress.bar.tasks
        assert [(t.description, t.completed, t.total) for t in tasks] == [
            ("[1/2] rate 1/s, concurrency 8", 3, 5), ("[2/2] rate 4/s, concurrency 8", 1, 5)]
        assert tasks[0].fields["extra"] == "in flight 2, 1 failed" and tasks[1].fields["extra"] == "in flight 4"


@pytest.mark.parametrize("routes, expected", [
    ({"/v1/models": ({"data": [{"id": "q", "owned_by": "vllm"}]}, "uvicorn"), "/version": ({"version": "0.9.1"}, None)},
     ("vllm", "0.9.1", "uvicorn")),
    ({"/v1/models": ({"data": [{"id": "q", "owned_by": "q"}]}, None),
      "/info": ({"model_id": "q", "version": "3.3.0", "router": "text-generation-router"}, None)},
     ("tgi", "3.3.0", None)),
    ({"/v1/models": ({"data": [{"id": "q", "owned_by": "llamacpp"}]}, "llama.cpp"),
      "/props": ({"build_info": "b6000-abc"}, None)}, ("llama.cpp", "b6000-abc", "llama.cpp")),
    ({"/v1/models": ({"data": [{"id": "q", "owned_by": "someone"}]}, None)}, ("unknown", None, None)),
])
def test_probe_server_tells_kind_and_version(routes, expected):
    import anyio

    from llminfer.benchmark.serving_probe import probe_server

    def handler(request: httpx.Request) -> httpx.Response:
        body, server = routes.get(request.url.path, (None, None))
        if body is None:
            return httpx.Response(404, text="not found")
        return httpx.Response(200, json=body, headers={"server": server} if server else {})

    async def probe():
        async with httpx.AsyncClient(base_url="http://srv", transport=httpx.MockTransport(handler)) as client:
            return await probe_server(client, "http://srv", None)

    info = anyio.run(probe)
    assert (info["kind"], info["version"], info["server_header"]) == expected
    assert info["model"] == "q" and info["models"] == ["q"]


@pytest.mark.parametrize("body, shown", [
    (b'{"error": {"message": "The model `nosuch` does not exist.", "type": "invalid_request_error"}}',
     "The model `nosuch` does not exist."),
    (b'{"error": "llama.cpp style"}', "llama.cpp style"),
    (b"<html>Bad Gateway</html>", "<html>Bad Gateway</html>"),
    (b"\xff\xfe not utf-8", "\ufffd\ufffd not utf-8"),
])
def test_a_failed_request_shows_the_servers_message_not_bytes(body, shown):
    from llminfer.benchmark.serving import _error_text

    assert _error_text(body) == shown
