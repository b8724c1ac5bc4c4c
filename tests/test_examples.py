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


# benchmark_vs_vllm.py: tests/test_benchmark_stats.py::test_description_example_command runs it as a script.


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


# The notebooks, each with the line its last cell prints when every cell (and every assert in them) ran.
NOTEBOOKS = {
    "llminfer_smoke.ipynb": "smoke test passed",
    "llminfer_tour.ipynb": "tour complete: full_demo, advanced_features, custom_pipeline, server, benchmark_vs_vllm",
    "llminfer_quickstart.ipynb": "quickstart done",
    "llminfer_advanced.ipynb": "advanced done",
    "llminfer_serving.ipynb": "server stopped",
}


def test_notebooks_are_clean_and_generated():
    """Every notebook is what tools/make_notebooks.py writes: no stored outputs, and its flags (``RUN_*``,
    first code cell) default to False, so a plain run stays on the built-in model and the CPU."""
    import importlib.util
    import re

    import nbformat

    spec = importlib.util.spec_from_file_location("make_notebooks", EXAMPLES.parent / "tools" / "make_notebooks.py")
    make = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make)
    assert set(make.NOTEBOOKS) == set(NOTEBOOKS) == {p.name for p in EXAMPLES.glob("*.ipynb")}
    for name, cells in make.NOTEBOOKS.items():
        nb = nbformat.read(EXAMPLES / name, as_version=4)
        assert [(c.cell_type, c.source) for c in nb.cells] == \
            [("markdown" if kind == "md" else "code", src) for kind, src in cells], f"{name}: run tools/make_notebooks.py"
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert all(not c.get("outputs") and c.get("execution_count") is None for c in code), name
        flags = re.findall(r"^(RUN_\w+) = (\S+)", code[0].source, re.M)
        assert all(value == "False" for _, value in flags), (name, flags)
        assert all(f"if {flag}" in "".join(c.source for c in code) for flag, _ in flags), (name, flags)


@pytest.fixture(scope="module")
def kernel():
    """One kernel for every notebook: each starts with ``%reset -f`` (a clean namespace), so what the
    kernel keeps is the imported modules, which is what a second run of a notebook would find anyway."""
    from jupyter_client.manager import KernelManager

    km = KernelManager(kernel_name="python3")
    km.start_kernel(cwd=str(EXAMPLES), env=ENV)
    try:
        yield km
    finally:
        km.shutdown_kernel(now=True)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(NOTEBOOKS))
def test_notebook_executes(name, kernel):
    import nbformat
    from nbclient import NotebookClient
    from nbformat.v4 import new_code_cell

    nb = nbformat.read(EXAMPLES / name, as_version=4)
    nb.cells.insert(0, new_code_cell(f"%reset -f\nimport os\nos.chdir({str(EXAMPLES)!r})"))
    NotebookClient(nb, km=kernel, timeout=600, resources={"metadata": {"path": str(EXAMPLES)}}).execute()
    code = [c for c in nb.cells if c.cell_type == "code"]
    errors = [o for c in code for o in c.outputs if o.output_type == "error"]
    assert not errors, errors
    last = "".join(o.get("text", "") for o in code[-1].outputs if o.output_type == "stream")
    assert NOTEBOOKS[name] in last, last[-2000:]
