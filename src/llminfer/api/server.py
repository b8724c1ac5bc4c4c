"""Running the app with uvicorn: in the foreground (``llminfer serve``) or in a background thread (tests,
notebooks, examples), with the connection limits a public server needs.

:class:`ServerLimits` holds them: the request-read timeout (uvicorn has none: a connection that never
sends a byte, or trickles its headers, stays open until the process runs out of file descriptors; see
:func:`protocol_class`), the keep-alive idle timeout (uvicorn's ``timeout_keep_alive``), the concurrency
limit (answered with an OpenAI error object, not uvicorn's plain-text 503), the largest request head
(uvicorn's ``h11_max_incomplete_event_size``) and the shutdown grace period (see :class:`_Server`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import resource
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import h11
import structlog
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

log = structlog.get_logger("llminfer.api")


@attrs.frozen
class ServerLimits:
    """Connection limits and shutdown behaviour of the HTTP server.

    Attributes:
        read_timeout_s: seconds a client has to send a whole request (head and body), counted from the
            connection opening or from the first byte of a later request on a kept-alive connection; then
            the connection is closed (with a 408 error object when part of the request head had arrived; a
            half-sent body is the app's to log, as a client disconnect).
        keep_alive_timeout_s: seconds an idle kept-alive connection stays open between requests.
        limit_concurrency: HTTP requests handled at once (streams included); more get an immediate 503
            with ``Retry-After``. ``None``: no limit.
        max_header_bytes: the largest request head (request line and headers) in bytes; more is a 400.
        shutdown_grace_s: on SIGTERM/SIGINT, seconds in-flight requests get to finish; the streams still
            running then end with an error event and ``[DONE]``.
    """

    read_timeout_s: float = 30.0
    keep_alive_timeout_s: float = 5.0
    limit_concurrency: int | None = None
    max_header_bytes: int = 16 * 1024
    shutdown_grace_s: float = 10.0

    def __attrs_post_init__(self) -> None:
        for name in ("read_timeout_s", "keep_alive_timeout_s", "max_header_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.shutdown_grace_s < 0:
            raise ValueError(f"shutdown_grace_s must be >= 0, got {self.shutdown_grace_s!r}")
        if self.limit_concurrency is not None and self.limit_concurrency < 1:
            raise ValueError(f"limit_concurrency must be >= 1 or None, got {self.limit_concurrency!r}")


def _error_body(status: int, message: str, code: str) -> bytes:
    """An OpenAI error object (written here, below the app, where Litestar's handlers do not run)."""
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()


_READ_TIMEOUT_BODY = _error_body(408, "the request was not received in time", "request_timeout")
_READ_TIMEOUT_RESPONSE = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
                          b"content-length: %d\r\n\r\n%s" % (len(_READ_TIMEOUT_BODY), _READ_TIMEOUT_BODY))
_BUSY_BODY = _error_body(503, "the server is handling too many requests; retry shortly", "too_many_requests")


def protocol_class(limits: ServerLimits, on_busy: Callable[[], None] | None = None) -> type[H11Protocol]:
    """uvicorn's h11 protocol with ``limits.read_timeout_s`` and ``limits.limit_concurrency``.

    uvicorn (0.54) arms its keep-alive timer only after a response and cancels it on any byte, so a
    connection that sends nothing, or sends a few bytes and stalls, is never closed. This subclass runs one
    deadline while a request is being read (from the connection opening, or from the first byte after an
    idle keep-alive wait, until the body's last byte) and closes the connection when it passes.

    The concurrency limit counts the requests being handled (from the start of the app's call to its end,
    streams included) across all connections of one server, except the probes and the metrics scrape
    (:data:`UNLIMITED_PATHS`), which must answer when the server is busiest. A request past it gets a 503
    error object with ``Retry-After`` once its body has been read (closing the connection with unread bytes
    would reset it, and the client would see a broken connection instead of the 503); ``on_busy`` is called
    for each.
    """
    timeout_s = limits.read_timeout_s
    limit = limits.limit_concurrency
    handling = [0]  # requests inside the app now, over every connection of the server

    class Protocol(H11Protocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._read_timer: asyncio.TimerHandle | None = None
            self._got_bytes = False
            if limit is not None:
                self.app = self._limited(self.app)

        def _limited(self, app: Any) -> Any:
            async def limited(scope: Any, receive: Any, send: Any) -> None:
                if scope.get("path") in UNLIMITED_PATHS:
                    await app(scope, receive, send)
                    return
                if handling[0] >= limit:
                    await _drain_body(receive)
                    await send({"type": "http.response.start", "status": 503, "headers": [
                        (b"content-type", b"application/json"), (b"retry-after", b"1"), (b"connection", b"close")]})
                    await send({"type": "http.response.body", "body": _BUSY_BODY})
                    if on_busy is not None:
                        on_busy()
                    return
                handling[0] += 1
                try:
                    await app(scope, receive, send)
                finally:
                    handling[0] -= 1

            return limited

        def _reading(self) -> bool:
            """A request is due or partly received (not: idle between requests, or being answered)."""
            if self.transport is None or self.transport.is_closing():
                return False
            cycle = self.cycle
            if cycle is None:
                return True
            if not cycle.response_complete:
                return cycle.more_body
            # uvicorn cancels its keep-alive timer on the first byte of the next request.
            return self.timeout_keep_alive_task is None

        def _update_read_timer(self) -> None:
            if self._reading():
                if self._read_timer is None:
                    self._read_timer = self.loop.call_later(timeout_s, self._read_timed_out)
            elif self._read_timer is not None:
                self._read_timer.cancel()
                self._read_timer = None

        def _read_timed_out(self) -> None:
            self._read_timer = None
            if not self._reading():
                return
            if self._got_bytes and (self.cycle is None or self.cycle.response_complete):
                # Part of a request head arrived and nothing was answered yet: say why before closing.
                self.transport.write(_READ_TIMEOUT_RESPONSE)
            if self.cycle is not None and not self.cycle.response_complete:
                log.info("request read timeout", client=self.client, timeout_s=timeout_s)
            with contextlib.suppress(h11.LocalProtocolError):
                self.conn.send(h11.ConnectionClosed())
            self.transport.close()  # the app, if it waits for the body, gets http.disconnect

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._update_read_timer()

        def data_received(self, data: bytes) -> None:
            self._got_bytes = True
            super().data_received(data)
            self._update_read_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._got_bytes = False
            self._update_read_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._read_timer is not None:
                self._read_timer.cancel()
                self._read_timer = None
            super().connection_lost(exc)

    return Protocol


UNLIMITED_PATHS = frozenset({"/health", "/healthz", "/metrics"})
"""Routes outside ``limit_concurrency``: liveness and readiness probes and Prometheus' scrape answer at once
and cheaply, and an orchestrator must not read a busy server as a dead one."""

_DRAIN_MAX_BYTES = 8 << 20


async def _drain_body(receive: Any) -> None:
    """Read a request's body (up to 8 MiB: a larger one is cut off with the connection) and drop it."""
    read = 0
    while read <= _DRAIN_MAX_BYTES:
        message = await receive()
        if message["type"] != "http.request":
            return  # http.disconnect
        read += len(message.get("body", b""))
        if not message.get("more_body", False):
            return


FORCED_EXIT_FLUSH_S = 0.2
"""After a forced quit, how long the ended requests get to write their last event (s)."""


class _Server(uvicorn.Server):
    """uvicorn's server with llminfer's shutdown: stop admitting (the app answers 503 and ``/healthz`` turns
    503), give in-flight requests ``shutdown_grace_s``, then end the remaining streams with an error event
    and ``[DONE]`` (the app's ``ServerState.end_streams``); uvicorn's own timeout is the last resort."""

    def __init__(self, config: uvicorn.Config, app: Any, grace_s: float,
                 on_listening: Callable[[], None] | None = None) -> None:
        super().__init__(config)
        self._grace_s = grace_s
        self._hooks = _shutdown_hooks(app)
        self._on_listening = on_listening

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        asyncio.get_running_loop().set_exception_handler(_loop_exception)
        await super().startup(sockets)
        if self.started and self._on_listening is not None:
            self._on_listening()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self._hooks is None:
            await super().shutdown(sockets)
            return
        self._hooks.begin_shutdown(self._grace_s)
        timer = asyncio.get_running_loop().call_later(self._grace_s, self._hooks.end_streams)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()
        if self.force_exit:
            # A second Ctrl-C: uvicorn stopped waiting for the requests. End them as the grace period's end
            # does (error event and [DONE]) and let them write that, instead of cutting them mid-chunk.
            self._hooks.end_streams()
            await asyncio.sleep(FORCED_EXIT_FLUSH_S)
            await self.lifespan.shutdown()  # uvicorn skips it when forced; left running, it is cancelled


def _loop_exception(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """Out of file descriptors, asyncio stops accepting for a second and logs a traceback each time: one
    line instead (the read and keep-alive timeouts free descriptors; the clients wait in the backlog). A
    retry that fires after shutdown closed the listening socket is dropped quietly."""
    exc = context.get("exception")
    if isinstance(exc, OSError) and "accept" in str(context.get("message", "")):
        now = time.monotonic()
        if now - _accept_warned[0] >= 10.0:  # asyncio reports it once per pending connection: say it rarely
            _accept_warned[0] = now
            log.warning("cannot accept connections", error=str(exc), hint="raise the open-files limit "
                        "(ulimit -n); idle connections close after --read-timeout-s / --keep-alive-timeout-s")
        return
    if isinstance(exc, ValueError) and "_start_serving" in repr(context.get("handle")):
        # The retry asyncio scheduled after such an accept failure fired after shutdown had closed the
        # listening socket (its descriptor is -1 now): nothing is left to accept on.
        log.debug("accept retry after the listening socket closed", error=str(exc))
        return
    loop.default_exception_handler(context)


_accept_warned = [-1e9]  #: when the last "cannot accept" warning was logged (time.monotonic(), s)


def _shutdown_hooks(app: Any) -> Any:
    """The app's ``ServerState`` when it is an llminfer app (it has ``begin_shutdown`` and ``end_streams``)."""
    from llminfer.api.middleware import STATE_KEY

    state = getattr(getattr(app, "state", None), "get", lambda _k: None)(STATE_KEY)
    return state if hasattr(state, "end_streams") else None


def uvicorn_config(app: Any, host: str = "127.0.0.1", port: int = 8000, log_level: str = "warning",
                   limits: ServerLimits | None = None) -> uvicorn.Config:
    """The uvicorn settings llminfer uses: lifespan on, no access log (the app logs one line per request),
    the h11 protocol with :func:`protocol_class`, and ``limits`` (default :class:`ServerLimits`)."""
    limits = limits or ServerLimits()
    metrics = getattr(getattr(app, "state", None), "get", lambda _k: None)("llminfer_metrics")
    on_busy = getattr(metrics, "refused_busy", None)
    # uvicorn's graceful-shutdown timeout is only the backstop: the streams end themselves at the grace
    # period, and need a moment to send their last event.
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on", access_log=False, loop="asyncio",
                          http=protocol_class(limits, on_busy), timeout_keep_alive=limits.keep_alive_timeout_s,
                          h11_max_incomplete_event_size=limits.max_header_bytes,
                          timeout_graceful_shutdown=limits.shutdown_grace_s + 1.5)  # type: ignore[arg-type]


def raise_open_files_limit() -> None:
    """Raise this process's soft limit of open files to its hard limit (at most 65,536): every connection
    holds one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = 65536 if hard == resource.RLIM_INFINITY else min(hard, 65536)
    if soft != resource.RLIM_INFINITY and soft < target:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``(host, port)`` (``SO_REUSEADDR``, as uvicorn binds), not yet listening: taking
    the port before the model loads turns a port in use into an error at once, and the server then serves
    on this very socket, so nothing can take the port in between.

    Raises:
        OSError: the address cannot be bound (in use, not local, no permission for a port below 1024).
    """
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


class _Terminated(Exception):
    """SIGTERM, raised in the main thread once uvicorn has shut down (see :func:`run_server`)."""


def _raise_terminated(signum: int, frame: Any) -> None:
    raise _Terminated


#: The interpreter's GIL switch interval while :func:`run_server` serves (Python's default is 5 ms). The event
#: loop parses, validates and admits requests in pure Python; while it runs, the engine's model thread waits
#: for the GIL after each torch op of the step, up to a whole interval each time. When a burst of requests
#: arrives that stretched the first prefill steps two- to four-fold (a 32-request burst on 2 cores: the first
#: request's time to first token 0.6-1.2 s at 5 ms, 0.29 s at 0.5 ms).
SERVER_SWITCH_INTERVAL_S = 0.0005


def run_server(app: Any, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
               limits: ServerLimits | None = None, sock: socket.socket | None = None,
               on_listening: Callable[[], None] | None = None) -> bool:
    """Serve ``app`` until Ctrl-C or SIGTERM, then shut down gracefully (see :class:`ServerLimits`) and return
    whether the shutdown was forced (a second Ctrl-C ended the requests still running).

    Both signals return normally, so the caller's cleanup runs (``llminfer serve`` then closes its engine:
    vLLM's engine processes exit with it). uvicorn re-raises the signal it handled once it has stopped; left
    to the default handler, a re-raised SIGTERM would kill the process before that cleanup.

    Args:
        sock: a socket from :func:`bind_socket` to serve on (then ``host`` and ``port`` only name it in logs).
        on_listening: called once the app has started and the socket accepts connections (``llminfer serve``
            prints its "serving ... at URL" line there, so a script that waits for it can connect at once).

    Raises:
        SystemExit: uvicorn could not start (for example the port is in use; the reason is logged).
    """
    limits = limits or ServerLimits()
    raise_open_files_limit()
    server = _Server(uvicorn_config(app, host, port, log_level, limits), app, limits.shutdown_grace_s, on_listening)
    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(min(switch_interval, SERVER_SWITCH_INTERVAL_S))
    on_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_terminated) if on_main else None
    try:
        server.run(sockets=[sock] if sock is not None else None)
    except (KeyboardInterrupt, _Terminated):
        # the re-raised signal: the server has already stopped cleanly
        pass
    finally:
        sys.setswitchinterval(switch_interval)
        if on_main:
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
    return bool(server.force_exit)


@contextlib.contextmanager
def serve_in_thread(app: Any, host: str = "127.0.0.1", port: int = 0, startup_timeout_s: float = 120.0,
                    log_level: str = "warning", limits: ServerLimits | None = None) -> Iterator[str]:
    """Run ``app`` with uvicorn in a daemon thread; yield its base URL (``http://127.0.0.1:PORT``).

    ``port=0`` picks a free port (the socket is bound before the server starts, so there is no race).
    Leaving the block shuts the server down as SIGTERM would (``limits.shutdown_grace_s``).

    Raises:
        RuntimeError: the server did not start within ``startup_timeout_s`` seconds (e.g. the engine failed
            to load; the lifespan error is in the log).
    """
    limits = limits or ServerLimits()
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    bound_port = sock.getsockname()[1]
    server = _Server(uvicorn_config(app, host, bound_port, log_level, limits), app, limits.shutdown_grace_s)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="llminfer-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            sock.close()
            raise RuntimeError("the server did not start (see the log for the lifespan error)")
        time.sleep(0.02)
    url_host = f"[{host}]" if ":" in host else host
    try:
        yield f"http://{url_host}:{bound_port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30 + limits.shutdown_grace_s)
        sock.close()
