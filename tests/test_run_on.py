"""The engine core's runs of steps on the model thread (``EngineCore._run_on``): the fake step backend of
``test_engine_core`` on a real model thread, against the same core stepping one step at a time; and the real
engine with runs on and off."""

from __future__ import annotations

import threading
import time

import anyio
import pytest
from test_engine_core import FakeBackend, drive, make_core, next_token, request, tokens_by_request

from helpers import make_engine
from llminfer.core.model_thread import ModelThread
from llminfer.errors import EngineError
from llminfer.models import builtin_model_path
from llminfer.protocols.messages import Abort, EngineStepOutput, RequestFailed


@pytest.fixture
def model_thread():
    thread = ModelThread("test-run-on")
    yield thread
    thread.close()


def _all_free(core) -> bool:
    kv = core.scheduler.kv
    return kv.pool.num_free_blocks == kv.num_blocks and core.scheduler_stats() == {"running": 0, "waiting": 0}


def test_runs_on_the_model_thread_emit_what_single_steps_emit_in_order(model_thread):
    messages = [request(f"r{i}", prompt_len=3 + i, max_new=20 + i) for i in range(6)]
    single, _ = make_core()
    expected = tokens_by_request(anyio.run(drive, single, messages))
    core, _ = make_core()
    core.model_thread = model_thread
    emitted = anyio.run(drive, core, messages)
    assert tokens_by_request(emitted) == expected
    assert core.num_steps_run_on > 0  # the steps did run on without the event loop
    step_ids = [out.step_id for out in emitted if isinstance(out, EngineStepOutput) and out.step_id >= 0]
    assert step_ids == sorted(set(step_ids))  # posted outputs arrive once each, in step order
    assert _all_free(core)


def test_a_slow_reader_of_a_one_slot_outbox_gets_every_output(model_thread):
    """Outputs the outbox cannot take at once wait in the relay, and the run hands back to the loop."""
    core, _ = make_core()
    core.model_thread = model_thread
    emitted = anyio.run(drive, core, [request(f"r{i}", max_new=30) for i in range(3)], 1, 20)
    tokens, reasons = tokens_by_request(emitted)
    assert reasons == {f"r{i}": "length" for i in range(3)}
    assert tokens == {f"r{i}": [next_token(f"r{i}", 6 + k) for k in range(30)] for i in range(3)}
    assert core._relay.backlog == 0 and _all_free(core)


class GatedBackend(FakeBackend):
    """Blocks (on the model thread) in the step ``gate_step`` until ``gate`` is set; every step takes at
    least a millisecond, so the event loop keeps up with the outputs and runs go on past the gate."""

    def __init__(self, gate_step: int) -> None:
        super().__init__()
        self.gate_step = gate_step
        self.gate = threading.Event()

    def execute(self, plan):
        if plan.step_id == self.gate_step:
            assert self.gate.wait(30), "the test never opened the gate"
        time.sleep(0.001)
        return super().execute(plan)


def _gated(model_thread, first, at_gate):
    """Run a core with :class:`GatedBackend` (gate at step 3) on ``model_thread`` with ``first`` in its inbox;
    ``await at_gate(send_in, task_group, backend)`` runs on the event loop while the model thread waits at the gate (it
    returns True to stop reading), then the gate opens. Returns the core, its backend and what it emitted."""
    backend = GatedBackend(gate_step=3)
    core, _ = make_core(num_blocks=1100, backend=backend)
    core.model_thread = model_thread

    async def go():
        send_in, inbox = anyio.create_memory_object_stream(100)
        outbox, receive_out = anyio.create_memory_object_stream(1000)
        emitted = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(core.run, inbox, outbox)
            await send_in.send(first)
            async for item in receive_out:
                emitted.append(item)
                if not backend.gate.is_set() and len(backend.plans) >= 3:
                    stop = await at_gate(send_in, tg, backend)
                    backend.gate.set()
                    if stop:
                        break
        return emitted

    return core, backend, anyio.run(go)


def test_an_abort_ends_a_run_on_the_model_thread_and_frees_the_request(model_thread):
    async def abort(send_in, tg, backend):
        await send_in.send(Abort("long"))
        await send_in.aclose()

    core, _, emitted = _gated(model_thread, request("long", max_new=4000), abort)
    tokens, reasons = tokens_by_request(emitted)
    assert reasons == {"long": "abort"}
    assert len(tokens["long"]) in (3, 4)  # the run handed back at the first check after the abort arrived
    assert core.num_steps_run_on > 0 and _all_free(core)


def test_a_message_passed_on_at_the_start_of_a_run_reaches_the_outbox(model_thread):
    """A failure from an upstream stage, taken from the inbox just before a run starts, is sent by the run."""
    failed = RequestFailed("upstream", EngineError("failed in a stage before the core"))

    async def fail_upstream(send_in, tg, backend):
        await send_in.send(failed)
        await send_in.aclose()

    core, _, emitted = _gated(model_thread, request("long", max_new=60), fail_upstream)
    assert failed in emitted
    assert tokens_by_request(emitted)[1] == {"long": "length"}
    assert core.num_steps_run_on > 0 and _all_free(core)


def test_a_call_queued_for_the_model_thread_ends_the_run(model_thread):
    """Another engine's step or an adapter load waits at most one step behind a run."""
    queued = []

    async def queue_a_call(send_in, tg, backend):
        await send_in.aclose()
        queued.append(model_thread.submit(lambda: len(backend.plans)))  # the steps run when it gets its turn

    core, _, _ = _gated(model_thread, request("long", max_new=400), queue_a_call)
    assert queued[0].result(timeout=30) in (3, 4)
    assert core.num_steps_run_on > 0 and _all_free(core)


def test_a_cancelled_core_returns_from_a_run_on_the_model_thread_and_frees_what_it_held(model_thread):
    async def cancel(send_in, tg, backend):
        tg.cancel_scope.cancel()  # the core is inside a run on the model thread, held in step 3
        return True

    core, backend, emitted = _gated(model_thread, request("long", max_new=4000), cancel)
    assert "long" not in tokens_by_request(emitted)[1]  # cut off, not finished
    assert "long" in backend.released and _all_free(core)


def test_the_engine_gives_the_same_tokens_with_runs_on_and_off():
    engine = make_engine(builtin_model_path(), max_batch_size=4)
    try:
        prompts = ["Hello there", "The paged cache", "One two three", "x"]
        outputs = {}
        for on in (True, False):
            engine.core.steps_on_model_thread = on
            before = engine.core.num_steps_run_on
            results = engine.run_requests([engine.make_request(p, max_new_tokens=24, ignore_eos=True)
                                           for p in prompts])
            outputs[on] = [r.token_ids for r in results]
            ran_on = engine.core.num_steps_run_on - before
            assert (ran_on > 0) == on
        assert outputs[True] == outputs[False]
        assert engine.cache_stats()["blocks_used"] == 0
    finally:
        engine.close()
