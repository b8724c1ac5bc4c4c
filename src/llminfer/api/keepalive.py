"""SSE keep-alives: a stream that stays quiet longer than an interval gets an SSE comment, so that a proxy or
load balancer with an idle timeout (nginx ``proxy_read_timeout``, a cloud load balancer's idle timeout) does
not cut a request that waits in the queue or in a long prefill.

:class:`FramePump` runs a stream's frame generator in a task of the server's task group and hands its frames
over a channel; a second task puts a comment frame (``: keep-alive``, which SSE clients ignore) in the
channel whenever no frame went out for ``interval_s`` seconds. The handler waits for the first message: a
frame, a keep-alive (the response then starts before the first token), or the error the generator raised
before its first frame (still a plain HTTP error response).
"""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
from anyio.abc import TaskGroup

KEEPALIVE_FRAME = b": keep-alive\n\n"  #: an SSE comment: clients skip it, proxies see bytes moving
DEFAULT_SSE_KEEPALIVE_S = 15.0  #: below the 30-60 s idle timeouts common for proxies and load balancers


class _Failed:
    def __init__(self, error: BaseException) -> None:
        self.error = error


class FramePump:
    """Pulls ``frames`` in a task of ``task_group`` and adds a keep-alive comment after every quiet
    ``interval_s`` seconds (``None``: no keep-alives).

    Args:
        frames: the stream's frames (bytes); it is closed when the pump is closed or runs out.
        interval_s: seconds without a frame after which a keep-alive goes out (> 0), or ``None``.
        task_group: a long-lived task group (the server's) to run the pulling in.
        clock: monotonic seconds (injectable for tests).
    """

    def __init__(self, frames: AsyncIterator[bytes], interval_s: float | None, task_group: TaskGroup,
                 clock: Any = time.monotonic) -> None:
        self._frames = frames
        self._interval = interval_s
        self._clock = clock
        self._last = clock()
        # Unbounded: an end or an error is never blocked; frames are small and bounded by the request's tokens.
        self._send, self._receive = anyio.create_memory_object_stream[Any](math.inf)
        self._scope = anyio.CancelScope()
        self._done = anyio.Event()
        task_group.start_soon(self._run)

    async def _run(self) -> None:
        try:
            with self._scope:
                async with anyio.create_task_group() as tg:
                    if self._interval is not None:
                        tg.start_soon(self._tick)
                    try:
                        async for frame in self._frames:
                            self._last = self._clock()
                            self._send.send_nowait(frame)
                    except Exception as exc:  # noqa: BLE001 - handed to the reader (see first())
                        self._send.send_nowait(_Failed(exc))
                    tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self._frames.aclose()  # type: ignore[attr-defined]
            self._send.close()
            self._done.set()

    async def _tick(self) -> None:
        assert self._interval is not None
        while True:
            await anyio.sleep(max(0.0, self._last + self._interval - self._clock()))
            if self._clock() - self._last >= self._interval:
                self._last = self._clock()
                self._send.send_nowait(KEEPALIVE_FRAME)

    async def first(self) -> bytes | None:
        """The first frame (a keep-alive when the stream is slow to start); ``None`` if there is none.

        Raises:
            Exception: what the frame generator raised before its first frame.
        """
        try:
            message = await self._receive.receive()
        except anyio.EndOfStream:
            return None
        if isinstance(message, _Failed):
            raise message.error
        return message  # type: ignore[no-any-return]

    async def rest(self, first: bytes | None) -> AsyncIterator[bytes]:
        """``first`` (from :meth:`first`), then every later frame and keep-alive.

        Raises:
            Exception: what the frame generator raised after its first frame.
        """
        if first is None:
            return
        yield first
        async for message in self._receive:
            if isinstance(message, _Failed):
                raise message.error
            yield message

    async def aclose(self) -> None:
        """Stop pulling (the frame generator is closed, so its engine requests are cancelled) and wait for it."""
        self._scope.cancel()
        await self._done.wait()
        self._receive.close()
