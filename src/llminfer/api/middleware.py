"""What wraps every request: the request id, the structlog request-log middleware, the API-key guard, the
disconnect watcher, and :class:`EventStream` (the SSE response class).

The per-request record these share with the handlers and exception handlers is
:class:`~llminfer.api.request_info.RequestInfo`; :func:`server_state` reads the app's
:class:`~llminfer.api.state.ServerState`.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import anyio
import structlog
from litestar.connection import ASGIConnection
from litestar.datastructures import MutableScopeHeaders
from litestar.handlers.base import BaseRouteHandler
from litestar.response import Stream
from litestar.types import ASGIApp, Message, Receive, Scope, Send

from llminfer.api.errors import APIError
from llminfer.api.request_info import request_info

if TYPE_CHECKING:
    from llminfer.api.state import ServerState

log = structlog.get_logger("llminfer.api")

STATE_KEY = "llminfer"  #: where ``app.state`` holds the :class:`~llminfer.api.state.ServerState`


def server_state(connection: ASGIConnection) -> ServerState:
    """The app's :class:`~llminfer.api.state.ServerState`."""
    return connection.app.state[STATE_KEY]  # type: ignore[no-any-return]


def request_id_of(scope: Scope) -> str:
    """The request's id: the client's ``x-request-id`` when it is a sane token, else a new one."""
    return request_info(scope).request_id


def request_log_middleware(app: ASGIApp) -> ASGIApp:
    """One structlog line per HTTP request (id, method, path, status, tokens, latency in ms), and the
    request's cleanup (closing an SSE stream) once the response is over."""

    async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        info = request_info(scope)
        t0 = time.perf_counter()
        status = 0

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        async def receive_wrapper() -> Message:
            message = await receive()
            if message["type"] == "http.disconnect" and status == 0:
                info.disconnected = True  # gone before any answer (during the body read, or while waiting)
            return message

        try:
            await app(scope, receive_wrapper, send_wrapper)
        finally:
            cleanup, info.cleanup = info.cleanup, None
            if cleanup is not None:
                with anyio.CancelScope(shield=True):
                    await cleanup()
            path = scope.get("path", "")
            fields: dict[str, Any] = {}
            outcome = info.outcome
            if outcome is not None:
                fields.update(prompt_tokens=info.prompt_tokens, completion_tokens=outcome.completion_tokens,
                              choices=info.choices,
                              finish_reason=",".join(sorted(set(outcome.finish_reasons.values()))) or None)
            for key in ("disconnected", "error", "error_code"):
                value = getattr(info, key)
                if value:
                    fields[key] = value
            level = log.info if path.startswith("/v1/") else log.debug
            level("request", request_id=info.request_id, method=scope.get("method"), path=path,
                  status=info.status_override if info.status_override is not None else status,
                  latency_ms=round((time.perf_counter() - t0) * 1e3, 1), **fields)

    return middleware


async def echo_request_id(message: Message, scope: Scope) -> None:
    """``before_send`` hook: the response carries the request's ``x-request-id``."""
    if message["type"] == "http.response.start":
        headers = MutableScopeHeaders.from_message(message)
        headers["x-request-id"] = request_id_of(scope)


def api_key_guard(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    """Route guard: with an API key configured, ``Authorization: Bearer <key>`` is required.

    Raises:
        APIError: 401 ``invalid_api_key``.
    """
    key = server_state(connection).api_key
    if key is None:
        return
    scheme, _, token = connection.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise APIError(401, "Incorrect or missing API key: send `Authorization: Bearer <key>`.",
                       code="invalid_api_key")


class EventStream(Stream):
    """A ``text/event-stream`` response (Litestar would otherwise apply the handler's JSON media type)."""

    def to_asgi_response(self, *args: Any, **kwargs: Any) -> Any:
        kwargs["media_type"] = "text/event-stream"
        return super().to_asgi_response(*args, **kwargs)


async def watch_disconnect(receive: Receive, work: Callable[[], Awaitable[Any]]) -> tuple[Any, bool]:
    """Run ``work`` and cancel it if the client disconnects. Returns (result, disconnected).

    Raises:
        Exception: whatever ``work`` raised.
    """
    result: Any = None
    error: Exception | None = None
    disconnected = False
    async with anyio.create_task_group() as tg:

        async def watch() -> None:
            nonlocal disconnected
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    disconnected = True
                    tg.cancel_scope.cancel()
                    return

        tg.start_soon(watch)
        try:
            result = await work()
        except Exception as exc:  # noqa: BLE001 - re-raised below, outside the task group
            error = exc
        tg.cancel_scope.cancel()
    if error is not None:
        raise error
    return result, disconnected
