"""Where an engine's own pipeline runs: in a background event loop for synchronous callers (``engine.run``,
``engine.stream``), or in the caller's event loop (``async with engine.running():``, as the server does);
never in both at once, and never after close (:class:`PipelineLifecycle`).

The background loop is an anyio blocking portal: a daemon thread running an event loop, into which other
threads hand coroutines. :class:`BackgroundLoop` starts one with the pipeline entered, stops it (in-flight
requests finish first), and :func:`call` calls into it from any thread.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel

from llminfer.errors import EngineClosedError, EngineError
from llminfer.frontend.output import RequestHandle, collect_all
from llminfer.protocols.messages import Control, GenerationRequest
from llminfer.results import GenerationResult, StreamChunk

CLOSED = "the engine was closed (close() has run); it takes no more requests: make a new InferenceEngine"

# Owners (engines) whose background loop runs. At interpreter exit the loop's daemon thread stops before
# garbage collection would close the portal, which then waits for it forever: a script that forgets
# close() (or dies of an exception) would hang instead of exiting. Closing them at exit avoids it.
_STARTED: weakref.WeakSet[Any] = weakref.WeakSet()


@atexit.register
def _close_started() -> None:
    for owner in list(_STARTED):
        with contextlib.suppress(Exception):
            owner.close()


class BackgroundLoop:
    """``pipeline`` running in a new background event loop, entered at construction.

    Args:
        pipeline: an async context manager (a :class:`~llminfer.pipeline.Pipeline`).
        owner: closed at interpreter exit if still running then (its ``close()``), see :data:`_STARTED`.

    Attributes:
        portal: the anyio blocking portal (``portal.call(fn, *args)`` runs ``fn`` in the loop).

    Raises:
        Exception: entering the pipeline failed (the loop is stopped again).
    """

    def __init__(self, pipeline: Any, owner: Any) -> None:
        self._portal_cm = anyio.from_thread.start_blocking_portal()
        self.portal = self._portal_cm.__enter__()
        try:
            self._pipeline_cm: Any = self.portal.wrap_async_context_manager(pipeline)
            self._pipeline_cm.__enter__()
        except BaseException:
            self._portal_cm.__exit__(None, None, None)
            raise
        self._owner = owner
        _STARTED.add(owner)

    def stop(self) -> None:
        """Exit the pipeline (in-flight requests finish first, up to its own limit), then stop the loop.
        Calls into the loop keep working while the pipeline exits. Idempotent."""
        _STARTED.discard(self._owner)
        if self._pipeline_cm is not None:
            cm, self._pipeline_cm = self._pipeline_cm, None
            with contextlib.suppress(Exception):  # the pipeline logs its own failures
                cm.__exit__(None, None, None)
        if self._portal_cm is not None:
            pcm, self._portal_cm = self._portal_cm, None
            pcm.__exit__(None, None, None)


def call(portal: Any, fn: Any, *args: Any) -> Any:
    """``portal.call(fn, *args)``, waiting by polling (every 0.1 s) instead of blocking: a Ctrl-C that the
    kernel hands to another thread of the process does not wake a blocked wait, so Python would run its
    KeyboardInterrupt only when ``fn`` ended (for ``engine.run``, at the end of the whole generation).

    Raises:
        RuntimeError: the portal is stopped. Whatever ``fn`` raises.
    """
    future = portal.start_task_soon(fn, *args)
    while True:
        try:
            return future.result(timeout=0.1)
        except concurrent.futures.TimeoutError:
            continue


class PipelineLifecycle:
    """Starts, hands out and stops an engine's own pipeline; safe from any thread.

    Args:
        owner: the engine (closed at interpreter exit while its background loop runs).
        load: loads what the pipeline needs (called under the lock before a background loop starts).
        make_pipeline: a fresh pipeline (called under the lock).
        after_caller_loop: called when the pipeline in the caller's loop has exited.

    Attributes:
        lock: held while a background loop starts or stops, and while the engine closes.
        closed: set by :meth:`close`; every later start is refused.
        pipeline: the running pipeline (in either loop), or None.
        background: the background loop, or None.
        loop_token: the caller's event loop while the pipeline runs in it, else None.
    """

    def __init__(self, owner: Any, load: Callable[[], Any], make_pipeline: Callable[[], Any],
                 after_caller_loop: Callable[[], None]) -> None:
        self._owner, self._load, self._make_pipeline = owner, load, make_pipeline
        self._after_caller_loop = after_caller_loop
        self.lock = threading.RLock()
        self.closed = False
        self.pipeline: Any = None
        self.background: BackgroundLoop | None = None
        self.loop_token: Any = None

    def portal(self) -> Any:
        """The background loop's portal, the loop started if need be (under the lock, so a thread never
        sees a half-started loop and never starts one that another thread closes).

        Raises:
            EngineClosedError: :meth:`close` has run. EngineError: the pipeline runs in the caller's loop.
        """
        background = self.background
        if background is not None:
            return background.portal
        with self.lock:
            if self.closed:
                raise EngineClosedError(CLOSED)
            self._load()
            if self.background is None:
                if self.pipeline is not None:
                    raise EngineError("the engine is running in another event loop (inside running())")
                pipeline = self._make_pipeline()
                background = BackgroundLoop(pipeline, self._owner)
                self.pipeline = pipeline
                self.background = background  # last: other threads read it without the lock, once it runs
            return self.background.portal

    @contextlib.asynccontextmanager
    async def in_caller_loop(self) -> AsyncIterator[Any]:
        """Run a fresh pipeline in the current event loop for the block.

        Raises:
            EngineClosedError: :meth:`close` has run. EngineError: the pipeline already runs.
        """
        with self.lock:  # never blocks for long: portal() holds it only while a loop starts
            if self.closed:
                raise EngineClosedError(CLOSED)
            if self.background is not None or self.pipeline is not None:
                raise EngineError("the engine is already running")
            self.pipeline = self._make_pipeline()
        self.loop_token = anyio.lowlevel.current_token()
        try:
            async with self.pipeline:
                yield self.pipeline
        finally:
            self.pipeline = self.loop_token = None
            self._after_caller_loop()

    def running_pipeline(self) -> Any:
        """The running pipeline.

        Raises:
            EngineClosedError: :meth:`close` has run. EngineError: no pipeline runs.
        """
        pipeline = self.pipeline
        if pipeline is None or self.closed:
            raise EngineClosedError(CLOSED) if self.closed else EngineError("the engine is not running")
        return pipeline

    def call(self, portal: Any, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` in the background loop (:func:`call`); a loop that close() stopped meanwhile is an
        EngineClosedError."""
        try:
            return call(portal, fn, *args)
        except RuntimeError as exc:
            if self.closed or self.background is None or self.background.portal is not portal:
                raise EngineClosedError(CLOSED) from exc
            raise

    def stop_background(self) -> None:
        """Stop the background loop, if one runs (in-flight requests finish first); calls into it still
        work while they do."""
        with self.lock:
            if self.background is not None:
                self.background.stop()
                self.background = self.pipeline = None

    def close(self, release: Callable[[], None]) -> None:
        """Refuse every later start, stop the background loop, then ``release()`` (under the lock, so a
        close under way in another thread is waited for)."""
        self.closed = True  # first, without the lock: submitting threads stop at once
        with self.lock:
            self.stop_background()
            release()

    # ------------------------------------------------------------------ driving it from synchronous code
    def collect(self, portal: Any, requests: Sequence[GenerationRequest]) -> list[GenerationResult | BaseException]:
        """Submit ``requests`` to the background loop's pipeline and wait for every result (or error), in
        order; Ctrl-C while waiting aborts them (:meth:`abort_interrupted`)."""
        pipeline = self.running_pipeline()
        try:
            return self.call(portal, collect_all, pipeline, list(requests))
        except (KeyboardInterrupt, SystemExit):
            self.abort_interrupted(portal, pipeline, requests)
            raise

    def stream(self, portal: Any, request: GenerationRequest) -> Iterator[StreamChunk]:
        """Submit ``request`` to the background loop's pipeline and yield its chunks as they come; closing
        the iterator early cancels the request, and Ctrl-C while waiting aborts it."""
        pipeline = self.running_pipeline()
        chunks = RequestHandle(pipeline, request).chunks()
        try:
            while True:
                try:
                    yield self.call(portal, chunks.__anext__)
                except StopAsyncIteration:
                    return
        except (KeyboardInterrupt, SystemExit):
            self.abort_interrupted(portal, pipeline, [request])
            raise
        finally:
            # Cancels the request when the caller stops early; nothing to do once the loop has stopped.
            with contextlib.suppress(EngineClosedError, RuntimeError):
                self.call(portal, chunks.aclose)

    @staticmethod
    def abort_interrupted(portal: Any, pipeline: Any, requests: Sequence[GenerationRequest]) -> None:
        """Cancel ``requests`` after Ctrl-C (or SystemExit) reached this thread while it waited on the event
        loop: the coroutine it waited for still runs there, so without an abort the requests would generate
        to their end (and close() would wait for them). Each stops within the step under way."""
        for request in requests:
            with contextlib.suppress(Exception):
                portal.call(pipeline.abort, request.request_id, "interrupted")

    # ------------------------------------------------------------------ engine-wide control
    async def control(self, action: str) -> None:
        """Send ``Control(action)`` through the pipeline (ordered after what was submitted before) and wait
        until the core has done it (inside the pipeline's loop)."""
        done = anyio.Event()
        if self.running_pipeline().send_nowait(Control(action, done)):
            await done.wait()

    def wait_from_thread(self, fn: Callable[[], Any]) -> None:
        """Await ``fn()`` in the loop the pipeline runs in, from synchronous code in another thread; returns
        at once when nothing runs.

        Raises:
            EngineError: called on the pipeline's own event loop (it would block it).
        """
        if (token := self.loop_token) is not None:
            with contextlib.suppress(RuntimeError):  # raised when no event loop runs in this thread
                if anyio.lowlevel.current_token() == token:
                    raise EngineError("wait_drained() would block the engine's own loop: await engine.drained()")
            anyio.from_thread.run(fn, token=token)
        elif (background := self.background) is not None and not self.closed:
            with contextlib.suppress(EngineClosedError):  # closed meanwhile: nothing runs any more
                self.call(background.portal, fn)

    def control_now(self, action: str) -> None:
        """``Control(action)`` from any thread: queued when called on the caller's loop where the pipeline
        runs; done when this returns from any other thread (the background loop started if need be)."""
        if self.background is None and self.pipeline is not None:
            self.pipeline.send_nowait(Control(action))
        else:
            self.call(self.portal(), self.control, action)
