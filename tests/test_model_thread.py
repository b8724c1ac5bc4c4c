"""The engine's one model thread (``llminfer.core.model_thread``): calls run on one thread in order, async
callers wait for their call even when cancelled, and the engine loads and steps there (or, with
``LLMINFER_MODEL_THREAD=0``, loads in the caller and steps on anyio's workers)."""

from __future__ import annotations

import os
import threading

import anyio
import pytest

from helpers import make_engine
from llminfer.core import model_thread as mt
from llminfer.models import builtin_model_path


def test_calls_run_on_one_thread_in_order_and_inline_from_it():
    thread = mt.ModelThread()
    try:
        seen: list[tuple[int, int]] = []
        futures = [thread.submit(lambda i=i: seen.append((i, threading.get_ident()))) for i in range(20)]
        for f in futures:
            f.result()
        assert [i for i, _ in seen] == list(range(20))
        idents = {ident for _, ident in seen}
        assert len(idents) == 1 and threading.get_ident() not in idents
        assert not thread.on_thread()
        # A model-thread task that asks for the model thread runs inline instead of waiting on itself.
        assert thread.call(lambda: thread.call(lambda: (thread.on_thread(), threading.get_ident()))) == (
            True, idents.pop())
        with pytest.raises(ZeroDivisionError):
            thread.call(lambda: 1 / 0)
    finally:
        thread.close()


def test_close_ends_the_thread_and_a_later_call_starts_another():
    thread = mt.ModelThread()
    first = thread.call(threading.current_thread)
    thread.close()
    assert not first.is_alive()
    second = thread.call(threading.current_thread)
    assert second is not first and second.is_alive() and second.name.startswith("llminfer-model")
    thread.close()
    thread.close()  # idempotent


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_forked_child_starts_its_own_thread():
    thread = mt.ModelThread()
    thread.call(threading.get_ident)  # the parent's model thread exists, and is idle
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the parent's model thread does not exist here; without the fork hook the
        try:      # call would queue for it forever (thread idents may repeat across a fork: not compared)
            started = thread.submit(threading.current_thread).result(timeout=30)
            ok = started.is_alive() and started.name.startswith("llminfer-model") and not thread.on_thread()
            os.write(write, b"ok" if ok else b"no")
        except BaseException:
            os.write(write, b"no")
        finally:
            os._exit(0)
    os.close(write)
    try:
        assert os.read(read, 2) == b"ok"
    finally:
        os.close(read)
        os.waitpid(pid, 0)
        thread.close()


@pytest.mark.parametrize("asyncio_path", [True, False])
def test_async_run_returns_raises_and_is_not_abandoned_on_cancel(monkeypatch, asyncio_path):
    if not asyncio_path:  # the path for event loops other than asyncio's: wait in a worker thread
        def no_loop():
            raise RuntimeError("no running event loop")
        monkeypatch.setattr(mt.asyncio, "get_running_loop", no_loop)
    thread = mt.ModelThread()
    release, finished = threading.Event(), threading.Event()

    def slow() -> str:
        release.wait(30)
        finished.set()
        return "done"

    async def go() -> tuple[int, bool, bool]:
        value = await thread.run(lambda: 6 * 7)
        with pytest.raises(ZeroDivisionError):
            await thread.run(lambda: 1 / 0)
        with anyio.CancelScope() as scope:
            scope.cancel()  # cancelled before the call even starts ...
            threading.Timer(0.05, release.set).start()
            await thread.run(slow)  # ... still waits for it to finish, then raises the cancellation
            pytest.fail("a cancelled caller got the result")
        return value, finished.is_set(), scope.cancelled_caught

    try:
        value, finished_before_return, cancelled = anyio.run(go)
    finally:
        release.set()
        thread.close()
    assert value == 42 and finished_before_return and cancelled


@pytest.fixture(scope="module")
def engine():
    with make_engine(builtin_model_path(), max_batch_size=4) as eng:
        yield eng


def test_engine_loads_and_steps_on_its_model_thread(engine):
    assert engine.model_thread is not None and engine.core.model_thread is engine.model_thread
    load_thread = engine.model_thread.call(threading.current_thread)
    steps: list[threading.Thread] = []
    execute = engine.backend.execute

    def recording(plan):
        steps.append(threading.current_thread())
        return execute(plan)

    engine.backend.execute = recording
    try:
        engine.run("Hello", max_new_tokens=3, ignore_eos=True)
        engine.run_batch(["a", "b c"], max_new_tokens=2, ignore_eos=True)
    finally:
        del engine.backend.execute
    assert steps and {t.ident for t in steps} == {load_thread.ident}


def test_switched_off_by_environment(monkeypatch):
    monkeypatch.setenv(mt.ENV, "0")
    assert not mt.model_thread_enabled()
    with make_engine(builtin_model_path(), max_batch_size=2) as eng:
        assert eng.model_thread is None and eng.core.model_thread is None
        assert eng.run("Hi", max_new_tokens=2, ignore_eos=True).token_ids
    monkeypatch.setenv(mt.ENV, "1")
    assert mt.model_thread_enabled()
