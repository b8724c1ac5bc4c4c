"""Error classes. Every failure a user can cause raises one of these, never a bare exception."""

from __future__ import annotations


class LLMInferError(Exception):
    """Base class of every error llminfer raises on purpose."""


class ConfigError(LLMInferError, ValueError):
    """An engine, cache, quantization or scheduler setting is unknown, out of range or inconsistent."""


class InvalidRequestError(LLMInferError, ValueError):
    """A request cannot be served as given (empty prompt, too long, bad sampling value)."""


class ModelLoadError(LLMInferError):
    """The model or tokenizer could not be found or loaded."""


class CapacityError(InvalidRequestError):
    """A request can never fit in the KV cache, even alone; it fails at once instead of stalling the queue."""


class RequestAbortedError(LLMInferError):
    """The request was cancelled (client disconnect, explicit abort, engine shutdown)."""


class EngineError(LLMInferError):
    """The engine failed while serving a request (for example, the backend step raised)."""


class BackendUnavailableError(LLMInferError):
    """The chosen backend cannot run here (missing optional dependency or device)."""
