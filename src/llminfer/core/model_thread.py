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
:meth:`ModelThread.close` (a later call starts a fresh thread). ``LLMINFER_MODEL_THREAD=0`` makes
:func:`model_thread_enabled` False: the engine then loads in the calling thread and steps on anyio's
worker threads, as before this module existed (for comparison).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
import anyio.lowlevel
import anyio.to_thread

T = TypeVar("T")

ENV = "LLMINFER_MODEL_THREAD"


def model_thread_enabled() -> bool:
    """False when ``$LLMINFER_MODEL_THREAD`` is ``0`` / ``false`` / ``off`` / ``no``."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "off", "no")


class ModelThread:
    """Runs calls on one dedicated thread (named ``llminfer-model``), one at a time, in submission order.

    Safe to use from any thread and from async code on any anyio backend. A call made from the model
    thread itself runs inline (no deadlock when a model-thread task loads something that also asks for
    the model thread).
    """

    def __init__(self, name: str = "llminfer-model") -> None:
        self.name = name
        self._lock = threading.Lock()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._ident: int | None = None
        # A forked child has none of the parent's threads: it starts its own model thread when it needs one.
        ref = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: (thread := ref()) is not None and thread._forget())

    def _forget(self) -> None:
        self._lock = threading.Lock()
        self._pool = None
        self._ident = None

    def _remember_ident(self) -> None:
        self._ident = threading.get_ident()

    def on_thread(self) -> bool:
        """True when called from the model thread."""
        return self._ident is not None and threading.get_ident() == self._ident

    def submit(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        """Queue ``fn(*args)`` on the model thread (started if need be); returns its future.

        Raises:
            RuntimeError: the interpreter is shutting down (``concurrent.futures`` takes no new work then).
        """
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=self.name,
                                                                   initializer=self._remember_ident)
            return self._pool.submit(fn, *args)

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
        """Let the thread finish what was submitted, then end it (idempotent; a later call starts a new one)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is None:
            return
        on_thread = self.on_thread()
        self._ident = None
        pool.shutdown(wait=not on_thread)  # a model-thread task closing it cannot join its own thread
