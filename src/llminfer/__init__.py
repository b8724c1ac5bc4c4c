"""llminfer: a compact, hackable LLM inference and benchmarking engine."""

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
from llminfer.logging import use_safe_default_output as _use_safe_default_output
from llminfer.pipeline import Pipeline
from llminfer.results import GenerationResult, GenerationStats, StreamChunk
from llminfer.sampling.params import SamplingParams
from llminfer.sampling.structured import StructuredOutput
from llminfer.tools import Tool, ToolCall

_use_safe_default_output()

__version__ = "0.1.0"

# Loaded on first use: the benchmark package imports polars, which a plain ``import llminfer`` should not pay.
_LAZY = {"Benchmarker": "llminfer.benchmark", "BackendComparison": "llminfer.benchmark"}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'llminfer' has no attribute {name!r}")


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
]
