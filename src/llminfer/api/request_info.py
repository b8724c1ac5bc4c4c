"""The per-request record: :class:`RequestInfo`, shared by handler, exception handler and request log.

One typed attrs object is kept in the ASGI scope's ``state`` under one key. The handler fills in what the
call did (prompt tokens, choices, outcome, the stream's cleanup), the exception handlers the error, and the
request-log middleware (:mod:`llminfer.api.middleware`) reads it all for its one log line. It is a leaf
module (no other ``llminfer.api`` import at run time), so errors and middleware can both use it.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Awaitable, Callable

import attrs
from litestar.types import Scope

_KEY = "llminfer.request"
_REQUEST_ID_RE = re.compile(r"[\x21-\x7e]{1,128}")


@attrs.define
class JobOutcome:
    """Per-call bookkeeping filled while the job runs (read by the request log line)."""

    completion_tokens: int = 0
    cached_tokens: dict[int, int] = attrs.field(factory=dict)
    finish_reasons: dict[int, str] = attrs.field(factory=dict)
    aborted: int = 0
    failed: bool = False



@attrs.define
class RequestInfo:
    """What the request log line of one HTTP request reports, and its pending cleanup.

    Attributes:
        request_id: the client's ``x-request-id`` when it is a sane token, else a new ``req-<hex>``.
        prompt_tokens: prompt tokens of the call (all prompts).
        choices: engine requests of the call (one per choice).
        outcome: the call's :class:`JobOutcome` once it runs.
        cleanup: closes a streamed response's iterators; run by the middleware when the response is over.
        status_override: the status to log instead of the one sent (499: the client went away).
        disconnected: the client left before the response was complete.
        error: the error message sent (cut to 200 characters for 5xx).
        error_code: the error's OpenAI ``code``.
    """

    request_id: str
    prompt_tokens: int | None = None
    choices: int | None = None
    outcome: JobOutcome | None = None
    cleanup: Callable[[], Awaitable[None]] | None = None
    status_override: int | None = None
    disconnected: bool = False
    error: str | None = None
    error_code: str | None = None


def _request_id(scope: Scope) -> str:
    for name, value in scope.get("headers", ()):
        if name == b"x-request-id":
            candidate = value.decode("latin-1").strip()
            if _REQUEST_ID_RE.fullmatch(candidate):
                return candidate
            break
    return f"req-{uuid.uuid4().hex}"


def request_info(scope: Scope) -> RequestInfo:
    """The request's :class:`RequestInfo`, created (with its request id) on first use."""
    state = scope.setdefault("state", {})
    info = state.get(_KEY)
    if info is None:
        info = state[_KEY] = RequestInfo(_request_id(scope))
    return info  # type: ignore[no-any-return]
