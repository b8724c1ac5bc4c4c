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
from llminfer.pipeline import Pipeline
from llminfer.results import GenerationResult, GenerationStats, StreamChunk
from llminfer.sampling.params import SamplingParams
from llminfer.sampling.structured import StructuredOutput
from llminfer.tools import Tool, ToolCall

__version__ = "0.1.0"

__all__ = [
    "Backend",
    "BackendUnavailableError",
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
