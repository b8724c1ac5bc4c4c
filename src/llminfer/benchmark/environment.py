"""Environment metadata recorded in every benchmark artifact."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_revision() -> str | None:
    """Short git revision of the llminfer checkout, when it is one."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def environment() -> dict[str, Any]:
    """Python, torch, CUDA, device model, transformers and llminfer versions, git revision."""
    import transformers

    import llminfer

    cuda = torch.cuda.is_available()
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name() if cuda else None,
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "transformers": transformers.__version__,
        "llminfer": llminfer.__version__,
        "git_revision": git_revision(),
        "cpu_dtype": cpu_dtype_facts(),
    }


def cpu_dtype_facts() -> dict[str, Any]:
    """The CPU's ISA level, half-precision flags and oneDNN support, and what ``dtype="auto"`` picks for a
    bf16 checkpoint on CPU and why (:func:`llminfer.backends.loading.resolve_dtype`)."""
    from llminfer.backends.loading import cpu_half_support, resolve_dtype
    from llminfer.config import EngineConfig

    class _HalfCheckpoint:
        dtype = "bfloat16"

    dtype, reason = resolve_dtype(EngineConfig(), _HalfCheckpoint(), torch.device("cpu"))
    return {**cpu_half_support(), "auto_for_bf16_checkpoint": str(dtype).replace("torch.", ""),
            "auto_reason": reason}


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far, in bytes (``getrusage``; Linux reports KiB).

    Raises:
        ImportError: no ``resource`` module (Windows).
    """
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def peak_memory_bytes(device: torch.device | str | None = None) -> dict[str, int | None]:
    """Peak resident memory of this process (bytes, :func:`peak_rss_bytes`) and, on CUDA, peak
    allocated device memory."""
    rss = peak_rss_bytes()
    dev = None
    if device is not None and torch.device(device).type == "cuda":
        dev = int(torch.cuda.max_memory_allocated(device))
    return {"peak_rss_bytes": rss, "peak_device_bytes": dev}
