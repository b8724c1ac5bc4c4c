"""The CLI as a user runs it: a subprocess, the built-in model, one clear error line on bad input."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest


def llminfer(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "llminfer", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_run_default_model():
    p = llminfer("run", "Hello", "--max-new-tokens", "8")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.strip().splitlines()
    assert "TTFT" in lines[-1] and "completion 8 tok" in lines[-1]
    assert re.search(r"\| finish (length|stop)\]$", lines[-1]), lines[-1]


def test_run_json_and_stream_agree():
    r = llminfer("run", "Hello", "-n", "12", "--json")
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    s = llminfer("stream", "Hello", "-n", "12")
    assert s.returncode == 0, s.stderr
    text = result["generated_text"].replace("\r\n", "\n").replace("\r", "\n")  # text-mode newlines
    assert s.stdout.startswith(text)


def test_info_reports_model_kv_and_step_budget():
    p = llminfer("info", "--json", "--max-num-batched-tokens", "64", "--long-prefill-token-threshold", "16")
    assert p.returncode == 0, p.stderr
    facts = json.loads(p.stdout)
    for key in ("python", "torch", "transformers", "device", "architecture", "parameters", "weight_bytes",
                "kv_blocks", "kv_tokens"):
        assert key in facts
    assert facts["architecture"] == "Qwen2ForCausalLM"
    assert (facts["max_num_batched_tokens"], facts["long_prefill_token_threshold"]) == (64, 16)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["run", "x", "--model", "/definitely/not/here"], "does not exist"),
        (["run", "x", "--temp", "-1"], "temperature"),
        (["run", "x", "--max-new-tokens", "abc"], "max-new-tokens"),
        (["run", "x", "--max-new-tokens", "0"], "max_new_tokens"),
        (["run", "x", "--dtype", "int3"], "dtype"),
        (["run", "x", "--quant", "int3-wo"], "--quant: unknown mode 'int3-wo'; choose one of auto, none, nf4"),
        (["run", "x", "--tp-size", "2"], "vLLM"),
        (["run", "x", "--bogus-flag"], "bogus"),
        (["run", ""], "empty"),
    ],
)
def test_bad_input_is_one_line_and_nonzero(args, needle):
    p = llminfer(*args)
    assert p.returncode != 0
    err = p.stderr.strip().splitlines()
    assert len(err) == 1, p.stderr
    assert err[0].startswith("error:") and needle in err[0]
    assert "Traceback" not in p.stderr and "Value error" not in p.stderr
