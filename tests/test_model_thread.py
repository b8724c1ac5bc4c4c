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


_EXIT_WITH_RUNNING_THREADS = """
import sys, threading
from llminfer import EngineConfig, InferenceEngine
engine = InferenceEngine(EngineConfig(model_name=sys.argv[1], max_batch_size=4))
engine.run("warm", max_new_tokens=2)
started = threading.Barrier(3)
def work(k):
    started.wait()
    try:
        first = engine.run(f"job {k}", max_new_tokens=24, ignore_eos=True)
        second = engine.run(f"again {k}", max_new_tokens=3, ignore_eos=True)
        line = f"ok {k} {len(first.token_ids)} {len(second.token_ids)}\\n"
    except Exception as exc:
        line = f"FAILED {k} {exc!r}\\n"
    sys.stdout.write(line)  # one write per line: print() writes its pieces separately, and two threads interleave them
    sys.stdout.flush()
for k in range(2):
    threading.Thread(target=work, args=(k,)).start()
started.wait()
"""  # the main thread returns at once: the interpreter joins the two workers before it shuts down


def test_requests_of_threads_still_running_at_exit_complete():
    """Python joins non-daemon threads at exit, after ``concurrent.futures`` has shut its pools down: the
    model thread is not such a pool, so those threads' requests (and new ones) still run."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _EXIT_WITH_RUNNING_THREADS, str(builtin_model_path())],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert sorted(done.stdout.split("\n")[:2]) == ["ok 0 24 3", "ok 1 24 3"], done.stdout + done.stderr[-2000:]


def test_close_from_another_thread_inside_running_leaves_no_model_thread():
    """close() while ``async with engine.running()`` serves: the streams finish, and once ``running()``
    exits the engine holds no share of the model thread (its steps after close() had taken one again),
    so no model thread is left that was not there before."""
    before = set(threading.enumerate())

    async def main(eng):
        async with eng.running():
            async def stream(k):
                return [c async for c in eng.generate(f"p {k}", max_new_tokens=40, ignore_eos=True)]

            async with anyio.create_task_group() as tg:
                results = []
                for k in range(3):
                    tg.start_soon(lambda k=k: _append(results, stream(k)))
                await anyio.sleep(0)  # let the requests in
                await anyio.to_thread.run_sync(eng.close)
            assert len(results) == 3 and all(r[-1].finish_reason == "length" for r in results)

    eng = make_engine(builtin_model_path(), max_batch_size=4)
    eng.load()
    anyio.run(main, eng)
    left = [t for t in set(threading.enumerate()) - before if t.is_alive() and t.name.startswith("llminfer-model")]
    assert left == [] and not eng.model_thread.held


async def _append(results, coro):
    results.append(await coro)


def test_async_admission_waits_for_an_adapter_change_without_blocking_the_loop():
    """While an adapter change holds the admission lock (a load can take seconds), a request arriving on
    the server's loop waits for it in a worker thread: the loop keeps running, and the request runs after."""
    eng = make_engine(builtin_model_path(), max_batch_size=2)
    eng.load()

    async def main():
        async with eng.running():
            out: list = []

            async def stream():
                return [c async for c in eng.generate("hi", max_new_tokens=3, ignore_eos=True)]

            eng._admission.lock.acquire()  # as load_adapter / set_adapter / unload_adapter hold it
            with anyio.fail_after(60):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(_append, out, stream())
                    for _ in range(3):
                        await anyio.sleep(0.01)  # the loop runs other tasks meanwhile
                    assert out == []
                    eng._admission.lock.release()
            assert len(out) == 1 and out[0][-1].finish_reason == "length"

    try:
        anyio.run(main)
    finally:
        eng.close()


def test_engines_of_a_process_share_one_model_thread():
    """Two engines load and step on the same thread (one OpenMP team, however many engines are loaded);
    the thread ends when the last engine holding a share closes, and a share taken again after close()
    (an engine used afterwards) is given back by the next close()."""
    def steps_on(eng):
        seen = []
        execute = eng.backend.execute
        eng.backend.execute = lambda plan: seen.append(threading.get_ident()) or execute(plan)
        try:
            eng.run("hi", max_new_tokens=2, ignore_eos=True)
        finally:
            del eng.backend.execute
        return set(seen)

    first, second = make_engine(builtin_model_path(), max_batch_size=2), make_engine(builtin_model_path())
    try:
        shared = first.model_thread.call(threading.get_ident)
        assert second.model_thread.call(threading.get_ident) == shared
        assert steps_on(first) == steps_on(second) == {shared}
    finally:
        first.close()
        assert not first.model_thread.held and second.model_thread.held
        assert second.model_thread.call(threading.get_ident) == shared  # still running for the second
        second.close()
    assert first.model_thread.call(threading.get_ident) is not None and first.model_thread.held
    first.model_thread.close()
    assert not first.model_thread.held
