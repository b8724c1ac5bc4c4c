"""Error classes. Every failure a user can cause raises one of these, never a bare exception."""

from __future__ import annotations

import asyncio


class LLMInferError(Exception):
    """Base class of every error llminfer raises on purpose."""


class ConfigError(LLMInferError, ValueError):
    """An engine, cache, quantization or scheduler setting is unknown, out of range or inconsistent."""


class InvalidRequestError(LLMInferError, ValueError):
    """A request cannot be served as given (empty prompt, too long, bad sampling value).

    Attributes:
        param: the request field at fault, by its engine name (``"prompt"``, ``"temperature"``,
            ``"max_new_tokens"``, ...), or None when no single field is.
        code: a machine-readable reason: ``"invalid_value"`` (default), ``"context_length_exceeded"``
            (the prompt, or prompt plus output, does not fit), ``"unsupported_parameter"`` (a field this
            engine or backend does not take). The HTTP layer maps errors by type, ``param`` and ``code``,
            never by the message text.
    """

    default_code = "invalid_value"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code or self.default_code


class ModelLoadError(LLMInferError):
    """The model or tokenizer could not be found or loaded."""


class CapacityError(InvalidRequestError):
    """A request can never fit in the KV cache, even alone; it fails at once instead of stalling the queue."""

    default_code = "context_length_exceeded"

    def __init__(self, message: str, *, param: str | None = "prompt", code: str | None = None) -> None:
        super().__init__(message, param=param, code=code)


class RequestAbortedError(LLMInferError):
    """The request was cancelled (client disconnect, explicit abort, engine shutdown)."""


def one_line(exc: BaseException, secrets: tuple[str | None, ...] = (), limit: int = 300) -> str:
    """The first line of ``exc``'s message (its type name when empty), at most ``limit`` characters, with
    every non-empty string of ``secrets`` (an HF token, an API key) replaced by ``***``."""
    text = str(exc).strip()
    line = text.splitlines()[0][:limit] if text else type(exc).__name__
    for secret in secrets:
        if secret:
            line = line.replace(secret, "***")
    return line


class EngineError(LLMInferError):
    """The engine failed while serving a request (for example, the backend step raised)."""


class EngineClosedError(EngineError, RequestAbortedError):
    """The engine was closed: :meth:`InferenceEngine.close` ran (or is running), so it takes no more
    requests and cannot be started again (make a new engine). A request that close() cut short, or a
    stream still being read when the engine closes, ends with this error too (hence also a
    :class:`RequestAbortedError`)."""


def is_fatal(exc: BaseException) -> bool:
    """True for what must never be swallowed by a per-request error handler: interpreter exit, Ctrl-C,
    generator close and task cancellation. Everything else one request raises, even a ``BaseException``
    subclass such as the ``PanicException`` of a Rust-backed tokenizer, is that request's failure."""
    return isinstance(exc, (KeyboardInterrupt, SystemExit, GeneratorExit, asyncio.CancelledError))


class BackendUnavailableError(LLMInferError):
    """The chosen backend cannot run here (missing optional dependency or device)."""
