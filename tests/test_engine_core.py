"""The engine core alone: its loop driven through its inbox, with a fake step backend (no model, no
tokenizer, no pipeline), and the waiting queues against a reference model."""

from __future__ import annotations

import time
import zlib
from typing import Any

import anyio
import anyio.lowlevel
import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from llminfer.core.engine_core import EngineCore
from llminfer.core.queues import PriorityWaitingQueue, WaitingQueue
from llminfer.core.scheduler import Scheduler, SchedulerLimits
from llminfer.kv.manager import KVCacheManager
from llminfer.protocols.messages import (
    Abort,
    Control,
    EngineStepOutput,
    SchedulerOutput,
    StepOutput,
    TokenizedRequest,
)
from llminfer.request import Request
from llminfer.sampling.params import SamplingParams

EOS = 0


def next_token(request_id: str, position: int) -> int:
    """The fake model: a token that depends only on the request and the position (never EOS)."""
    return zlib.crc32(f"{request_id}:{position}".encode()) % 50 + 1


class FakeBackend:
    """Samples :func:`next_token`; records every plan it ran and every release."""

    name = "fake"

    def __init__(self, fail_on_step: int | None = None) -> None:
        self.plans: list[SchedulerOutput] = []
        self.released: list[str] = []
        self.fail_on_step = fail_on_step

    def execute(self, plan: SchedulerOutput) -> StepOutput:
        self.plans.append(plan)
        now = time.perf_counter_ns()
        if plan.step_id == self.fail_on_step:
            return StepOutput(plan.step_id, {}, now, now, error=RuntimeError("boom"))
        sampled = {s.request_id: next_token(s.request_id, s.start_position + len(s.token_ids))
                   for s in plan.sequences if s.sample}
        return StepOutput(plan.step_id, sampled, now, now)

    def release(self, request_ids) -> None:
        self.released.extend(request_ids)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name}


def make_core(num_blocks: int = 64, block_size: int = 4, max_batch: int = 4, budget: int = 32,
              backend: FakeBackend | None = None) -> tuple[EngineCore, FakeBackend]:
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_cache=True)
    limits = SchedulerLimits(max_batch_size=max_batch, max_num_batched_tokens=budget, max_model_len=4096)
    backend = backend or FakeBackend()
    return EngineCore(Scheduler(limits, kv, eos_token_ids=(EOS,)), backend), backend


def request(rid: str, prompt_len: int = 6, max_new: int = 5) -> TokenizedRequest:
    return TokenizedRequest(rid, tuple(range(1, prompt_len + 1)), SamplingParams(max_new_tokens=max_new),
                            time.perf_counter_ns())


async def drive(core: EngineCore, messages: list[Any], outbox_size: int = 1000,
                reader_pauses: int = 0) -> list[EngineStepOutput]:
    """Send ``messages`` into the core's inbox, close it, and collect everything it emits (a slow reader
    with ``reader_pauses``: that many scheduling points after each item)."""
    send_in, inbox = anyio.create_memory_object_stream(100)
    outbox, receive_out = anyio.create_memory_object_stream(outbox_size)
    emitted: list[Any] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(core.run, inbox, outbox)
        async with send_in:
            for msg in messages:
                await send_in.send(msg)
        async with receive_out:
            async for item in receive_out:
                emitted.append(item)
                for _ in range(reader_pauses):
                    await anyio.lowlevel.checkpoint()
    return emitted


def tokens_by_request(emitted: list[Any]) -> tuple[dict[str, list[int]], dict[str, str]]:
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    for out in emitted:
        if not isinstance(out, EngineStepOutput):
            continue
        for update in out.updates:
            tokens.setdefault(update.request_id, []).extend(update.new_token_ids)
            if update.finish_reason is not None:
                reasons[update.request_id] = update.finish_reason
    return tokens, reasons


def test_core_generates_each_request_to_its_length_and_frees_every_block():
    core, backend = make_core()
    emitted = anyio.run(drive, core, [request(f"r{i}", prompt_len=3 + i, max_new=4 + i) for i in range(6)])
    tokens, reasons = tokens_by_request(emitted)
    for i in range(6):
        rid = f"r{i}"
        assert reasons[rid] == "length"
        assert tokens[rid] == [next_token(rid, 3 + i + k) for k in range(4 + i)]
    assert all(len(p.sequences) <= 4 and p.num_tokens <= 32 for p in backend.plans)
    assert core.scheduler.kv.pool.num_free_blocks == core.scheduler.kv.num_blocks
    assert core.scheduler_stats() == {"running": 0, "waiting": 0}


def test_abort_after_its_request_finishes_it_and_frees_its_blocks():
    core, backend = make_core()
    emitted = anyio.run(drive, core, [request("keep", max_new=6), request("gone", max_new=500), Abort("gone")])
    tokens, reasons = tokens_by_request(emitted)
    assert reasons["keep"] == "length" and len(tokens["keep"]) == 6
    assert tokens.get("gone", []) == []  # aborted before its first step: the abort arrived in the same inbox
    assert all("gone" not in {s.request_id for s in p.sequences} for p in backend.plans)
    assert core.scheduler.kv.pool.num_free_blocks == core.scheduler.kv.num_blocks


def test_failed_step_fails_the_requests_in_it_and_frees_their_blocks():
    core, backend = make_core(backend=FakeBackend(fail_on_step=0))
    emitted = anyio.run(drive, core, [request("a"), request("b")])
    _, reasons = tokens_by_request(emitted)
    in_failed_step = {s.request_id for s in backend.plans[0].sequences}
    assert in_failed_step and all(reasons[rid] == "error" for rid in in_failed_step)
    assert all(reasons[rid] == "length" for rid in {"a", "b"} - in_failed_step)
    assert core.scheduler.kv.pool.num_free_blocks == core.scheduler.kv.num_blocks


def test_drain_resolves_after_the_requests_before_it():
    core, _ = make_core()
    done = anyio.Event()
    emitted = anyio.run(drive, core, [request("a"), Control("drain", done)])
    assert done.is_set()
    assert tokens_by_request(emitted)[1] == {"a": "length"}


# ---------------------------------------------------------------- waiting queues against a reference model

def _req(i: int, priority: int) -> Request:
    return Request(request_id=f"q{i}", token_ids=[1], num_prompt_tokens=1, params=SamplingParams(),
                   arrival_ns=i, priority=priority, max_tokens_total=2)


@settings(max_examples=150, deadline=None)
@given(policy=st.sampled_from(["fcfs", "priority"]),
       ops=st.lists(st.tuples(st.sampled_from(["push", "push_front", "pop", "remove", "skip"]),
                              st.integers(0, 3), st.integers(0, 30)), max_size=60))
def test_waiting_queue_matches_a_reference_list(policy, ops):
    queue = PriorityWaitingQueue() if policy == "priority" else WaitingQueue()
    model: list[Request] = []  # in policy order
    key = (lambda r: (r.priority, r.arrival_ns)) if policy == "priority" else None
    counter = 0

    def insert(req: Request, front: bool) -> None:
        if key is not None:
            model.append(req)
            model.sort(key=key)
        elif front:
            model.insert(0, req)
        else:
            model.append(req)

    for op, priority, pick in ops:
        if op in ("push", "push_front"):
            counter += 1
            req = _req(counter, priority)
            getattr(queue, op)(req)
            insert(req, op == "push_front")
        elif op == "pop" and model:
            assert queue.peek() is model[0]
            assert queue.pop() is model.pop(0)
        elif op == "remove" and model:
            req = model.pop(pick % len(model))
            queue.remove(req)
            with pytest.raises(ValueError):
                queue.remove(req)
        elif op == "skip" and model:  # what admission does: pop a few, hand them back in order
            taken = [queue.pop() for _ in range(min(len(model), pick % 4 + 1))]
            assert taken == model[: len(taken)]
            queue.prepend(taken)
        assert len(queue) == len(model)
        assert sorted(r.request_id for r in queue) == sorted(r.request_id for r in model)
    if policy == "fcfs":
        assert list(queue) == model


# ---------------------------------------------------------------- the direct inbox (aborts and finishes)

class AbortingBackend(FakeBackend):
    """Puts an abort for ``request_id`` on the core's direct inbox while step ``at_step`` runs, as a client
    disconnect does while the stages before the core are busy."""

    def __init__(self, send, request_id: str, at_step: int) -> None:
        super().__init__()
        self.send, self.request_id, self.at_step = send, request_id, at_step

    def execute(self, plan: SchedulerOutput) -> StepOutput:
        if plan.step_id == self.at_step:
            self.send.send_nowait(Abort(self.request_id))
        return super().execute(plan)


def test_an_abort_on_the_direct_inbox_ends_its_request_at_the_next_step():
    send_direct, direct = anyio.create_memory_object_stream(100)
    backend = AbortingBackend(send_direct, "long", at_step=3)
    core, _ = make_core(backend=backend)
    core.bind_direct(direct)
    emitted = anyio.run(drive, core, [request("long", max_new=50)])
    tokens, reasons = tokens_by_request(emitted)
    assert reasons["long"] == "abort"
    assert len(tokens["long"]) == 4  # steps 0..3 ran; nothing after the abort
    assert core.scheduler.kv.pool.num_free_blocks == core.scheduler.kv.num_blocks


def test_pipeline_sends_finishes_direct_and_aborts_both_ways():
    from llminfer.pipeline import Pipeline
    from llminfer.protocols.messages import FinishRequest

    class Recorder:
        name = "recorder"

        def __init__(self):
            self.ordered, self.direct = [], []

        def bind_direct(self, inbox):
            self.direct_inbox = inbox

        async def run(self, inbox, outbox):
            async with outbox:
                async for msg in inbox:
                    if isinstance(msg, Control) and msg.action == "close":
                        return
                    self.ordered.append(msg)
                    while True:
                        try:
                            self.direct.append(self.direct_inbox.receive_nowait())
                        except anyio.WouldBlock:
                            break

    class NullSink:
        name = "sink"

        def open(self, request_id):
            return anyio.create_memory_object_stream(1)[1]

        def close(self, request_id):
            return True

        def fail_all(self, error):
            pass

        async def run(self, inbox, outbox):
            async with outbox:
                async for _ in inbox:
                    pass

    recorder = Recorder()

    async def main():
        async with Pipeline([recorder, NullSink()]) as pipeline:
            pipeline.send_nowait(FinishRequest("a", 3))
            pipeline.send_nowait(Abort("b"))
            pipeline.send_nowait(Control("drain"))
            for _ in range(10):
                await anyio.lowlevel.checkpoint()

    anyio.run(main)
    assert [type(m).__name__ for m in recorder.direct] == ["FinishRequest", "Abort"]
    assert [type(m).__name__ for m in recorder.ordered][:2] == ["Abort", "Control"]
