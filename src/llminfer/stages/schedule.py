"""Scheduler stage: the only owner of request state and the KV block pool.

Each loop: take in new requests and control messages (aborts), plan a step, hand it to the step stage,
apply its result, and send the step's updates downstream, one message per step.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any

import anyio
from anyio.abc import ObjectReceiveStream, ObjectSendStream

from llminfer.errors import CapacityError, RequestAbortedError
from llminfer.protocols.messages import (
    Abort,
    EngineStepOutput,
    RequestFailed,
    SchedulerOutput,
    SequenceUpdate,
    StepOutput,
    TokenizedRequest,
)
from llminfer.scheduler import Scheduler
from llminfer.trace import STEP, Tracer

_PENDING_ABORT_TTL_NS = 60 * 1_000_000_000


class SchedulerStage:
    """Wraps a :class:`~llminfer.scheduler.Scheduler` in the pipeline.

    The pipeline connects ``step_outbox`` / ``step_inbox`` to the step stage and ``control`` to the
    unbounded control channel (aborts from the detokenize stage, the sink and the engine).

    Args:
        scheduler: the scheduler (it owns the KV cache manager).
        batch_timeout_ms: when idle, wait this long after the first arrival for more before stepping.
    """

    name = "scheduler"

    def __init__(self, scheduler: Scheduler, batch_timeout_ms: float = 0.0, tracer: Tracer | None = None) -> None:
        self.scheduler = scheduler
        self.batch_timeout_s = batch_timeout_ms / 1000.0
        self.tracer = tracer or Tracer(enabled=False)
        self.step_outbox: ObjectSendStream[SchedulerOutput] | None = None
        self.step_inbox: ObjectReceiveStream[StepOutput] | None = None
        self.control: ObjectReceiveStream[Abort] | None = None
        self._pending_aborts: OrderedDict[str, int] = OrderedDict()
        self._admitted: list[TokenizedRequest] = []
        self._updates: list[SequenceUpdate] = []
        self._inbox_open = True
        self._prefilled: set[str] = set()

    # ------------------------------------------------------------------ message handling
    def _handle(self, msg: Any) -> None:
        if isinstance(msg, TokenizedRequest):
            if self._pending_aborts.pop(msg.request_id, None) is not None:
                self._updates.append(SequenceUpdate(msg.request_id, finish_reason="abort",
                                                    error=RequestAbortedError("request cancelled")))
                return
            try:
                self.scheduler.add_request(msg)
            except CapacityError as exc:
                self._updates.append(SequenceUpdate(msg.request_id, finish_reason="error", error=exc,
                                                    prompt_tokens=len(msg.prompt_token_ids)))
                return
            self._admitted.append(msg)
            req = self.scheduler.requests[msg.request_id]
            self.tracer.record(msg.request_id, self.name, "queued", len(msg.prompt_token_ids), t_ns=req.queued_ns)
        elif isinstance(msg, RequestFailed):
            self._updates.append(SequenceUpdate(msg.request_id, finish_reason="error", error=msg.error))
        elif isinstance(msg, Abort):
            self._abort(msg)
        else:
            raise TypeError(f"scheduler stage got an unexpected message {type(msg).__name__}")

    def _abort(self, msg: Abort) -> None:
        if self.scheduler.abort(msg.request_id):
            self.tracer.record(msg.request_id, self.name, "aborted")
            if msg.reason != "stop_string":
                self._updates.append(SequenceUpdate(msg.request_id, finish_reason="abort",
                                                    error=RequestAbortedError(f"request {msg.reason}")))
            return
        if msg.reason == "stop_string":
            return  # already finished by the scheduler in the same step: nothing to free
        now = time.perf_counter_ns()
        self._pending_aborts[msg.request_id] = now
        while self._pending_aborts:
            rid, t = next(iter(self._pending_aborts.items()))
            if now - t < _PENDING_ABORT_TTL_NS:
                break
            del self._pending_aborts[rid]

    def _drain(self, inbox: ObjectReceiveStream[Any]) -> None:
        if self.control is not None:
            while True:
                try:
                    self._handle(self.control.receive_nowait())
                except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                    break
        while self._inbox_open:
            try:
                self._handle(inbox.receive_nowait())
            except anyio.WouldBlock:
                break
            except (anyio.EndOfStream, anyio.ClosedResourceError):
                self._inbox_open = False

    async def _wait_for_work(self, inbox: ObjectReceiveStream[Any]) -> None:
        """Block while idle until a message arrives, then give late arrivals ``batch_timeout_ms``."""
        try:
            self._handle(await inbox.receive())
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            self._inbox_open = False
            return
        if self.batch_timeout_s > 0:
            with anyio.move_on_after(self.batch_timeout_s):
                while self.scheduler.num_waiting < self.scheduler.limits.max_batch_size:
                    try:
                        self._handle(await inbox.receive())
                    except (anyio.EndOfStream, anyio.ClosedResourceError):
                        self._inbox_open = False
                        break

    async def _flush(self, outbox: ObjectSendStream[Any], step_id: int) -> None:
        if self._updates or self._admitted:
            out = EngineStepOutput(step_id, tuple(self._updates), time.perf_counter_ns(), tuple(self._admitted))
            self._updates.clear()
            self._admitted.clear()
            await outbox.send(out)

    # ------------------------------------------------------------------ the loop
    async def run(self, inbox: ObjectReceiveStream[Any], outbox: ObjectSendStream[Any]) -> None:
        if self.step_outbox is None or self.step_inbox is None:
            raise RuntimeError("scheduler stage is not connected to a step stage")
        sched = self.scheduler
        async with outbox, self.step_outbox:
            while True:
                self._drain(inbox)
                if not sched.has_unfinished():
                    await self._flush(outbox, -1)
                    if not self._inbox_open:
                        return
                    await self._wait_for_work(inbox)
                    self._drain(inbox)
                    if not sched.has_unfinished():
                        continue
                plan, failures = sched.schedule()
                self._updates.extend(failures)
                if not plan.sequences:
                    await self._flush(outbox, plan.step_id)
                    if sched.has_unfinished() and not failures:
                        # Nothing fits right now and nothing runs: cannot happen with the admission
                        # check, but never spin: yield to the loop.
                        await anyio.sleep(0.001)
                    continue
                if self.tracer.enabled:
                    for new in plan.new_requests:
                        req = sched.requests[new.request_id]
                        self.tracer.record(new.request_id, self.name, "first_scheduled", req.num_cached_tokens,
                                           t_ns=req.first_scheduled_ns)
                    self.tracer.record(STEP, self.name, "scheduled", plan.num_tokens)
                await self.step_outbox.send(plan)
                result = await self.step_inbox.receive()
                updates = sched.update(result)
                if self.tracer.enabled:
                    for up in updates:
                        if up.new_token_ids and up.request_id not in self._prefilled:
                            self._prefilled.add(up.request_id)
                            self.tracer.record(up.request_id, self.name, "prefill_done", up.prompt_tokens,
                                               t_ns=result.end_ns)
                        if up.finish_reason is not None:
                            self._prefilled.discard(up.request_id)
                            self.tracer.record(up.request_id, self.name, "finished", len(up.new_token_ids),
                                               t_ns=result.end_ns)
                self._updates.extend(updates)
                await self._flush(outbox, plan.step_id)


class StepStage:
    """Runs the backend on each :class:`SchedulerOutput` in a worker thread (the event loop stays free).

    Args:
        backend: anything with ``execute(plan) -> StepOutput`` (see :class:`llminfer.protocols.Backend`).
    """

    name = "step"

    def __init__(self, backend: Any, tracer: Tracer | None = None) -> None:
        self.backend = backend
        self.tracer = tracer or Tracer(enabled=False)
        self._limiter = anyio.CapacityLimiter(1)

    async def run(self, inbox: ObjectReceiveStream[Any], outbox: ObjectSendStream[Any]) -> None:
        async with outbox:
            async for plan in inbox:
                result = await anyio.to_thread.run_sync(
                    self.backend.execute, plan, limiter=self._limiter, abandon_on_cancel=False
                )
                if self.tracer.enabled:
                    n = plan.num_tokens
                    self.tracer.record(STEP, self.name, "step_start", n, t_ns=result.start_ns)
                    self.tracer.record(STEP, self.name, "step_end", n, t_ns=result.end_ns)
                await outbox.send(result)

