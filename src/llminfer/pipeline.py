"""Pipeline: wires stages with anyio memory channels and runs them in one task group.

``Pipeline([tokenize, prefix_hash, core, detokenize, ..., sink])`` connects each stage's outbox to the next
stage's inbox. The channels between stages are bounded (a slow stage applies backpressure upstream); the
head channel, which :meth:`submit`, :meth:`abort` and :meth:`send_nowait` write to, is unbounded, so that it is
one ordered inbox for the engine core that nothing can block on (see
:data:`llminfer.core.engine_core.INBOX_CAPACITY`). Stages that send messages back into it (the detokenize
stage's stop-string finishes, the sink's disconnect aborts) implement
:class:`~llminfer.protocols.SendsUpstream` and are given the sender. Stages that keep per-request
output state implement :class:`~llminfer.protocols.TracksRequests`: :meth:`submit` registers the request
with them, as it opens the request's stream at the sink.

The pipeline knows no stage by name: the engine core is a stage like the others (it just happens to own
the scheduler and the model). Any stage can be replaced or added as long as it has ``name`` and
``async def run(inbox, outbox)`` and passes on the messages it does not handle; the last stage must be a
:class:`~llminfer.protocols.Sink`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anyio
import structlog
from anyio.abc import ObjectReceiveStream, ObjectSendStream, TaskGroup

from llminfer.core.engine_core import INBOX_CAPACITY
from llminfer.errors import EngineClosedError, EngineError
from llminfer.protocols import SendsUpstream, Sink, Stage, TakesDirectMessages, TracksRequests
from llminfer.protocols.messages import (
    Abort,
    Control,
    FinishRequest,
    GenerationRequest,
    RequestDelta,
    TokenizedRequest,
)

log = structlog.get_logger("llminfer.pipeline")


class Pipeline:
    """A running chain of stages (use as ``async with Pipeline(...) as p``).

    Args:
        stages: in order; the last one is the sink.
        buffer_size: capacity of each channel between two stages (messages).

    Raises:
        ValueError: an element is not a :class:`Stage`, or the last one is not a :class:`Sink`.
    """

    def __init__(self, stages: Sequence[Stage], buffer_size: int = 64) -> None:
        for stage in stages:
            if not isinstance(stage, Stage):
                raise ValueError(f"{stage!r} is not a stage (needs name and async run(inbox, outbox))")
        if not stages or not isinstance(stages[-1], Sink):
            raise ValueError("the last stage must be a sink (open, close, fail_all and run)")
        self.stages = list(stages)
        self.sink: Sink = stages[-1]  # type: ignore[assignment]
        self._trackers: list[TracksRequests] = [s for s in stages if isinstance(s, TracksRequests)]
        self.buffer_size = buffer_size
        self._tg: TaskGroup | None = None
        self._input: ObjectSendStream[Any] | None = None
        self._direct: ObjectSendStream[Any] | None = None  # to the stage that takes direct messages, if any
        self._failure: BaseException | None = None
        self._inner: TaskGroup | Any = None
        self.running = False
        self._closed = False  # aclose() has begun

    async def __aenter__(self) -> Pipeline:
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._input, inbox = anyio.create_memory_object_stream[Any](INBOX_CAPACITY)
        jobs = []
        for stage in self.stages:
            if isinstance(stage, SendsUpstream):
                stage.bind_upstream(self.send_nowait)
            if isinstance(stage, TakesDirectMessages) and self._direct is None:
                self._direct, direct_inbox = anyio.create_memory_object_stream[Any](INBOX_CAPACITY)
                stage.bind_direct(direct_inbox)
            outbox, next_inbox = anyio.create_memory_object_stream[Any](self.buffer_size)
            jobs.append((stage, inbox, outbox))
            inbox = next_inbox
        await self._tg.start(self._supervise, jobs, inbox)
        self.running = True
        return self

    async def _supervise(self, jobs: list, tail: ObjectReceiveStream[Any], *, task_status: Any) -> None:
        # Stages run in an inner task group: a failing stage cancels the stages only, never the task that
        # entered the pipeline (it just sees its requests fail).
        async with anyio.create_task_group() as inner:
            self._inner = inner
            for job in jobs:
                inner.start_soon(self._run_stage, *job)
            inner.start_soon(self._discard, tail)
            task_status.started()
        self.running = False

    async def _run_stage(self, stage: Stage, inbox: ObjectReceiveStream[Any], outbox: ObjectSendStream[Any]) -> None:
        try:
            async with inbox:
                await stage.run(inbox, outbox)
        except anyio.get_cancelled_exc_class():
            raise
        except BaseException as exc:  # noqa: BLE001 - a broken stage must not hang any request
            if self._closed and isinstance(exc, (anyio.BrokenResourceError, anyio.ClosedResourceError)):
                # Shutting down: the stage after this one has already returned (the core, once its
                # requests are done); what this stage still held is failed by aclose(), quietly.
                return
            self._failure = exc
            log.error("stage failed", stage=stage.name, error=repr(exc))
            self.running = False
            self.sink.fail_all(EngineError(f"stage {stage.name} failed: {type(exc).__name__}: {exc}"))
            self._inner.cancel_scope.cancel()
        finally:
            # A stage that returns ends the pipeline (the core returns after Control("close") once its
            # requests are done): end the head channel too, so the stages before it finish.
            if self._input is not None:
                self._input.close()
            if self._direct is not None:
                self._direct.close()

    @staticmethod
    async def _discard(inbox: ObjectReceiveStream[Any]) -> None:
        async with inbox:
            async for _ in inbox:
                pass

    async def submit(self, request: GenerationRequest | TokenizedRequest) -> ObjectReceiveStream[RequestDelta]:
        """Send a request in; return the stream of its deltas (ends after the final delta).

        A :class:`GenerationRequest` is tokenized by the tokenize stage; a :class:`TokenizedRequest` (the
        HTTP routes tokenize and validate themselves) passes it. The request's output state is registered
        here, with the sink (:meth:`~llminfer.protocols.Sink.open`) and with every stage that keeps some
        (:class:`~llminfer.protocols.TracksRequests`: the detokenize stage), before any output can exist.

        Raises:
            EngineClosedError: the pipeline was shut down; EngineError: it is not running (or stopped
                because a stage failed: the message says which error), or a stage could not register it.
        """
        if not self.running or self._input is None:
            if self._closed and self._failure is None:
                raise EngineClosedError("the engine pipeline was shut down; it takes no more requests")
            raise EngineError(f"the engine pipeline is not running ({self._failure_text()})")
        stream = self.sink.open(request.request_id)
        try:
            self._input.send_nowait(request)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            self.sink.close(request.request_id)
            if self._closed and self._failure is None:
                raise EngineClosedError("the engine pipeline was shut down; it takes no more requests") from None
            raise EngineError(f"the engine pipeline stopped ({self._failure_text()})") from None
        # No await since the send: no stage has run, so the state exists before the request's first update.
        try:
            for stage in self._trackers:
                stage.add_request(request)
        except Exception as exc:
            self.sink.close(request.request_id)
            self.abort(request.request_id, "failed to register")
            raise EngineError(f"registering the request failed: {type(exc).__name__}: {exc}") from exc
        await anyio.lowlevel.checkpoint()
        return stream

    def _failure_text(self) -> str:
        if self._failure is None:
            return "shut down"
        return f"a stage failed: {type(self._failure).__name__}: {self._failure}"

    def send_nowait(self, message: Any) -> bool:
        """Put ``message`` (an :class:`Abort`, :class:`~llminfer.protocols.messages.Control`, ...) at the
        tail of the ordered inbox, from inside the event loop; never blocks. False when the pipeline
        no longer takes messages.

        A :class:`FinishRequest` (the core already has its request) goes only to the core's direct inbox
        when it has one; an :class:`Abort` goes there too, and down the ordered inbox in case it overtook
        its request (see :class:`~llminfer.protocols.TakesDirectMessages`)."""
        if self._direct is not None and isinstance(message, (Abort, FinishRequest)):
            try:
                self._direct.send_nowait(message)
                if isinstance(message, FinishRequest):
                    return True
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                pass
        if self._input is None:
            return False
        try:
            self._input.send_nowait(message)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            return False
        return True

    def abort(self, request_id: str, reason: str = "cancelled") -> None:
        """Cancel a request wherever it is: the :class:`Abort` follows the request through the stages, so
        it reaches the core after it and its blocks are freed at once."""
        self.send_nowait(Abort(request_id, reason))

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.aclose(exc_info=exc_info)

    async def aclose(self, timeout_s: float | None = 30.0, exc_info: tuple = (None, None, None)) -> None:
        """Stop taking requests, let in-flight ones finish for up to ``timeout_s`` seconds (None: no limit,
        0: cancel at once), then cancel the rest (their handles get :class:`EngineClosedError`, a
        :class:`~llminfer.errors.RequestAbortedError`)."""
        if self._tg is None:
            return
        self.running = False
        self._closed = True
        tg, self._tg = self._tg, None
        # Ordered after every request already sent; aborts and stop-string finishes still get in.
        self.send_nowait(Control("close"))
        if self._inner is not None:
            if timeout_s is not None and timeout_s <= 0:
                self._inner.cancel_scope.cancel()
            elif timeout_s is not None:
                self._inner.cancel_scope.deadline = anyio.current_time() + timeout_s
        try:
            await tg.__aexit__(*exc_info)
        finally:
            self.sink.fail_all(EngineClosedError("the engine shut down before the request finished"))
