"""Sink stage: delivers each request's deltas to its handle's stream."""

from __future__ import annotations

import contextlib
import math
from typing import Any

import anyio
from anyio.abc import ObjectReceiveStream, ObjectSendStream

from llminfer.errors import EngineError
from llminfer.protocols import Upstream
from llminfer.protocols.messages import Abort, DeltaBatch, RequestDelta, RequestFailed
from llminfer.trace import Tracer


class StreamSink:
    """Routes :class:`RequestDelta` to per-request memory streams registered with :meth:`open`, and ends
    a request's stream with its error on :class:`RequestFailed`.

    A stream whose reader went away (client disconnect) gets its request aborted through the pipeline's
    ordered inbox. Per-request streams are unbounded: a slow reader of one request must never stall the
    engine for everyone (text deltas are small).
    """

    name = "sink"

    def __init__(self, tracer: Tracer | None = None) -> None:
        self.tracer = tracer or Tracer(enabled=False)
        self.upstream: Upstream | None = None
        self.streams: dict[str, ObjectSendStream[RequestDelta]] = {}
        self._seen_first: set[str] = set()

    def bind_upstream(self, upstream: Upstream) -> None:
        self.upstream = upstream

    def open(self, request_id: str) -> ObjectReceiveStream[RequestDelta]:
        """Register a request; return the stream its deltas arrive on (closed after the final one)."""
        send, receive = anyio.create_memory_object_stream[RequestDelta](math.inf)
        self.streams[request_id] = send
        return receive

    def close(self, request_id: str) -> bool:
        """Forget a request (its reader went away). Returns True if it was still open."""
        send = self.streams.pop(request_id, None)
        self._seen_first.discard(request_id)
        if send is None:
            return False
        send.close()
        return True

    def deliver(self, delta: RequestDelta) -> None:
        send = self.streams.get(delta.request_id)
        if send is None:
            return
        if self.tracer.enabled:
            if delta.token_ids and delta.request_id not in self._seen_first:
                self._seen_first.add(delta.request_id)
                self.tracer.record(delta.request_id, self.name, "first_token", len(delta.token_ids), delta.time_ns)
            elif delta.token_ids:
                self.tracer.record(delta.request_id, self.name, "token", len(delta.token_ids), delta.time_ns)
        try:
            send.send_nowait(delta)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            self.close(delta.request_id)
            if not delta.finished and self.upstream is not None:
                self.upstream(Abort(delta.request_id, "client disconnected"))
            return
        if delta.finished:
            if self.tracer.enabled:
                self.tracer.record(delta.request_id, self.name, "finished", 0, delta.time_ns)
            self.close(delta.request_id)

    async def run(self, inbox: ObjectReceiveStream[Any], outbox: ObjectSendStream[Any]) -> None:
        async with outbox:
            async for msg in inbox:
                if isinstance(msg, DeltaBatch):
                    for delta in msg.deltas:
                        self._deliver_or_fail(delta)
                elif isinstance(msg, RequestFailed):
                    self._deliver_or_fail(RequestDelta(msg.request_id, "", (), finish_reason="error",
                                                      error=msg.error))
                else:
                    await outbox.send(msg)

    def _deliver_or_fail(self, delta: RequestDelta) -> None:
        """:meth:`deliver`; if that raises, the request is ended with the error (and aborted upstream)
        and the sink goes on serving the others."""
        try:
            self.deliver(delta)
        except Exception as exc:  # noqa: BLE001 - one request's failure must not stop the sink
            send = self.streams.get(delta.request_id)
            if send is not None:
                with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                    send.send_nowait(RequestDelta(delta.request_id, "", (), finish_reason="error",
                                                  error=EngineError(f"sink: {type(exc).__name__}: {exc}")))
            self.close(delta.request_id)
            if not delta.finished and self.upstream is not None:
                self.upstream(Abort(delta.request_id, "failed in the sink"))

    def fail_all(self, error: Exception) -> None:
        """Finish every open request with ``error`` (engine shutdown)."""
        for rid, send in list(self.streams.items()):
            try:
                send.send_nowait(RequestDelta(rid, "", (), finish_reason="abort", error=error))
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                pass
            self.close(rid)
