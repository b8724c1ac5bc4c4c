"""lm-evaluation-harness (``lm_eval --model local-completions``) end to end against a live llminfer server:
a multiple-choice (loglikelihood) task and a ``generate_until`` task, from the local task files in
``tests/data/lm_eval`` (no dataset download, no hub: the tokenizer is the served model's, saved to a
folder). lm-eval's numbers must equal llminfer's own scoring of the same tokens and its own greedy output."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from llminfer import EngineConfig, InferenceEngine
from llminfer.api import create_app, serve_in_thread

TASKS = Path(__file__).parent / "data" / "lm_eval"
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def _lm_eval() -> list[str]:
    exe = shutil.which("lm_eval") or shutil.which("lm_eval", path=str(Path(sys.executable).parent))
    assert exe is not None, "lm_eval is not installed (pip install 'llminfer[dev]')"
    return [exe]


def _samples(out: Path, task: str) -> list[dict]:
    (path,) = out.rglob(f"samples_{task}_*.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_lm_eval_local_completions(tmp_path):
    engine = InferenceEngine(EngineConfig(max_batch_size=8, batch_timeout_ms=1))
    with serve_in_thread(create_app(engine)) as url, httpx.Client(base_url=url + "/v1", timeout=120) as http:
        tok = engine.tokenizer
        tok.save_pretrained(tmp_path / "tokenizer")
        args = (f"model=llminfer/tiny-qwen2,base_url={url}/v1/completions,tokenizer_backend=huggingface,"
                f"tokenizer={tmp_path / 'tokenizer'},num_concurrent=2,max_retries=1")
        out = tmp_path / "out"
        cmd = [*_lm_eval(), "run", "--model", "local-completions", "--model_args", args,
               "--tasks", "llminfer_mc,llminfer_gen", "--include_path", ".", "--output_path", str(out),
               "--log_samples"]
        # data_files in the task YAMLs are relative to the folder lm_eval runs in
        proc = subprocess.run(cmd, cwd=TASKS, env={**os.environ, **OFFLINE}, capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
        (results_file,) = out.rglob("results_*.json")
        results = json.loads(results_file.read_text())["results"]
        assert 0.0 <= results["llminfer_mc"]["acc,none"] <= 1.0
        assert 0.0 <= results["llminfer_gen"]["exact_match,none"] <= 1.0

        # Loglikelihoods: lm-eval's sums equal llminfer's own scoring of the same context + continuation.
        mc = _samples(out, "llminfer_mc")
        assert len(mc) == 3
        for sample in mc[:2]:
            for i, resp in enumerate(sample["resps"]):
                context = sample["arguments"][f"gen_args_{i}"]["arg_0"]
                continuation = sample["arguments"][f"gen_args_{i}"]["arg_1"]
                whole = tok.encode(context + continuation)
                ctxlen = len(tok.encode(context))
                body = {"prompt": whole, "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0}
                lp = http.post("/completions", json=body).json()["choices"][0]["logprobs"]
                ll, greedy = resp[0]
                assert float(ll) == pytest.approx(sum(lp["token_logprobs"][ctxlen:]), abs=1e-3)
                assert greedy in ("True", "False", True, False)

        # generate_until: lm-eval's outputs are llminfer's greedy outputs, cut at the stop string.
        gen = _samples(out, "llminfer_gen")
        assert len(gen) == 2
        for sample in gen:
            prompt = sample["arguments"]["gen_args_0"]["arg_0"]
            body = {"prompt": tok.encode(prompt), "max_tokens": 8, "temperature": 0, "stop": ["\n"]}
            text = http.post("/completions", json=body).json()["choices"][0]["text"]
            assert sample["resps"][0][0] == text


def run_lm_eval(url: str, tokenizer_dir: Path, model: str, tasks: str, out: Path) -> dict:
    """``lm_eval run --model local-completions`` on the local tasks against ``url``; its ``results``."""
    args = (f"model={model},base_url={url}/v1/completions,tokenizer_backend=huggingface,"
            f"tokenizer={tokenizer_dir},num_concurrent=2,max_retries=1")
    cmd = [*_lm_eval(), "run", "--model", "local-completions", "--model_args", args, "--tasks", tasks,
           "--include_path", ".", "--output_path", str(out), "--log_samples"]
    proc = subprocess.run(cmd, cwd=TASKS, env={**os.environ, **OFFLINE}, capture_output=True, text=True,
                          timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (results_file,) = out.rglob("results_*.json")
    return json.loads(results_file.read_text())["results"]


@pytest.mark.slow
def test_lm_eval_trained_model(tmp_path, trained_model):
    """On trained weights: accuracy on the local 32-question set well above chance (1/3), and every
    log-likelihood lm-eval got from ``/v1/completions`` (echo, max_tokens 0) equal to transformers' own
    fp32 log-likelihood of the same tokens within 1e-3."""
    import torch
    from transformers import AutoModelForCausalLM

    engine = InferenceEngine(EngineConfig(model_name=trained_model, dtype="float32", device="cpu",
                                          max_batch_size=8, batch_timeout_ms=1))
    with serve_in_thread(create_app(engine)) as url:
        tok = engine.tokenizer
        tok.save_pretrained(tmp_path / "tokenizer")
        model_name = engine.cfg.served_model_name or trained_model
        results = run_lm_eval(url, tmp_path / "tokenizer", model_name, "llminfer_trained_mc", tmp_path / "out")
    engine.close()
    assert results["llminfer_trained_mc"]["acc,none"] >= 0.6  # chance: 1/3

    hf = AutoModelForCausalLM.from_pretrained(trained_model, dtype=torch.float32).eval()
    samples = _samples(tmp_path / "out", "llminfer_trained_mc")
    assert len(samples) == 32
    checked = 0
    for sample in samples[:8]:
        for i, resp in enumerate(sample["resps"]):
            context = sample["arguments"][f"gen_args_{i}"]["arg_0"]
            continuation = sample["arguments"][f"gen_args_{i}"]["arg_1"]
            ctxlen = len(tok.encode(context))
            whole = tok.encode(context + continuation)
            with torch.inference_mode():
                logp = hf(torch.tensor([whole])).logits[0].float().log_softmax(-1)
            want = sum(float(logp[j - 1, whole[j]]) for j in range(ctxlen, len(whole)))
            assert float(resp[0][0]) == pytest.approx(want, abs=1e-3)
            checked += 1
    assert checked == 24
