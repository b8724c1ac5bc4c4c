"""Shared pieces of the benchmark suites: the ~100M-parameter Qwen2-shaped random model, timing, output.

Environment metadata, random prompts and peak memory come from :mod:`llminfer.benchmark` (the figures in
``bench/results`` are measured the way ``llminfer bench`` measures them): :func:`environment`,
``random_prompts`` (:func:`llminfer.benchmark.runner.random_token_prompts`) and ``peak_rss_bytes``
(:func:`llminfer.benchmark.environment.peak_rss_bytes`) are re-exported here.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from llminfer.benchmark.environment import environment as llminfer_environment
from llminfer.benchmark.environment import peak_rss_bytes
from llminfer.benchmark.runner import random_token_prompts as random_prompts
from llminfer.models import build_random_model, default_cache_dir

__all__ = ["BENCH_DTYPE", "BENCH_MODEL_SPEC", "BENCH_TORCH_DTYPE", "BENCH_VOCAB", "RESULTS_DIR", "bench_model_path", "count_params", "environment",
           "median", "parse_args", "peak_rss_bytes", "random_prompts", "save", "timed"]

RESULTS_DIR = Path(__file__).resolve().parent / "results"

# ~102M parameters, Qwen2 architecture (GQA 8:2, SwiGLU, RMSNorm, RoPE) with the real Qwen2 vocabulary
# (151,646 tokens) and tied embeddings like Qwen2-0.5B: 78M in the embedding, 24M in 8 layers.
BENCH_MODEL_SPEC = dict(architecture="qwen2", hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=2,
                        intermediate_size=1536, max_position_embeddings=4096, seed=0, dtype="bfloat16",
                        tie_word_embeddings=True)
BENCH_VOCAB = 151_000


def _bench_dtype() -> str:
    """What ``dtype="auto"`` gives the (bf16) bench model on this machine, or ``LLMINFER_BENCH_DTYPE``.

    The suites measure what a user taking the defaults gets: bfloat16 where the CPU computes it natively
    (AVX-512 BF16, AMX) or on a GPU, float32 on an AVX2-only CPU, where emulated bf16 makes every batched
    step about 2.4x slower. Both sides of every ratio (llminfer and the HF baseline) run in this dtype.
    """
    forced = os.environ.get("LLMINFER_BENCH_DTYPE")
    if forced:
        return forced
    if torch.cuda.is_available():
        return "bfloat16"
    from llminfer.benchmark.environment import cpu_dtype_facts

    return cpu_dtype_facts()["auto_for_bf16_checkpoint"]


BENCH_DTYPE: str = _bench_dtype()
BENCH_TORCH_DTYPE: torch.dtype = getattr(torch, BENCH_DTYPE)


def bench_model_path() -> Path:
    """Build (once) and return the benchmark model folder under the llminfer cache."""
    dest = default_cache_dir() / "bench-qwen2-102m-v1"
    if not (dest / "config.json").exists():
        build_random_model(dest, **BENCH_MODEL_SPEC)
    return dest


def count_params(path: Path) -> int:
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    return sum(p.numel() for p in model.parameters())


def timed(fn, *args, **kwargs) -> tuple[float, Any]:
    """Run ``fn`` and return (seconds, result); synchronises CUDA before reading the clock."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def parse_args(ap: argparse.ArgumentParser, quick: dict[str, Any],
               argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse a suite's arguments with a ``--quick`` flag added: it switches the defaults to ``quick``
    (argparse destinations: values), a few repetitions of a small workload, so that ``run_all.py --quick``
    checks every suite end to end in minutes. Flags given explicitly still win. Quick figures show that a
    suite runs; they are not the measurements its targets are about."""
    ap.add_argument("--quick", action="store_true", help="a small workload: " + ", ".join(
        f"{k.replace('_', '-')}={v}" for k, v in quick.items()))
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--quick" in argv:
        ap.set_defaults(**quick)
    return ap.parse_args(argv)


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def environment() -> dict[str, Any]:
    """:func:`llminfer.benchmark.environment.environment`, plus ``device`` (the GPU's name, else the CPU
    model) as earlier bench results recorded it, and ``bench_dtype`` (:data:`BENCH_DTYPE`)."""
    env = llminfer_environment()
    return {**env, "device": env["gpu"] or env["cpu"] or "cpu", "bench_dtype": BENCH_DTYPE}


def save(name: str, payload: dict[str, Any]) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2, default=str))
    return path


def run_child(code: str, args: Sequence[str], env: dict[str, str], what: str) -> dict[str, Any]:
    """Run ``code`` in a fresh Python process (``python -c code *args`` with ``env``: a fresh OpenMP runtime
    and environment) and return the JSON it printed on its ``RESULT `` line.

    Raises:
        SystemExit: the child failed (the message names ``what`` and ends with its stderr).
    """
    import subprocess

    done = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{what} failed:\n{done.stderr[-2000:]}")
    line = next(ln for ln in done.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


#: The trained model of the quality benchmarks (``--model`` default of bench_quant.py, bench_speculative.py,
#: bench_quality.py): the built-in trained chat model, or what ``LLMINFER_BENCH_TRAINED_MODEL`` names (a
#: local folder or a .gguf file).
TRAINED_MODEL = os.environ.get("LLMINFER_BENCH_TRAINED_MODEL", "llminfer/smollm2-135m-instruct")


def skip_payload(name: str, reason: str) -> dict[str, Any]:
    """Print one ``SKIP:`` line and save ``results/<name>.json`` saying why the suite measured nothing."""
    print(f"SKIP: {name}: {reason}")
    payload = {"benchmark": name, "skipped": reason, "environment": environment()}
    save(name, payload)
    return payload


#: Four short passages written for llminfer's benchmarks (no third-party text): the summarise workload of
#: bench_speculative.py and the fixed text of bench_quant.py's teacher-forced agreement on a trained model.
ENGLISH_PASSAGES = [
    "The town library moved into the old railway station in 1994, after the last passenger train had left "
    "the valley. The waiting room became the reading room, the ticket office became the lending desk, and the "
    "goods shed was turned into a children's library with a model railway along one wall. Volunteers repaired "
    "the station clock, which had stopped at twenty past four decades earlier. Today the library holds about "
    "forty thousand books, runs a weekly chess club, and lends tools as well as novels. Its busiest day is "
    "Saturday, when the farmers' market sets up on the old platform and visitors come in out of the rain.",
    "Honeybees keep the temperature of their brood nest close to thirty-five degrees Celsius. In cold weather "
    "the workers cluster around the brood and shiver their flight muscles to make heat without moving their "
    "wings. In hot weather they fan their wings at the entrance to pull air through the hive, and they spread "
    "thin films of water over the comb so that it cools as it evaporates. A colony that cannot hold the brood "
    "at the right temperature raises bees that learn more slowly and live shorter lives. Beekeepers help by "
    "giving hives shade in summer and shelter from the wind in winter.",
    "The bridge across the estuary took six years to build. Engineers first sank two concrete towers into "
    "the riverbed, each resting on piles driven forty metres into the clay. Steel cables were then spun "
    "between the towers, one wire at a time, by a wheel that travelled back and forth across the water. The "
    "deck was lifted into place in sections from barges at high tide. When the bridge opened, the ferry that "
    "had crossed the estuary for a century made its last trip, and its captain was the first driver across "
    "the new road. The crossing that had taken forty minutes now took four.",
    "Sourdough bread rises without baker's yeast. The baker keeps a starter, a paste of flour and water in "
    "which wild yeasts and lactic acid bacteria live together. Each day part of the starter is thrown away "
    "and the rest is fed with fresh flour and water. To make a loaf, some starter is mixed into a dough that "
    "then rests for many hours, often overnight, while the yeasts make gas and the bacteria make the acids "
    "that give the bread its sour taste. The long rest also lets the flour's enzymes work, which is why many "
    "people find sourdough easier to digest than bread made quickly with baker's yeast.",
]


def resolve_trained(name: str) -> Path:
    """The local file or folder of a trained model named by ``--model``: a folder or .gguf path as given,
    else what llminfer resolves the name to (the built-in names).

    Raises:
        FileNotFoundError: nothing local of that name (the message says what was tried).
    """
    from llminfer import EngineConfig
    from llminfer.models.loading import resolve_model_path

    path = Path(name)
    if not path.exists():
        path = Path(resolve_model_path(EngineConfig(model_name=name)))
    if not path.exists():
        raise FileNotFoundError(f"{name} is no local folder or .gguf file, and llminfer resolves it to {path}, "
                                "which does not exist either")
    return path


def load_hf_model(path: Path, **kw: Any) -> Any:
    """``AutoModelForCausalLM.from_pretrained`` of a folder, or of a .gguf file (transformers dequantizes it)."""
    from transformers import AutoModelForCausalLM

    if path.suffix == ".gguf":
        return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, **kw).eval()
    return AutoModelForCausalLM.from_pretrained(str(path), **kw).eval()
