"""One long-lived thread for an engine's torch work: loading the model, warm-up and every step.

Why: torch's CPU kernels run their parallel regions on OpenMP, and libgomp keeps one thread team per
thread that starts a region. When the model is loaded on one thread and its steps run on whichever worker
thread ``anyio.to_thread`` hands out, the process ends up with several teams. Once libgomp manages more
threads than there are CPUs it cuts the time its idle threads spin from about 300,000 iterations to 1,000
(libgomp's ``GOMP_SPINCOUNT`` throttling), so between two of a step's parallel regions (a decode step has
one or more per linear layer) the team's threads go to sleep and each region waits for them to wake.
Measured on a 2-core AMD EPYC (Zen 4), batch-1 decode of the ~114M bench model, steps on anyio's workers
against load and steps on one thread (``python bench/bench_model_thread.py --rounds 1``, one process per
setting): fp32 eager 30.9 -> 24.1 ms per token, fp32 compiled 29.7 -> 21.2, int8-wo eager 20.6 -> 14.0,
int8-wo compiled 19.6 -> 13.3.

A :class:`ModelThread` runs submitted calls one at a time, in order, on one thread that lives until
:meth:`ModelThread.close` (a later call starts a fresh thread). Every engine of a process gets a share of
the same one (:func:`shared_model_thread`, :class:`ModelThreadLease`): a thread per engine would bring back
several OpenMP teams as soon as two engines are loaded. ``LLMINFER_MODEL_THREAD=0`` makes
:func:`model_thread_enabled` False: the engine then loads in the calling thread and steps on anyio's
worker threads, as before this module existed (for comparison).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import queue
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import anyio.lowlevel
import anyio.to_thread

from llminfer.env import env_flag

if TYPE_CHECKING:
    from llminfer.core.threads import ThreadGovernor

T = TypeVar("T")

ENV = "LLMINFER_MODEL_THREAD"


def model_thread_enabled() -> bool:
    """False when ``$LLMINFER_MODEL_THREAD`` is ``0`` / ``false`` / ``off`` / ``no``."""
    return env_flag(ENV)


class ModelThread:
    """Runs calls on one dedicated thread (named ``llminfer-model``), one at a time, in submission order.

    Safe to use from any thread and from async code on any anyio backend. A call made from the model
    thread itself runs inline (no deadlock when a model-thread task loads something that also asks for
    the model thread). The thread is a daemon of llminfer's own, not a ``concurrent.futures`` pool: that
    module's exit hook shuts every pool down before the interpreter joins the user's threads, which would
    fail the requests those threads still run at exit.
    """

    def __init__(self, name: str = "llminfer-model") -> None:
        self.name = name
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._queue: queue.SimpleQueue[_Call | None] | None = None
        # A forked child has none of the parent's threads: it starts its own model thread when it needs one.
        ref = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: (thread := ref()) is not None and thread._forget())

    def _forget(self) -> None:
        self._lock = threading.Lock()
        self._thread = None
        self._queue = None

    def on_thread(self) -> bool:
        """True when called from the model thread."""
        thread = self._thread
        return thread is not None and threading.get_ident() == thread.ident

    def has_queued_calls(self) -> bool:
        """Whether calls wait behind the running one (a long call may end early to let them in)."""
        calls = self._queue
        return calls is not None and not calls.empty()

    def submit(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        """Queue ``fn(*args)`` on the model thread (started if need be); returns its future."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._lock:
            if self._thread is None:
                self._queue = queue.SimpleQueue()
                self._thread = threading.Thread(target=_serve, args=(self._queue,), name=self.name, daemon=True)
                self._thread.start()
            self._queue.put((future, fn, args))  # type: ignore[union-attr]
        return future

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on the model thread and wait for it (inline when already on it).

        Raises:
            Exception: whatever ``fn`` raises.
        """
        if self.on_thread():
            return fn(*args)
        return self.submit(fn, *args).result()

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Await ``fn(*args)`` on the model thread. A cancelled caller still waits for the call to end
        (a step is never left running behind its caller's back), then sees the cancellation.

        Raises:
            Exception: whatever ``fn`` raises.
        """
        future = self.submit(fn, *args)
        with anyio.CancelScope(shield=True):
            try:
                asyncio.get_running_loop()
            except RuntimeError:  # another event loop (trio): wait in a worker thread
                waited = anyio.to_thread.run_sync(concurrent.futures.wait, [future])
            else:
                waited = asyncio.wrap_future(future)
            await waited
        await anyio.lowlevel.checkpoint_if_cancelled()
        return future.result()

    def close(self) -> None:
        """Let the thread finish what was submitted, then end it (idempotent; a later call starts a new one).
        Called from the model thread itself, it returns at once and the thread ends after the current call."""
        with self._lock:
            thread, calls = self._thread, self._queue
            self._thread = self._queue = None
        if thread is None or calls is None:
            return
        calls.put(None)
        if threading.get_ident() != thread.ident:  # a model-thread task closing it cannot join its own thread
            thread.join()


_Call = tuple[concurrent.futures.Future, Callable[..., Any], tuple[Any, ...]]


def _serve(calls: queue.SimpleQueue[_Call | None]) -> None:
    """The model thread's loop: run each queued call into its future until the ``None`` that ends it."""
    while (item := calls.get()) is not None:
        future, fn, args = item
        if not future.set_running_or_notify_cancel():
            continue
        try:
            result = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, as concurrent.futures does
            future.set_exception(exc)
        else:
            future.set_result(result)


class ModelThreadLease:
    """One engine's share of the process-wide model thread (:func:`shared_model_thread`), with
    :class:`ModelThread`'s interface.

    Why one thread for every engine in the process: each thread that runs torch work keeps its own OpenMP
    team, idle or not, and with two or more teams libgomp manages more threads than there are CPUs and
    throttles its spin, which is what the model thread exists to avoid. Measured on a 2-core AMD EPYC
    (Zen 4), int8-wo batch-1 decode: 6.7 ms per token with one engine loaded, 13.9 with two more engines
    loaded and idle on threads of their own, 7.5 once their threads ended. Engines of one process step one
    at a time on the shared thread; on a CPU they share the same cores anyway.

    :meth:`close` gives the share back; the thread ends when no engine holds one (a later call takes a
    share again, so an engine used after :meth:`close` still works and its next ``close`` gives it back).
    """

    def __init__(self, thread: ModelThread, threads: ThreadGovernor | None = None) -> None:
        self._thread = thread
        # The engine's thread count, set on the model thread before each of its calls (OpenMP keeps it per
        # thread, so engines sharing the thread each run with their own; see llminfer.core.threads).
        self.threads = threads
        self._lock = threading.Lock()
        self.held = False
        self._take()

    def _take(self) -> None:
        with self._lock:
            if not self.held:
                _change_users(+1)
                self.held = True

    def on_thread(self) -> bool:
        """True when called from the model thread."""
        return self._thread.on_thread()

    def has_queued_calls(self) -> bool:
        """:meth:`ModelThread.has_queued_calls`."""
        return self._thread.has_queued_calls()

    def submit(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        """:meth:`ModelThread.submit` (taking a share again after :meth:`close`)."""
        self._take()
        return self._thread.submit(self._governed(fn), *args)

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """:meth:`ModelThread.call` (taking a share again after :meth:`close`)."""
        self._take()
        return self._thread.call(self._governed(fn), *args)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """:meth:`ModelThread.run` (taking a share again after :meth:`close`)."""
        self._take()
        return await self._thread.run(self._governed(fn), *args)

    def _governed(self, fn: Callable[..., T]) -> Callable[..., T]:
        return fn if self.threads is None else self.threads.wrap(fn)

    def close(self) -> None:
        """Give this engine's share back (idempotent); the last one ends the thread, after what was
        submitted (see :meth:`ModelThread.close`)."""
        with self._lock:
            if not self.held:
                return
            self.held = False
        if _change_users(-1) == 0:
            self._thread.close()


_SHARED = ModelThread()
_users_lock = threading.Lock()
_users = 0


def _change_users(delta: int) -> int:
    global _users
    with _users_lock:
        _users += delta
        return _users


def _forget_users() -> None:
    global _users_lock, _users
    _users_lock, _users = threading.Lock(), 0


os.register_at_fork(after_in_child=_forget_users)


def shared_model_thread(threads: ThreadGovernor | None = None) -> ModelThreadLease:
    """A share of the process-wide model thread, for one engine (see :class:`ModelThreadLease`), whose calls
    run with ``threads``' count (None: whatever count the thread has)."""
    return ModelThreadLease(_SHARED, threads)
