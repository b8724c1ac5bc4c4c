"""Every example runs as written on the built-in model (small sizes), and both notebooks execute headless."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def run_example(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    p = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=ENV,
                       cwd=EXAMPLES)
    assert p.returncode == 0, f"{args[0]} failed:\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}"
    return p


@pytest.mark.slow
def test_full_demo(tmp_path):
    out = run_example("full_demo.py", "--max-new-tokens", "4").stdout
    for section in ("eager run", "streaming", "batch", "prefix-cache reuse", "a small benchmark",
                    "quantized load", "backend comparison"):
        assert f"=== {section}" in out
    assert "cache hit: True" in out


@pytest.mark.slow
def test_advanced_features(tmp_path):
    out = run_example("advanced_features.py", "--out", str(tmp_path)).stdout
    assert "seed=42 twice gives the same tokens: True" in out
    assert "same greedy text as plain decoding: True" in out
    assert "adapter changes the output: True; unloading restores it: True" in out
    for name in ("benchmark.json", "benchmark.csv", "advanced_dashboard.png"):
        assert (tmp_path / name).exists()


def test_custom_pipeline(tmp_path):
    out = run_example("custom_pipeline.py", str(tmp_path / "out.jsonl")).stdout
    assert "deltas recorded" in out and (tmp_path / "out.jsonl").exists()


def test_benchmark_vs_vllm(tmp_path):
    out = run_example("benchmark_vs_vllm.py", "--batch-sizes", "1", "--max-new-tokens", "4",
                      "--artifacts-dir", str(tmp_path)).stdout
    assert "eager" in out and "vllm: skipped" in out


@pytest.mark.slow
def test_server_examples():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    server = subprocess.Popen([sys.executable, "run_server.py", "--port", str(port)], cwd=EXAMPLES, env=ENV,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        import httpx

        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        else:
            pytest.fail("run_server.py did not come up")
        out = run_example("openai_api_client.py", "--base-url", f"http://127.0.0.1:{port}/v1", timeout=300).stdout
        assert "chat:" in out
    finally:
        server.terminate()
        server.wait(30)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llminfer_quickstart.ipynb", "llminfer_serving.ipynb"])
def test_notebook_executes(name):
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(EXAMPLES / name, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), "stored outputs in the notebook"
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(EXAMPLES)}}).execute()
    printed = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "done" in printed or "server stopped" in printed
