"""Pipeline: wires stages with bounded anyio memory channels and runs them in one task group.

``Pipeline([tokenize, prefix_hash, scheduler, detokenize, ..., sink], step=step)`` connects each stage's
outbox to the next stage's inbox (bounded: a slow stage applies backpressure upstream), loops the
scheduler stage with the step stage, and gives every stage that has a ``control`` attribute a sender on
the unbounded control channel the scheduler reads (aborts travel there, never blocked by data traffic).
Any stage can be replaced or added as long as it has ``async def run(inbox, outbox)`` and passes on the
messages it does not handle; the last stage must be a sink with ``open(request_id)``/``close(request_id)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import anyio
import structlog
from anyio.abc import ObjectReceiveStream, ObjectSendStream, TaskGroup

from llminfer.errors import EngineError, RequestAbortedError
from llminfer.protocols import Stage
from llminfer.protocols.messages import Abort, GenerationRequest, RequestDelta
from llminfer.stages.schedule import SchedulerStage

log = structlog.get_logger("llminfer.pipeline")


class Pipeline:
    """A running chain of stages (use as ``async with Pipeline(...) as p``).

    Args:
        stages: in order; exactly one :class:`SchedulerStage`; the last one is the sink.
        step: the step stage looped with the scheduler stage.
        buffer_size: capacity of each inter-stage channel (messages).

    Raises:
        ValueError: no scheduler stage, or the last stage is not a sink.
    """

    def __init__(self, stages: Sequence[Stage], step: Stage, buffer_size: int = 64) -> None:
        schedulers = [s for s in stages if isinstance(s, SchedulerStage)]
        if len(schedulers) != 1:
            raise ValueError("a pipeline needs exactly one SchedulerStage")
        sink = stages[-1]
        if not (hasattr(sink, "open") and hasattr(sink, "close")):
            raise ValueError("the last stage must be a sink with open(request_id) and close(request_id)")
        for stage in stages:
            if not isinstance(stage, Stage):
                raise ValueError(f"{stage!r} is not a stage (needs name and async run(inbox, outbox))")
        self.stages = list(stages)
        self.step = step
        self.scheduler_stage = schedulers[0]
        self.sink: Any = sink
        self.buffer_size = buffer_size
        self._tg: TaskGroup | None = None
        self._input: ObjectSendStream[Any] | None = None
        self._control: ObjectSendStream[Abort] | None = None
        self._failure: BaseException | None = None
        self._inner: TaskGroup | Any = None
        self.running = False

    async def __aenter__(self) -> Pipeline:
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        control_send, control_recv = anyio.create_memory_object_stream[Abort](math.inf)
        self._control = control_send
        self.scheduler_stage.control = control_recv
        step_in_send, step_in_recv = anyio.create_memory_object_stream[Any](1)
        step_out_send, step_out_recv = anyio.create_memory_object_stream[Any](1)
        self.scheduler_stage.step_outbox = step_in_send
        self.scheduler_stage.step_inbox = step_out_recv

        self._input, inbox = anyio.create_memory_object_stream[Any](self.buffer_size)
        jobs = []
        for stage in self.stages:
            if hasattr(stage, "control") and stage is not self.scheduler_stage:
                stage.control = control_send.clone()
            outbox, next_inbox = anyio.create_memory_object_stream[Any](self.buffer_size)
            jobs.append((stage, inbox, outbox))
            inbox = next_inbox
        jobs.append((self.step, step_in_recv, step_out_send))
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
            self._failure = exc
            log.error("stage failed", stage=stage.name, error=repr(exc))
            self.running = False
            self.sink.fail_all(EngineError(f"stage {stage.name} failed: {type(exc).__name__}: {exc}"))
            self._inner.cancel_scope.cancel()

    @staticmethod
    async def _discard(inbox: ObjectReceiveStream[Any]) -> None:
        async with inbox:
            async for _ in inbox:
                pass

    async def submit(self, request: GenerationRequest) -> ObjectReceiveStream[RequestDelta]:
        """Send a request in; return the stream of its deltas (ends after the final delta).

        Raises:
            EngineError: the pipeline is not running (or stopped because a stage failed: the message says
                which error).
        """
        if not self.running or self._input is None:
            raise EngineError(f"the engine pipeline is not running ({self._failure_text()})")
        stream = self.sink.open(request.request_id)
        try:
            await self._input.send(request)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            self.sink.close(request.request_id)
            raise EngineError(f"the engine pipeline stopped ({self._failure_text()})") from None
        except BaseException:
            self.sink.close(request.request_id)
            raise
        return stream

    def _failure_text(self) -> str:
        if self._failure is None:
            return "shut down"
        return f"a stage failed: {type(self._failure).__name__}: {self._failure}"

    async def abort(self, request_id: str, reason: str = "cancelled") -> None:
        """Cancel a request wherever it is; its blocks are freed at once."""
        if self._control is not None:
            await self._control.send(Abort(request_id, reason))

    def abort_nowait(self, request_id: str, reason: str = "cancelled") -> None:
        """Like :meth:`abort`, callable from synchronous code inside the loop (never blocks)."""
        if self._control is not None:
            self._control.send_nowait(Abort(request_id, reason))

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.aclose(exc_info=exc_info)

    async def aclose(self, timeout_s: float | None = 30.0, exc_info: tuple = (None, None, None)) -> None:
        """Stop taking requests, let in-flight ones finish for up to ``timeout_s`` seconds (None: no limit,
        0: cancel at once), then cancel the rest (their handles get :class:`RequestAbortedError`)."""
        if self._tg is None:
            return
        self.running = False
        tg, self._tg = self._tg, None
        if self._input is not None:
            await self._input.aclose()
        if self._inner is not None:
            if timeout_s is not None and timeout_s <= 0:
                self._inner.cancel_scope.cancel()
            elif timeout_s is not None:
                self._inner.cancel_scope.deadline = anyio.current_time() + timeout_s
        try:
            await tg.__aexit__(*exc_info)
        finally:
            self.sink.fail_all(RequestAbortedError("the engine shut down"))
