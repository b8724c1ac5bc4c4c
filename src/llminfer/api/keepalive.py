"""SSE keep-alives: a stream that stays quiet longer than an interval gets an SSE comment, so that a proxy or
load balancer with an idle timeout (nginx ``proxy_read_timeout``, a cloud load balancer's idle timeout) does
not cut a request that waits in the queue or in a long prefill.

:class:`FramePump` runs a stream's frame producer in a task of the server's task group; the producer hands
each frame to ``emit``, which never blocks (the channel is unbounded), so generation runs as fast as the
engine makes tokens whatever the client's reading speed: a client that stops reading does not hold the
call's admission (it is released when generation ends; only the frames wait, at most ``max_tokens`` per
choice). The reader takes the frames with :meth:`FramePump.next`, which returns a comment frame
(``: keep-alive``, which SSE clients ignore) instead when none came for ``interval_s`` seconds. The handler
waits for the first one: a frame, a keep-alive (the response then starts before the first token), or the
error the producer raised before its first frame (still a plain HTTP error response).
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
from anyio.abc import TaskGroup

KEEPALIVE_FRAME = b": keep-alive\n\n"  #: an SSE comment: clients skip it, proxies see bytes moving
DEFAULT_SSE_KEEPALIVE_S = 15.0  #: below the 30-60 s idle timeouts common for proxies and load balancers

Emit = Callable[[bytes], None]


class _Failed:
    def __init__(self, error: BaseException) -> None:
        self.error = error


class FramePump:
    """Runs ``produce(emit)`` in a task of ``task_group`` and hands its frames to :meth:`next`, with a
    keep-alive comment after every quiet ``interval_s`` seconds (``None``: no keep-alives).

    Args:
        produce: makes the stream's frames (bytes), passing each to ``emit``; cancelled when the pump is
            closed.
        interval_s: seconds without a frame after which a keep-alive goes out (> 0), or ``None``.
        task_group: a long-lived task group (the server's) to run the producer in.
    """

    def __init__(self, produce: Callable[[Emit], Awaitable[None]], interval_s: float | None,
                 task_group: TaskGroup) -> None:
        self._interval = interval_s
        # Unbounded: an end or an error is never blocked; frames are small and bounded by the request's tokens.
        self._send, self._receive = anyio.create_memory_object_stream[Any](math.inf)
        self._scope = anyio.CancelScope()
        self._done = anyio.Event()
        task_group.start_soon(self._run, produce)

    async def _run(self, produce: Callable[[Emit], Awaitable[None]]) -> None:
        try:
            with self._scope:
                try:
                    await produce(self._send.send_nowait)
                except Exception as exc:  # noqa: BLE001 - handed to the reader (see next())
                    self._send.send_nowait(_Failed(exc))
        finally:
            self._send.close()
            self._done.set()

    async def next(self) -> bytes | None:
        """The next frame, or a keep-alive when none came for ``interval_s``; ``None`` after the last one.

        Raises:
            Exception: what the producer raised (after the frames it made before).
        """
        try:
            if self._interval is None:
                message = await self._receive.receive()
            else:
                message = KEEPALIVE_FRAME
                with anyio.move_on_after(self._interval):  # a memory channel loses nothing when cancelled
                    message = await self._receive.receive()
        except anyio.EndOfStream:
            return None
        if isinstance(message, _Failed):
            raise message.error
        return message  # type: ignore[no-any-return]

    async def aclose(self) -> None:
        """Stop the producer (cancelled, so its engine requests are cancelled) and wait for it."""
        self._scope.cancel()
        await self._done.wait()
        self._receive.close()
