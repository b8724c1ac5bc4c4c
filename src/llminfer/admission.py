"""Admission of requests against LoRA adapter changes.

A request is stamped with the adapter active when it was made. It is checked against the active adapter
and counted in flight under one lock, and an adapter change checks that nothing is in flight and makes
the change under the same lock, so no request admitted for one adapter runs under another.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import anyio.to_thread

from llminfer.errors import InvalidRequestError
from llminfer.protocols.messages import GenerationRequest


class Admission:
    """The admission lock and the count of requests in flight.

    Args:
        active_adapter: returns the active adapter's name (None: the base model).

    Attributes:
        lock: held by an adapter change for its whole length (no request is admitted meanwhile).
        in_flight: requests admitted and not yet released.
    """

    def __init__(self, active_adapter: Callable[[], str | None]) -> None:
        self.lock = threading.Lock()
        self.in_flight = 0
        self._active_adapter = active_adapter

    def check(self, request: GenerationRequest) -> None:
        """Raises InvalidRequestError (``param="adapter_name"``) when ``request`` was made for another adapter
        than the active one."""
        active = self._active_adapter()
        if request.adapter_name != active:
            raise InvalidRequestError(
                f"the request was made for adapter {request.adapter_name!r} but the active adapter is "
                f"{active!r}; make it again (make_request stamps the active adapter)", param="adapter_name")

    @contextlib.contextmanager
    def admitted(self, requests: Sequence[GenerationRequest]) -> Iterator[None]:
        """Check the requests' adapter stamps and count them in flight until the block ends (sync callers).

        Raises:
            InvalidRequestError: see :meth:`check` (then none is admitted).
        """
        with self.lock:
            for request in requests:
                self.check(request)
            self.in_flight += len(requests)
        try:
            yield
        finally:
            self.release(len(requests))

    async def admit(self, request: GenerationRequest) -> None:
        """:meth:`admitted` for one request on an event loop, without the block: call :meth:`release` when
        it ends. The lock is taken in a worker thread when an adapter change holds it (a load can take
        seconds), so the loop never blocks on it.

        Raises:
            InvalidRequestError: see :meth:`check`.
        """
        if not self.lock.acquire(blocking=False):
            acquired: list[bool] = []
            try:
                await anyio.to_thread.run_sync(lambda: acquired.append(self.lock.acquire()))
            except BaseException:
                if acquired:  # the worker got the lock, then the caller was cancelled
                    self.lock.release()
                raise
        try:
            self.check(request)
            self.in_flight += 1
        finally:
            self.lock.release()

    def release(self, count: int) -> None:
        """``count`` admitted requests have finished."""
        with self.lock:
            self.in_flight -= count

    def change_adapters(self, engine: Any, what: str, change: Callable[[Any], Any],
                        then: Callable[[], None] | None = None) -> Any:
        """One adapter change of ``engine``: under the lock (no request is admitted meanwhile), refused while
        requests are in flight (:meth:`llminfer.adapters.AdapterManager.checked`, which says ``what`` was
        refused), ``change(manager)`` on the engine's model thread, then ``then()`` still under the lock.

        Returns:
            What ``change`` returned.

        Raises:
            BackendUnavailableError: PEFT is missing, or the backend has no transformers model.
            EngineError: requests are in flight. Whatever ``change`` raises.
        """
        from llminfer.adapters import AdapterManager

        with self.lock:
            engine.adapter_manager = manager = AdapterManager.checked(engine, what)
            result = engine._on_model_thread(change, manager)
            if then is not None:
                then()
            return result
