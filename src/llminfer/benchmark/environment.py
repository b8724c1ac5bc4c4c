"""Environment metadata recorded in every benchmark artifact, and memory measurement per configuration.

Memory (:class:`MemoryProbe`): on CUDA, torch's peak allocated device memory, reset before each
configuration; on CPU, the process's resident-set high-water mark (Linux ``VmHWM``, reset before each
configuration through ``/proc/self/clear_refs``) minus a baseline taken before the engine was loaded, so
that each backend of a comparison reports its own memory and not what an earlier one left behind. Every
figure says which it is (:data:`MEMORY_KINDS`).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import platform
import re
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from llminfer.kernels.cpu_info import cpu_model

#: What ``peak_memory_mb`` measures (the artifacts' ``memory_kind``).
MEMORY_KINDS = {
    "cuda_peak_allocated": "peak device memory allocated by torch during the configuration (reset before it)",
    "cuda_device_used": "device memory in use on the whole device after the configuration (vLLM allocates "
                        "in its own worker processes, which torch's counters of this process do not see)",
    "rss_peak_minus_preload": "peak resident memory of the process during the configuration minus its "
                              "resident memory before this backend's engine was loaded",
    "rss_peak_minus_loaded": "peak resident memory of the process during the configuration minus its "
                             "resident memory when the benchmark started (the engine already loaded)",
    "rss_lifetime_peak": "peak resident memory of the process since it started (this system cannot reset "
                         "the high-water mark, so configurations are not separated)",
    "rss_workers": "resident memory of the engine's worker processes (vLLM on CPU: the model, the KV cache and "
                   "the steps live there), the sum of each child process's peak resident memory (VmHWM, its "
                   "whole life, loading included) or, where that cannot be read, its resident memory at the end",
}


def children_rss_bytes(pids: Sequence[int] | None = None) -> int | None:
    """Sum over ``pids`` (None: every child process of this one, recursively) and their own children of
    each one's peak resident memory (VmHWM from ``/proc/<pid>/status``), or its current resident memory where
    the peak cannot be read; None when psutil is missing or none of them runs."""
    try:
        import psutil
    except ImportError:
        return None
    if pids is None:
        procs = psutil.Process().children(recursive=True)
    else:
        procs = []
        for pid in pids:
            with contextlib.suppress(psutil.Error):
                proc = psutil.Process(pid)
                procs += [proc, *proc.children(recursive=True)]
    total, seen = 0, 0
    for child in {p.pid: p for p in procs}.values():
        with contextlib.suppress(psutil.Error):
            hwm = _status_kib("VmHWM", child.pid)
            total += hwm * 1024 if hwm is not None else child.memory_info().rss
            seen += 1
    return total if seen else None


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
    import torch
    import transformers

    from llminfer.version import __version__

    cuda = torch.cuda.is_available()
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name() if cuda else None,
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "transformers": transformers.__version__,
        "llminfer": __version__,
        "git_revision": git_revision(),
        "cpu_dtype": cpu_dtype_facts(),
    }


def cpu_dtype_facts() -> dict[str, Any]:
    """The CPU's ISA level, half-precision flags and oneDNN support, and what ``dtype="auto"`` picks for a
    bf16 checkpoint on CPU and why (:func:`llminfer.models.loading.resolve_dtype`)."""
    import torch

    from llminfer.config import EngineConfig
    from llminfer.models.loading import cpu_half_support, resolve_dtype

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


def peak_memory_bytes(device: Any = None) -> dict[str, int | None]:
    """Peak resident memory of this process (bytes, :func:`peak_rss_bytes`) and, on CUDA, peak
    allocated device memory."""
    import torch

    rss = peak_rss_bytes()
    dev = None
    if device is not None and torch.device(device).type == "cuda":
        dev = int(torch.cuda.max_memory_allocated(device))
    return {"peak_rss_bytes": rss, "peak_device_bytes": dev}


def _status_kib(field: str, pid: int | str = "self") -> int | None:
    """A ``kB`` field of ``/proc/<pid>/status`` (``VmRSS``, ``VmHWM``) in KiB, None where there is none."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    m = re.search(rf"^{field}:\s+(\d+)\s+kB", text, re.MULTILINE)
    return int(m.group(1)) if m else None


def current_rss_bytes() -> int | None:
    """Resident memory of this process now (bytes, Linux ``VmRSS``), None where it cannot be read."""
    kib = _status_kib("VmRSS")
    return None if kib is None else kib * 1024


def reset_peak_rss() -> bool:
    """Reset this process's resident-set high-water mark to its current resident memory (Linux >= 4.0:
    ``5`` written to ``/proc/self/clear_refs``, see proc(5)). Returns False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return _status_kib("VmHWM") is not None


def release_freed_memory() -> None:
    """Collect garbage and hand freed heap pages back to the OS (glibc ``malloc_trim``), so that a
    baseline taken next does not count memory an earlier engine freed but the allocator kept."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def preload_model_libraries() -> None:
    """Import what loading any model imports (llminfer's engine, transformers' modelling stack: about
    200 MiB resident), so that a baseline taken next does not charge those libraries to the first backend."""
    import transformers.modeling_utils  # noqa: F401

    import llminfer.engine  # noqa: F401


class MemoryProbe:
    """Memory of one benchmark configuration: :meth:`start` before its first run, :meth:`stop` after its last.

    Args:
        device: the engine's device (``"cpu"``, ``"cuda:0"``, a ``torch.device``).
        baseline_rss_bytes: resident memory before the engine was loaded (see :func:`current_rss_bytes`);
            None: the resident memory at :meth:`start` is the baseline (kind ``rss_peak_minus_loaded``).
        device_wide: the engine allocates in other processes (vLLM): on CUDA, measure the whole device's used
            memory instead of this process's torch allocations; on CPU, the resident memory of the engine's
            ``worker_pids`` (``rss_workers``, see :func:`children_rss_bytes`; every child process when None).
        worker_pids: the engine's own worker processes (vLLM's ``backend.worker_pids``).
    """

    def __init__(self, device: Any, baseline_rss_bytes: int | None = None, device_wide: bool = False,
                 worker_pids: Sequence[int] | None = None) -> None:
        import torch

        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.baseline_rss_bytes = baseline_rss_bytes
        self.device_wide = device_wide
        self.worker_pids = worker_pids
        self._start_rss: int | None = None
        self._resettable = False

    @property
    def cuda(self) -> bool:
        import torch

        return self.device.type == "cuda" and torch.cuda.is_available()

    def start(self) -> None:
        """Reset the peaks (device, and resident memory where the system allows it)."""
        import torch

        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        self._start_rss = current_rss_bytes()
        self._resettable = reset_peak_rss()

    def stop(self) -> dict[str, Any]:
        """The configuration's figures (MiB): ``peak_memory_mb`` of kind ``memory_kind`` (a key of
        :data:`MEMORY_KINDS`), ``peak_rss_mb`` (the process's resident peak during the configuration, or its
        lifetime peak where that cannot be reset), ``baseline_rss_mb`` and ``peak_device_mb`` (None off CUDA)."""
        import torch

        mib = 2**20
        device_mb = None
        if self.cuda:
            torch.cuda.synchronize(self.device)
            if self.device_wide:
                free, total = torch.cuda.mem_get_info(self.device)
                device_mb = (total - free) / mib
            else:
                device_mb = torch.cuda.max_memory_allocated(self.device) / mib
        hwm = _status_kib("VmHWM") if self._resettable else None
        peak_rss = hwm * 1024 if hwm is not None else peak_rss_bytes()
        baseline = self.baseline_rss_bytes if self.baseline_rss_bytes is not None else self._start_rss
        if self.cuda:
            kind, peak = ("cuda_device_used" if self.device_wide else "cuda_peak_allocated"), device_mb
        elif self.device_wide and (workers := children_rss_bytes(self.worker_pids)) is not None:
            kind, peak = "rss_workers", workers / mib
        elif hwm is not None and baseline is not None:
            kind = "rss_peak_minus_preload" if self.baseline_rss_bytes is not None else "rss_peak_minus_loaded"
            peak = max(peak_rss - baseline, 0) / mib
        else:
            kind, peak = "rss_lifetime_peak", peak_rss / mib
        return {"memory_kind": kind, "peak_memory_mb": peak, "peak_rss_mb": peak_rss / mib,
                "baseline_rss_mb": None if baseline is None else baseline / mib, "peak_device_mb": device_mb}


def cpu_jiffies() -> dict[str, int] | None:
    """The machine's CPU time so far from the aggregate ``cpu`` line of ``/proc/stat`` (all CPUs, in clock
    ticks): ``idle`` (idle + iowait), ``steal`` (time a hypervisor ran something else while this VM's vCPUs
    wanted to run, see proc(5)) and ``total``. None where it cannot be read (not Linux)."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    if len(fields) < 4:
        return None
    return {"idle": fields[3] + (fields[4] if len(fields) > 4 else 0),
            "steal": fields[7] if len(fields) > 7 else 0, "total": sum(fields[:8])}


class StealMeter:
    """The share of CPU time stolen by the hypervisor since the meter was made (or last :meth:`restart`).

    On a VM the host may deschedule a vCPU while it has work; a decode step with one parallel region per
    layer then waits at every region for the stalled thread, so a few percent of steal can slow a step by
    far more than that. Benchmarks record it next to their figures, so a slow run can be told from a slow
    engine.
    """

    def __init__(self) -> None:
        self._start = cpu_jiffies()

    def restart(self) -> None:
        """Measure from now on (one read of ``/proc/stat``)."""
        self._start = cpu_jiffies()

    def pct(self) -> float | None:
        """Stolen share of all CPU time since the start, in percent; None where ``/proc/stat`` is unreadable
        or no time has passed."""
        now = cpu_jiffies()
        if self._start is None or now is None or now["total"] <= self._start["total"]:
            return None
        return 100.0 * (now["steal"] - self._start["steal"]) / (now["total"] - self._start["total"])
