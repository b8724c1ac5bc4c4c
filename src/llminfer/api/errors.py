"""OpenAI error objects: one exception class (:class:`APIError`), the mapping from llminfer errors (by type,
``param`` and ``code``: :func:`from_engine_error`) and Litestar errors, the exception handlers, and the
error responses of the OpenAPI document.

Every error the server returns has the OpenAI shape ``{"error": {"message", "type", "param", "code"}}``.
Bad input is always a 4xx naming the offending ``param`` where there is one; only a failure inside the
server is a 500 (``type: "server_error"``).
"""

from __future__ import annotations

import re
from typing import Any

import msgspec
import structlog
from litestar import Request, Response
from litestar.exceptions import (
    ClientException,
    HTTPException,
    MethodNotAllowedException,
    NotAuthorizedException,
    NotFoundException,
    ValidationException,
)
from litestar.openapi import ResponseSpec

from llminfer.api.request_info import request_info
from llminfer.errors import InvalidRequestError, LLMInferError, RequestAbortedError

log = structlog.get_logger("llminfer.api")

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"


class ErrorDetail(msgspec.Struct):
    """The inner object of an OpenAI error response."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(msgspec.Struct):
    """``{"error": {...}}``: what every failed request gets back."""

    error: ErrorDetail


class APIError(Exception):
    """An error to send to the client as an OpenAI error object.

    Args:
        status: HTTP status code.
        message: human-readable explanation.
        type: OpenAI error type (``invalid_request_error``, ``server_error``, ...).
        param: the request field at fault, if any (``"messages[0].content"``).
        code: machine-readable code (``context_length_exceeded``, ``model_not_found``, ...).
        headers: extra response headers (``Retry-After`` for 429).
    """

    def __init__(self, status: int, message: str, *, type: str = INVALID_REQUEST, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> ErrorResponse:
        """The response body."""
        return ErrorResponse(ErrorDetail(self.message, self.type, self.param, self.code))

    def to_response(self) -> Response:
        """A Litestar response carrying this error."""
        return Response(self.body(), status_code=self.status, headers=self.headers,
                        media_type="application/json")


OPENAPI_ERRORS = {
    400: ResponseSpec(ErrorResponse, description="Invalid request (the `param` names the field)."),
    401: ResponseSpec(ErrorResponse, description="Missing or wrong API key."),
    404: ResponseSpec(ErrorResponse, description="Unknown model."),
    429: ResponseSpec(ErrorResponse, description="Queue full; retry after `Retry-After` seconds."),
    500: ResponseSpec(ErrorResponse, description="Internal error."),
}
"""The error responses of the ``/v1`` routes, for the OpenAPI document."""


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 ``invalid_request_error``."""
    return APIError(400, message, param=param, code=code)


# Engine field names that differ from the OpenAI request field that sets them ("prompt" is the
# ``prompt_param`` of the call: "messages" for chat).
_ENGINE_TO_API_PARAM = {
    "max_new_tokens": "max_tokens",
    "stop_sequences": "stop",
    "min_new_tokens": "min_tokens",
}
UNSUPPORTED_PARAMETER = "unsupported_parameter"


def api_param(engine_param: str | None, prompt_param: str = "prompt") -> str | None:
    """The OpenAI request field for an engine field name (``None`` stays ``None``)."""
    if engine_param == "prompt":
        return prompt_param
    if engine_param is None:
        return None
    return _ENGINE_TO_API_PARAM.get(engine_param, engine_param)


def api_message(text: str) -> str:
    """An engine message in the API's words: engine field names (``max_new_tokens``) become the request
    fields that set them (``max_tokens``)."""
    for engine_name, api_name in _ENGINE_TO_API_PARAM.items():
        text = re.sub(rf"\b{engine_name}\b", api_name, text)
    return text


def from_engine_error(exc: LLMInferError, *, prompt_param: str = "prompt") -> APIError:
    """Map an llminfer exception to the error the client gets, by its type and fields, never its text.

    ``InvalidRequestError`` (``CapacityError`` included) is a 400 whose ``param`` is the OpenAI name of
    ``exc.param`` (``prompt_param`` for the prompt) and whose ``code`` is ``exc.code``; a shutdown abort
    (``RequestAbortedError``) is a 503; anything else the engine raises is a 500.
    """
    if isinstance(exc, InvalidRequestError):
        param = api_param(exc.param, prompt_param)
        if exc.code == UNSUPPORTED_PARAMETER:
            return bad_request(f"'{param}' is not supported by this server's engine", param, exc.code)
        return bad_request(api_message(str(exc)), param, exc.code)
    if isinstance(exc, RequestAbortedError):
        return APIError(503, f"the request was aborted: {exc}", type=SERVER_ERROR, code="aborted")
    return APIError(500, f"the engine failed: {exc}", type=SERVER_ERROR)


_DECODE_WORDS = ("json", "truncated", "malformed", "decode", "$", "expected", "invalid", "number", "utf-8")


def _validation_param(key: str | None) -> str | None:
    if not key or key == "data":
        return None
    return key


def http_exception_to_api_error(exc: HTTPException) -> APIError:
    """Map Litestar's own exceptions (body validation, malformed JSON, 404/405/401) to OpenAI errors."""
    if isinstance(exc, ValidationException):
        extra = exc.extra if isinstance(exc.extra, list) else []
        first = extra[0] if extra and isinstance(extra[0], dict) else {}
        param = _validation_param(first.get("key"))
        detail = str(first.get("message") or exc.detail)
        if param is None:
            if detail in ("'data'", "data"):
                detail = "the request body is missing or is not a JSON object"
            return bad_request(f"Invalid request body: {detail}", None, "invalid_body")
        if detail.startswith("Object missing required field"):
            return bad_request(f"Missing required parameter: {detail.split('`')[1] if '`' in detail else param}",
                               param, "missing_required_parameter")
        return bad_request(f"Invalid value for '{param}': {detail}", param, "invalid_value")
    if isinstance(exc, NotAuthorizedException):
        return APIError(401, str(exc.detail), code="invalid_api_key")
    if isinstance(exc, NotFoundException):
        return APIError(404, f"not found: {exc.detail}", code="not_found")
    if isinstance(exc, MethodNotAllowedException):
        return APIError(405, "method not allowed", code="method_not_allowed", headers=dict(exc.headers or {}))
    if isinstance(exc, ClientException):
        detail = str(exc.detail)
        if exc.status_code == 400 and any(w in detail.lower() for w in _DECODE_WORDS):
            return bad_request(f"We could not parse the JSON body of your request: {detail}", None, "invalid_json")
        code = "request_too_large" if exc.status_code == 413 else "bad_request"  # 413: Litestar's 10 MB body limit
        return APIError(exc.status_code, detail, code=code, headers=dict(exc.headers or {}))
    status = exc.status_code
    typ = SERVER_ERROR if status >= 500 else INVALID_REQUEST
    return APIError(status, str(exc.detail), type=typ, headers=dict(exc.headers or {}))


def _note(request: Request, error: APIError) -> None:
    info = request_info(request.scope)
    info.error = error.message if error.status < 500 else error.message[:200]
    info.error_code = error.code


def handle_api_error(request: Request, exc: APIError) -> Response:
    """Litestar exception handler for :class:`APIError`."""
    _note(request, exc)
    metrics = getattr(request.app.state, "llminfer_metrics", None)
    if metrics is not None and 400 <= exc.status < 500:
        metrics.rejected(exc)
    return exc.to_response()


def handle_http_exception(request: Request, exc: HTTPException) -> Response:
    """Litestar exception handler for its own HTTP exceptions. Litestar's 500 for a body cut short (the
    client disconnected while it was being read) is logged and counted as a client disconnect (499)."""
    info = request_info(request.scope)
    if info.disconnected and exc.status_code >= 500:
        info.status_override = 499
        metrics = getattr(request.app.state, "llminfer_metrics", None)
        if metrics is not None:
            metrics.client_disconnected()
        return Response(b"", status_code=499)
    return handle_api_error(request, http_exception_to_api_error(exc))


def handle_recursion_error(request: Request, exc: RecursionError) -> Response:
    """A body nested deeper than the JSON decoder (or the validator) can follow is the client's fault: a
    400, and no traceback in the log."""
    return handle_api_error(request, bad_request("The JSON body is nested too deeply.", None, "invalid_json"))


def handle_llminfer_error(request: Request, exc: LLMInferError) -> Response:
    """Litestar exception handler for llminfer errors that escaped the endpoint's own mapping."""
    error = from_engine_error(exc)
    if error.status >= 500:
        log.error("engine error", error=repr(exc))
    return handle_api_error(request, error)


def handle_internal_error(request: Request, exc: Exception) -> Response:
    """Last resort: a bug. The client gets a 500 error object; the traceback goes to the log."""
    log.exception("internal error", path=request.url.path, error=repr(exc))
    return handle_api_error(request, APIError(500, f"internal server error ({type(exc).__name__})",
                                              type=SERVER_ERROR))


EXCEPTION_HANDLERS: dict[Any, Any] = {
    APIError: handle_api_error,
    HTTPException: handle_http_exception,
    LLMInferError: handle_llminfer_error,
    RecursionError: handle_recursion_error,
    Exception: handle_internal_error,
}
