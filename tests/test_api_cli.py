"""``llminfer serve`` as a user runs it: a subprocess on a loopback port, then Ctrl-C."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _llminfer() -> list[str]:
    return [sys.executable, "-c", "from llminfer.cli import main; main()"]


def test_serve_command_serves_and_stops_on_ctrl_c():
    port = _free_port()
    cmd = [*_llminfer(), "serve", "--port", str(port), "--served-model-name", "tiny", "--api-key", "k",
           "--max-batch-size", "4", "--batch-timeout-ms", "1", "--max-queue-size", "8", "--log-level", "info"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            try:
                if httpx.get(base + "/healthz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.1)
        headers = {"Authorization": "Bearer k", "x-request-id": "cli-test-1"}
        r = httpx.post(base + "/v1/chat/completions", headers=headers, timeout=60,
                       json={"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4})
        assert r.status_code == 200, r.text
        assert r.json()["model"] == "tiny" and r.headers["x-request-id"] == "cli-test-1"
        assert httpx.get(base + "/v1/models", timeout=10).status_code == 401
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    # One structured line for the request, with its id, status and token counts.
    line = next(ln for ln in out.splitlines() if "request_id=cli-test-1" in ln)
    assert "status=200" in line and "completion_tokens=4" in line and "latency_ms=" in line


def test_serve_command_reports_bad_settings_on_one_line():
    proc = subprocess.run([*_llminfer(), "serve", "--backend", "vllm", "--port", "0"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip().startswith("error:") and "vllm" in proc.stderr.lower()
    assert len(proc.stderr.strip().splitlines()) == 1
