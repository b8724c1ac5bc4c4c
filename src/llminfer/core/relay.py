"""Step outputs handed from the model thread to the event loop, for the engine core's runs of steps on the
model thread (:meth:`llminfer.core.engine_core.EngineCore._run_on`)."""

from __future__ import annotations

import asyncio
import collections
from typing import Any

import anyio
from anyio.abc import ObjectReceiveStream, ObjectSendStream

from llminfer.env import env_flag

ENV = "LLMINFER_STEPS_ON_MODEL_THREAD"
RUN_ON_S = 0.05  # the longest run of steps on the model thread before the core's loop looks at cancellation


def steps_on_model_thread_enabled() -> bool:
    """False when ``$LLMINFER_STEPS_ON_MODEL_THREAD`` is ``0`` / ``false`` / ``off`` / ``no``: steps then
    return to the event loop one at a time (for comparison)."""
    return env_flag(ENV)


def message_waiting(inbox: ObjectReceiveStream[Any] | None) -> bool:
    """Whether a message waits in ``inbox`` (a memory object stream; safe to ask from another thread: it
    reads a length)."""
    return inbox is not None and inbox.statistics().current_buffer_used > 0  # type: ignore[attr-defined]


class OutputRelay:
    """Outputs posted from another thread (:meth:`post`) reach ``outbox`` in posting order: the event loop
    sends what the outbox takes without waiting as soon as it runs, and :meth:`flush` (on the event loop,
    before the core sends anything itself) waits for room for the rest."""

    def __init__(self) -> None:
        self._unsent: collections.deque[Any] = collections.deque()
        self._flushing = False  # flush() is sending: _send_nowait leaves the queue to it

    @property
    def backlog(self) -> int:
        """Outputs posted and not yet in the outbox."""
        return len(self._unsent)

    def post(self, items: list[Any], outbox: ObjectSendStream[Any], loop: asyncio.AbstractEventLoop) -> None:
        """From any thread: queue ``items`` for ``outbox`` and wake ``loop`` once to send them.

        Raises:
            RuntimeError: ``loop`` is closed.
        """
        if items:
            self._unsent.extend(items)
            loop.call_soon_threadsafe(self._send_nowait, outbox)

    def _send_nowait(self, outbox: ObjectSendStream[Any]) -> None:
        while self._unsent and not self._flushing:
            try:
                outbox.send_nowait(self._unsent[0])  # type: ignore[attr-defined]
            except anyio.WouldBlock:
                return
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                return  # flush() raises it where the core's loop sees it
            self._unsent.popleft()

    async def flush(self, outbox: ObjectSendStream[Any]) -> None:
        """On the event loop: send every queued output, waiting for room.

        Raises:
            anyio.BrokenResourceError, anyio.ClosedResourceError: the outbox's receiver is gone.
        """
        self._flushing = True
        try:
            while self._unsent:
                await outbox.send(self._unsent[0])
                self._unsent.popleft()
        finally:
            self._flushing = False
