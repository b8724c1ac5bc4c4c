"""llminfer: a compact, hackable LLM inference and benchmarking engine.

The public names below are loaded on first use (PEP 562 module ``__getattr__``): ``import llminfer`` and
the ``llminfer`` command line (whose ``--help`` must answer at once) do not pay for torch, transformers or
polars until a name that needs them is touched. ``from llminfer import InferenceEngine`` works as before.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from llminfer.logging import use_safe_default_output as _use_safe_default_output

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time these come from __getattr__
    from llminfer.benchmark import BackendComparison, Benchmarker
    from llminfer.chat import ChatResult
    from llminfer.config import Backend, CacheConfig, EngineConfig, QuantConfig, QuantMode, SchedulerConfig
    from llminfer.engine import InferenceEngine
    from llminfer.errors import (
        BackendUnavailableError,
        CapacityError,
        ConfigError,
        EngineClosedError,
        EngineError,
        InvalidRequestError,
        LLMInferError,
        ModelLoadError,
        RequestAbortedError,
    )
    from llminfer.kv.manager import KVCacheManager
    from llminfer.logging import configure_logging
    from llminfer.pipeline import Pipeline
    from llminfer.results import GenerationResult, GenerationStats, StreamChunk
    from llminfer.sampling.params import SamplingParams
    from llminfer.sampling.structured import StructuredOutput
    from llminfer.tools import Tool, ToolCall

_use_safe_default_output()

from llminfer.version import __version__  # noqa: E402 - after the output set-up above, like the rest

_LAZY = {
    "Backend": "llminfer.config", "CacheConfig": "llminfer.config", "EngineConfig": "llminfer.config",
    "QuantConfig": "llminfer.config", "QuantMode": "llminfer.config", "SchedulerConfig": "llminfer.config",
    "BackendComparison": "llminfer.benchmark", "Benchmarker": "llminfer.benchmark",
    "ChatResult": "llminfer.chat", "InferenceEngine": "llminfer.engine", "KVCacheManager": "llminfer.kv.manager",
    "Pipeline": "llminfer.pipeline", "GenerationResult": "llminfer.results", "GenerationStats": "llminfer.results",
    "StreamChunk": "llminfer.results", "SamplingParams": "llminfer.sampling.params",
    "StructuredOutput": "llminfer.sampling.structured", "Tool": "llminfer.tools", "ToolCall": "llminfer.tools",
    "configure_logging": "llminfer.logging",
    **{name: "llminfer.errors" for name in (
        "BackendUnavailableError", "CapacityError", "ConfigError", "EngineClosedError", "EngineError",
        "InvalidRequestError", "LLMInferError", "ModelLoadError", "RequestAbortedError")},
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'llminfer' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    "Backend",
    "BackendComparison",
    "BackendUnavailableError",
    "Benchmarker",
    "CacheConfig",
    "CapacityError",
    "ChatResult",
    "ConfigError",
    "EngineConfig",
    "EngineClosedError",
    "EngineError",
    "GenerationResult",
    "GenerationStats",
    "InferenceEngine",
    "InvalidRequestError",
    "KVCacheManager",
    "LLMInferError",
    "ModelLoadError",
    "Pipeline",
    "QuantConfig",
    "QuantMode",
    "RequestAbortedError",
    "SamplingParams",
    "StructuredOutput",
    "SchedulerConfig",
    "StreamChunk",
    "Tool",
    "ToolCall",
    "__version__",
    "configure_logging",
]
