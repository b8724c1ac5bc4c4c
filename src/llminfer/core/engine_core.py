"""The engine core: one actor that owns the scheduler, the KV cache manager and the backend.

Start reading here. :meth:`EngineCore._step_loop` is the loop that explains the system::

    while there is work:
        take every message waiting, direct inbox first       (direct: aborts, stop-string finishes;
                                                              ordered: requests, aborts, control)
        plan = scheduler.schedule()                          (which tokens of which requests, this step)
        output = await model_thread.run(backend.execute, plan)  (the model step, off the event loop, on the
                                                             engine's one model thread: core.model_thread)
        updates = scheduler.update_from_output(plan, output) (append tokens, finish requests, free blocks)
        emit one EngineStepOutput                            (→ detokenize → sink → the request's handle)

While no message waits, the model thread goes on by itself (:meth:`EngineCore._run_on`): it posts the step's
output to the event loop, then schedules and executes the next step; the scheduler stays one thread's at a time.

Requests, aborts and control arrive on the one ordered inbox, so an abort always reaches the core after the
request it cancels (no tombstones, no time-to-live), and a ``Control("drain")`` placed in the inbox resolves
exactly when every request that entered before it has finished and freed its blocks. Aborts and stop-string
finishes also arrive on the direct inbox (:meth:`EngineCore.bind_direct`), read first, so they need not wait
behind requests still in the front stages. Nothing else touches the scheduler, the block pool or the backend.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from typing import Any

import anyio
import structlog
from anyio.abc import ObjectReceiveStream, ObjectSendStream

from llminfer.core.model_thread import ModelThread, ModelThreadLease
from llminfer.core.relay import RUN_ON_S, OutputRelay, message_waiting, steps_on_model_thread_enabled
from llminfer.core.scheduler import Scheduler
from llminfer.errors import EngineError, LLMInferError, RequestAbortedError
from llminfer.protocols import Backend
from llminfer.protocols.messages import (
    Abort,
    Control,
    EngineStepOutput,
    FinishRequest,
    RequestFailed,
    SchedulerOutput,
    SequenceUpdate,
    StepOutput,
    TokenizedRequest,
)
from llminfer.request import RequestStatus
from llminfer.stats import FinishedRequest, StatLogger, record_all
from llminfer.trace import STEP, Tracer

log = structlog.get_logger("llminfer.core")

GRAMMAR_POLL_S = 0.002  # while only compiling requests wait: how often to look whether a grammar is ready
SCHEDULER_STAGE = "scheduler"  # trace stage names (the benchmark metrics read them)
STEP_STAGE = "step"


class EngineCore:
    """The llminfer engine core (see the module docstring).

    Args:
        scheduler: the scheduler (it owns the :class:`~llminfer.kv.manager.KVCacheManager`).
        backend: runs one step (:class:`~llminfer.protocols.Backend`), called in a worker thread.
        batch_timeout_ms: when idle, wait this long (ms) after the first arrival for more before stepping.
        tracer: records the core's trace events, from the requests' own timestamps.
        stat_loggers: get each emitted step's :class:`~llminfer.stats.IterationStats` (the list is read at
            every step, so loggers added later are served too).
        model_thread: where ``backend.execute`` runs (the engine passes the thread it loaded the model on);
            None: anyio's worker threads, one step at a time.

    Raises:
        TypeError: ``backend`` does not implement :class:`~llminfer.protocols.Backend`.
    """

    name = "core"

    def __init__(self, scheduler: Scheduler, backend: Backend, batch_timeout_ms: float = 0.0,
                 tracer: Tracer | None = None, stat_loggers: list[StatLogger] | None = None,
                 model_thread: ModelThread | ModelThreadLease | None = None) -> None:
        if not isinstance(backend, Backend):
            raise TypeError(f"{backend!r} is not a Backend (needs name, execute(plan), release(ids) and describe())")
        self.scheduler = scheduler
        self.backend = backend
        self.batch_timeout_s = batch_timeout_ms / 1000.0
        self.tracer = tracer or Tracer(enabled=False)
        self.stat_loggers = stat_loggers if stat_loggers is not None else []
        self.model_thread = model_thread
        self._limiter = anyio.CapacityLimiter(1)
        self._inbox_open = True
        self._closing = False  # Control("close") seen: finish the admitted requests, then return
        self._updates: list[SequenceUpdate] = []
        self._passed_on: list[Any] = []
        self._drains: list[Any] = []
        self._last_step: tuple[list[Any], int] = ([], 0)  # the last step's requests and end time (tracing)
        self._direct: ObjectReceiveStream[Any] | None = None  # aborts and stop-string finishes, unordered
        self.steps_on_model_thread = steps_on_model_thread_enabled()  # see _run_on
        self.num_steps_run_on = 0  # steps executed by _run_on after its first (engine signal for tests)
        self._relay = OutputRelay()  # step outputs posted by _run_on

    def bind_direct(self, inbox: ObjectReceiveStream[Any]) -> None:
        """Take :class:`Abort` and :class:`FinishRequest` also from ``inbox``, ahead of the ordered one
        (:class:`~llminfer.protocols.TakesDirectMessages`)."""
        self._direct = inbox

    # ------------------------------------------------------------------ the loop
    async def run(self, inbox: ObjectReceiveStream[Any], outbox: ObjectSendStream[Any]) -> None:
        """Serve until the inbox ends and every admitted request has finished."""
        sched = self.scheduler
        async with outbox:
            try:
                await self._step_loop(inbox, outbox)
            finally:
                # Cut off at shutdown: free what the unfinished requests still hold.
                unfinished = list(sched.requests)
                for request_id in unfinished:
                    sched.finish_request(request_id)
                self.backend.release(unfinished)

    async def _step_loop(self, inbox: ObjectReceiveStream[Any], outbox: ObjectSendStream[Any]) -> None:
        sched = self.scheduler
        while True:
            self._take_waiting(inbox)
            if not sched.has_unfinished():
                await self._emit(outbox, -1)
                if self._closing or not self._inbox_open:
                    return
                await self._wait_for_work(inbox)
                continue
            plan, failed = self._schedule()
            if plan is None:
                continue
            if plan.sequences:
                loop = self._run_on_loop(inbox, outbox)
                if loop is not None:  # steps follow each other on the model thread while nothing needs this loop
                    plan, failed = await self.model_thread.run(self._run_on, plan, inbox, outbox, loop)
                    if plan is None:
                        continue
                else:
                    self._apply(plan, await self._execute(plan))
            if not plan.sequences and sched.waiting_for_grammar:
                await self._wait_for_work(inbox, GRAMMAR_POLL_S)  # a compile finishing is no message
            elif not plan.sequences and not failed:
                # Admission control makes this unreachable (a request that can never fit is refused
                # and a lone running one that outgrows the pool fails); never spin if it happens.
                log.error("nothing schedulable while requests wait", waiting=sched.num_waiting)
                await anyio.sleep(0.001)
            await self._emit(outbox, plan.step_id)

    def _schedule(self) -> tuple[SchedulerOutput | None, bool]:
        """The next step's plan (None: the scheduler failed, and every request with it) and whether a
        request failed in scheduling (its update is queued)."""
        sched = self.scheduler
        try:
            plan, failures = sched.schedule()
        except Exception as exc:  # noqa: BLE001 - a scheduler bug fails the requests, not the engine
            log.exception("scheduling failed; failing every request in the core")
            self._fail(list(sched.requests), exc, "scheduling")
            return None, False
        self._updates.extend(failures)
        return plan, bool(failures)

    def _apply(self, plan: SchedulerOutput, result: StepOutput) -> None:
        try:
            self._updates.extend(self.scheduler.update_from_output(plan, result))
        except Exception as exc:  # noqa: BLE001 - the step's requests fail, the engine goes on
            log.exception("applying a step's output failed; failing its requests")
            self._fail([seq.request_id for seq in plan.sequences], exc, "the step's output")

    async def _execute(self, plan: SchedulerOutput) -> StepOutput:
        """Run the backend on ``plan`` in a worker thread (the model thread where there is one)."""
        if self.model_thread is not None:
            return await self.model_thread.run(self._execute_here, plan)
        return await anyio.to_thread.run_sync(self._execute_here, plan, limiter=self._limiter,
                                              abandon_on_cancel=False)

    def _execute_here(self, plan: SchedulerOutput) -> StepOutput:
        """Run the backend on ``plan`` in the calling thread; trace the step and the requests in it."""
        requests = self._trace_scheduled(plan)
        try:
            result = self.backend.execute(plan)
        except Exception as exc:  # noqa: BLE001 - Backend.execute should return errors; fail the step if not
            now = time.perf_counter_ns()
            result = StepOutput(plan.step_id, {}, now, now, error=exc)
        self._trace_step(requests, plan, result)
        return result

    def _trace_scheduled(self, plan: SchedulerOutput) -> list[Any] | None:
        if not self.tracer.enabled:
            return None
        requests = [self.scheduler.requests[s.request_id] for s in plan.sequences]
        for new in plan.new_requests:
            req = self.scheduler.requests[new.request_id]
            self.tracer.record(req.request_id, SCHEDULER_STAGE, "first_scheduled", req.num_cached_tokens or 0,
                               t_ns=req.first_scheduled_ns)
        self.tracer.record(STEP, SCHEDULER_STAGE, "scheduled", plan.num_tokens)
        return requests

    def _trace_step(self, requests: list[Any] | None, plan: SchedulerOutput, result: StepOutput) -> None:
        if requests is not None and self.tracer.enabled:
            n = plan.num_tokens
            self.tracer.record(STEP, STEP_STAGE, "step_start", n, t_ns=result.start_ns)
            self.tracer.record(STEP, STEP_STAGE, "step_end", n, t_ns=result.end_ns)
            self._last_step = (requests, result.end_ns)

    # ------------------------------------------------------------------ steps on the model thread
    def _run_on_loop(self, inbox: ObjectReceiveStream[Any],
                     outbox: ObjectSendStream[Any]) -> asyncio.AbstractEventLoop | None:
        """The event loop that :meth:`_run_on` posts outputs to, or None where steps go one at a time (no
        model thread, another event loop than asyncio's, streams other than memory object streams, or
        ``$LLMINFER_STEPS_ON_MODEL_THREAD`` off)."""
        if self.model_thread is None or not self.steps_on_model_thread or not hasattr(inbox, "statistics") \
                or not hasattr(outbox, "send_nowait"):
            return None
        try:
            return asyncio.get_running_loop()
        except RuntimeError:
            return None

    def _run_on(self, plan: SchedulerOutput, inbox: ObjectReceiveStream[Any], outbox: ObjectSendStream[Any],
                loop: asyncio.AbstractEventLoop) -> tuple[SchedulerOutput | None, bool]:
        """Execute ``plan`` and apply its output on the model thread; then, while no message waits in either
        inbox, no other call waits for the model thread, requests remain, the outbox keeps up and at most
        ``RUN_ON_S`` has passed, post the step's output to ``loop``, schedule and execute the next step here
        too. Returns the last plan scheduled and whether a request failed in its scheduling, as
        :meth:`_schedule`; a non-empty plan was executed and applied, its output not yet emitted.

        Why: a step that returns to the event loop waits for two thread wake-ups (the loop's, then the model
        thread's): 0.34 ms of a 5.3 ms int8-wo batch-1 step on a 2-core Zen 4 VM. A run waits for one: the
        woken loop takes the GIL for its stages' Python before this thread gets it back. Measured there
        (``bench/bench_step_profile.py --quick --quant int8-wo``, ``LLMINFER_STEPS_ON_MODEL_THREAD=1`` and
        ``0`` alternating), the time between two steps' ``execute`` went from 0.69-0.75 to 0.58-0.59 ms.
        The event loop stays suspended in :meth:`ModelThread.run` meanwhile, so the scheduler is still used
        by one thread at a time; the loop runs the other stages (tokenize, detokenize, sink) meanwhile.
        """
        end = time.perf_counter() + RUN_ON_S
        while True:
            self._apply(plan, self._execute_here(plan))
            if not (self.scheduler.has_unfinished() and self._relay.backlog <= 1 and time.perf_counter() < end
                    and not message_waiting(self._direct) and not message_waiting(inbox)
                    and not self.model_thread.has_queued_calls()):  # another engine's step, an adapter load
                return plan, False
            self._relay.post(self._collect(plan.step_id), outbox, loop)
            next_plan, failed = self._schedule()
            if next_plan is None or not next_plan.sequences:
                return next_plan, failed
            plan = next_plan
            self.num_steps_run_on += 1

    # ------------------------------------------------------------------ the inbox
    def _take_waiting(self, inbox: ObjectReceiveStream[Any]) -> None:
        """Handle every message already in the direct inbox, then in the ordered inbox, without waiting."""
        while self._direct is not None:
            try:
                self._handle(self._direct.receive_nowait())
            except anyio.WouldBlock:
                break
            except (anyio.EndOfStream, anyio.ClosedResourceError):
                self._direct = None
        while self._inbox_open:
            try:
                self._handle(inbox.receive_nowait())
            except anyio.WouldBlock:
                return
            except (anyio.EndOfStream, anyio.ClosedResourceError):
                self._inbox_open = False

    async def _wait_for_work(self, inbox: ObjectReceiveStream[Any], timeout_s: float = math.inf) -> None:
        """Block while idle until a message arrives (at most ``timeout_s``), then give late arrivals
        ``batch_timeout_ms``."""
        try:
            with anyio.move_on_after(timeout_s) as scope:
                msg = await inbox.receive()
            if scope.cancelled_caught:
                return
            self._handle(msg)
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            self._inbox_open = False
            return
        if self.batch_timeout_s > 0 and self.scheduler.has_unfinished():
            with anyio.move_on_after(self.batch_timeout_s):
                while self._inbox_open and self.scheduler.num_waiting < self.scheduler.limits.max_batch_size:
                    try:
                        self._handle(await inbox.receive())
                    except (anyio.EndOfStream, anyio.ClosedResourceError):
                        self._inbox_open = False

    def _handle(self, msg: Any) -> None:
        try:
            self._dispatch(msg)
        except Exception:  # noqa: BLE001 - a message that cannot be handled is logged and dropped
            log.exception("engine core message failed", message=type(msg).__name__)

    def _dispatch(self, msg: Any) -> None:
        if isinstance(msg, TokenizedRequest):
            self._admit(msg)
        elif isinstance(msg, (Abort, FinishRequest)):
            self._finish(msg)
        elif isinstance(msg, Control):
            self._control(msg)
        else:
            self._passed_on.append(msg)  # RequestFailed, and messages of user stages

    def _admit(self, msg: TokenizedRequest) -> None:
        try:
            req = self.scheduler.add_request(msg)
        except LLMInferError as exc:  # CapacityError: it can never fit
            self._passed_on.append(RequestFailed(msg.request_id, exc))
            return
        except Exception as exc:  # noqa: BLE001 - one request's failure must not stop the core
            log.exception("admission failed", request_id=msg.request_id)
            self.scheduler.requests.pop(msg.request_id, None)
            self._passed_on.append(RequestFailed(msg.request_id, EngineError(f"admission: {type(exc).__name__}: {exc}")))
            return
        self.tracer.record(req.request_id, SCHEDULER_STAGE, "queued", req.num_prompt_tokens, t_ns=req.queued_ns)

    def _finish(self, msg: Abort | FinishRequest) -> None:
        """End a request on an abort or a stop-string finish; unknown ids (already finished) are ignored."""
        stop = isinstance(msg, FinishRequest)
        req = self.scheduler.finish_request(msg.request_id, msg.num_output_tokens if stop else None)
        if req is None:
            return
        stats = req.stats(time.perf_counter_ns())
        self.tracer.record(req.request_id, SCHEDULER_STAGE, "finished" if stop else "aborted")
        if stop:
            self._updates.append(SequenceUpdate(req.request_id, finish_reason="stop", stats=stats))
        else:
            self._updates.append(SequenceUpdate(req.request_id, finish_reason="abort", stats=stats,
                                                error=RequestAbortedError(f"request {msg.reason}")))

    def _fail(self, request_ids: list[str], exc: BaseException, where: str) -> None:
        """Fail ``request_ids`` with an EngineError naming ``exc`` and free what they hold, however
        inconsistent their state was left by the failure that got here."""
        sched = self.scheduler
        error = EngineError(f"the engine failed in {where}: {type(exc).__name__}: {exc}")
        now = time.perf_counter_ns()
        for rid in request_ids:
            req = sched.requests.get(rid)
            if req is None:
                continue
            try:
                sched.finish_request(rid)
            except Exception:  # noqa: BLE001 - take it out by hand
                sched.requests.pop(rid, None)
                for queue in (sched.running, sched.waiting):
                    with contextlib.suppress(ValueError):
                        queue.remove(req)
                with contextlib.suppress(Exception):
                    sched.kv.free(rid)
                self.backend.release([rid])
            self._updates.append(SequenceUpdate(rid, (), "error", error, stats=req.stats(now)))

    def _control(self, msg: Control) -> None:
        if msg.action == "reset_prefix_cache":
            self.scheduler.kv.reset_cache()
            if msg.done is not None:
                msg.done.set()
        elif msg.action == "drain":
            self._drains.append(msg.done)
        elif msg.action == "close":
            self._closing = True
        else:  # a user stage's typo must not stop the core
            log.error("unknown control action ignored", action=msg.action)
            if msg.done is not None:
                msg.done.set()

    # ------------------------------------------------------------------ output
    async def _emit(self, outbox: ObjectSendStream[Any], step_id: int) -> None:
        """Send what this step produced (passed-on messages first, in arrival order), then resolve the
        drains that are complete."""
        await self._relay.flush(outbox)
        for msg in self._collect(step_id):
            await outbox.send(msg)
        if self._drains and not self.scheduler.has_unfinished():
            for done in self._drains:
                done.set()
            self._drains.clear()

    def _collect(self, step_id: int) -> list[Any]:
        """Trace and record the stats of what the steps since the last emit produced; return what to send,
        in order: the passed-on messages, then one output of the updates (if any)."""
        if self.tracer.enabled:
            self._trace_updates()
        self._record_stats()
        messages, self._passed_on = self._passed_on, []
        if self._updates:
            messages.append(EngineStepOutput(step_id, tuple(self._updates), time.perf_counter_ns()))
            self._updates.clear()
        return messages

    def _record_stats(self) -> None:
        """Hand the stats of the steps since the last emit to the stat loggers, with the requests that
        ended (every final update, and every request failed before admission)."""
        it = self.scheduler.take_iteration_stats()
        if not self.stat_loggers:
            return
        for update in self._updates:
            if update.finish_reason is not None and update.stats is not None:
                it.finished.append(FinishedRequest.from_stats(update.finish_reason, update.stats))
        for msg in self._passed_on:
            if isinstance(msg, RequestFailed):
                it.finished.append(FinishedRequest("error", 0, 0, 0.0))
        if it:
            record_all(self.stat_loggers, it)

    def _trace_updates(self) -> None:
        requests, end_ns = self._last_step
        self._last_step = ([], 0)
        for req in requests:
            if req.prefill_done_ns == end_ns:
                self.tracer.record(req.request_id, SCHEDULER_STAGE, "prefill_done", req.num_prompt_tokens, t_ns=end_ns)
            if req.status is RequestStatus.FINISHED and req.request_id not in self.scheduler.requests:
                self.tracer.record(req.request_id, SCHEDULER_STAGE, "finished", req.num_generated, t_ns=end_ns)

    # ------------------------------------------------------------------ read-only views (any thread)
    def cache_stats(self) -> dict[str, Any]:
        """Prefix-cache and KV pool statistics (see :meth:`KVCacheManager.stats`)."""
        return self.scheduler.kv.stats()

    def scheduler_stats(self) -> dict[str, int]:
        """``running`` and ``waiting`` request counts."""
        return {"running": self.scheduler.num_running, "waiting": self.scheduler.num_waiting}

    def describe(self) -> dict[str, Any]:
        """KV capacity facts, the step budget, plus the backend's own (for ``engine.info()``)."""
        kv = self.scheduler.kv
        limits = self.scheduler.limits
        facts: dict[str, Any] = {"kv_blocks": kv.num_blocks, "kv_block_size": kv.block_size,
                                 "kv_tokens": kv.capacity_tokens, "prefix_cache": kv.enable_prefix_cache,
                                 "max_num_batched_tokens": limits.max_num_batched_tokens,
                                 "long_prefill_token_threshold": limits.long_prefill_token_threshold}
        describe = getattr(self.backend, "describe", None)
        if describe is not None:
            facts.update(describe())
        return facts


INBOX_CAPACITY = math.inf
"""The pipeline's head channel (the core's ordered inbox, through the front stages) is unbounded:
aborts and stop-string finishes sent back from downstream stages must never block, or the cycle
core → detokenize → inbox → core could deadlock. Admission control is the caller's (the HTTP layer's
``max_queue_size``); the inter-stage channels stay bounded."""
