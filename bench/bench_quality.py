"""Quality on a trained model (results/quality.json): tool calls, JSON Schema answers and an lm-eval
multiple-choice task, all through llminfer's HTTP API on a live loopback server (fp32, CPU, greedy).

- tool calls: the 5 questions of tests/data/quality/tool_calls.json (3 tools) under ``tool_choice`` auto,
  required and named; a call is right when it names the expected tool with the expected arguments
  (``tests/quality_checks.py``: by content, not only by schema);
- structured output: the 10 countries of tests/data/quality/capitals.json under a ``{"country", "capital"}``
  JSON Schema: valid (complete, schema-conforming), right country, right capital;
- log-likelihood scoring: lm-eval's ``local-completions`` over tests/data/lm_eval/llminfer_trained_mc.yaml (32
  easy three-way questions written for llminfer; chance is 1/3), scored through ``/v1/completions`` (echo,
  max_tokens 0). tests/test_lm_eval.py checks those log-likelihoods against transformers' own.

    python bench/bench_quality.py [--model NAME] [--quick]     # --quick: skip lm-eval
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from common import TRAINED_MODEL, environment, parse_args, resolve_trained, save, skip_payload

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS))


def lm_eval_accuracy(url: str, model: str, tokenizer) -> dict:
    """lm-eval's results for the local trained-model task against ``url`` (None values where lm_eval is
    not installed)."""
    exe = shutil.which("lm_eval") or shutil.which("lm_eval", path=str(Path(sys.executable).parent))
    if exe is None:
        print("SKIP: lm-eval: lm_eval is not installed (pip install 'llminfer[dev]')")
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(Path(tmp) / "tokenizer")
        args = (f"model={model},base_url={url}/v1/completions,tokenizer_backend=huggingface,"
                f"tokenizer={Path(tmp) / 'tokenizer'},num_concurrent=2,max_retries=1")
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        subprocess.run([exe, "run", "--model", "local-completions", "--model_args", args, "--tasks",
                        "llminfer_trained_mc", "--include_path", ".", "--output_path", str(Path(tmp) / "out")],
                       cwd=TESTS / "data" / "lm_eval", env=env, check=True, capture_output=True)
        (results,) = (Path(tmp) / "out").rglob("results_*.json")
        return json.loads(results.read_text())["results"]["llminfer_trained_mc"]


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=TRAINED_MODEL, help="the trained model (folder, .gguf, built-in name)")
    args = parse_args(ap, {})
    import openai
    from quality_checks import capital_results, tool_call_results

    from llminfer import EngineConfig, InferenceEngine
    from llminfer.api import create_app, serve_in_thread
    from llminfer.logging import configure_logging

    configure_logging("warning")
    load_before = os.getloadavg()
    try:
        path = resolve_trained(args.model)
    except (FileNotFoundError, OSError) as exc:
        return skip_payload("quality", str(exc))
    engine = InferenceEngine(EngineConfig(model_name=str(path), dtype="float32", device="cpu", max_batch_size=8,
                                          batch_timeout_ms=1))
    with serve_in_thread(create_app(engine)) as url, openai.OpenAI(base_url=url + "/v1", api_key="unused",
                                                                 max_retries=0, timeout=600) as client:
        served = engine.cfg.served_model_name or str(path)
        tools = tool_call_results(client, served)
        capitals = capital_results(client, served)
        lm = {} if args.quick else lm_eval_accuracy(url, served, engine.tokenizer)
    engine.close()
    tool_rates = {mode: sum(r["right"] for r in rows) / len(rows) for mode, rows in tools.items()}
    calls_made = {mode: sum(bool(r["calls"]) for r in rows) / len(rows) for mode, rows in tools.items()}
    cap = {k: sum(r[k] for r in capitals) / len(capitals) for k in ("valid", "country_right", "capital_right")}
    payload = {
        "benchmark": "quality_trained", "model": args.model, "tool_calls_right": tool_rates,
        "tool_calls_made": calls_made, "tool_calls": tools, "json_schema": cap, "json_schema_answers": capitals,
        "lm_eval": {k: v for k, v in lm.items() if k.startswith("acc")}, "lm_eval_chance": 1 / 3,
        "load_average_before": load_before, "load_average_after": os.getloadavg(), "environment": environment(),
    }
    for mode in tools:
        print(f"[quality] tool_choice {mode:8s}: {tool_rates[mode]:.0%} right, a call made for "
              f"{calls_made[mode]:.0%} of {len(tools[mode])} questions")
    print(f"[quality] JSON Schema capitals: {cap['valid']:.0%} valid, {cap['country_right']:.0%} right country, "
          f"{cap['capital_right']:.0%} right capital")
    if lm:
        print(f"[quality] lm-eval local multiple choice: acc {lm['acc,none']:.1%}, acc_norm {lm['acc_norm,none']:.1%} "
              "(chance 33.3%)")
    print(f"-> {save('quality', payload)}")
    return payload


if __name__ == "__main__":
    main()
