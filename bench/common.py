"""Shared pieces of the benchmark suites: the ~100M-parameter Qwen2-shaped random model, timing, output."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

from llminfer.models import build_random_model, default_cache_dir

RESULTS_DIR = Path(__file__).resolve().parent / "results"

# ~102M parameters, Qwen2 architecture (GQA 8:2, SwiGLU, RMSNorm, RoPE) with the real Qwen2 vocabulary
# (151,646 tokens) and tied embeddings like Qwen2-0.5B: 78M in the embedding, 24M in 8 layers.
BENCH_MODEL_SPEC = dict(architecture="qwen2", hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=2,
                        intermediate_size=1536, max_position_embeddings=4096, seed=0, dtype="bfloat16",
                        tie_word_embeddings=True)
BENCH_VOCAB = 151_000


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


def random_prompts(n: int, lengths: list[int] | int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    if isinstance(lengths, int):
        lengths = [lengths] * n
    return [torch.randint(10, vocab, (length,), generator=g).tolist() for length in lengths]


def timed(fn, *args, **kwargs) -> tuple[float, Any]:
    """Run ``fn`` and return (seconds, result); synchronises CUDA before reading the clock."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def environment() -> dict[str, Any]:
    import transformers

    import llminfer

    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).parent, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        rev = None
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "llminfer": llminfer.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "git_revision": rev,
    }


def peak_rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def save(name: str, payload: dict[str, Any]) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2, default=str))
    return path
