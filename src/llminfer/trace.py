"""Cheap stage-level trace events: ``(request_id, stage, event, t_ns, n_tokens)``.

Stages call :meth:`Tracer.record` at a handful of points per request and once per engine step; the
benchmark layer turns :meth:`Tracer.snapshot` into a polars frame. Events are kept in a bounded ring
buffer (:data:`DEFAULT_MAX_EVENTS`, about 8 MiB) so that a long-running server, where nobody reads them,
never grows: each event costs about 127 bytes, and a million of them (the old bound) held 127 MiB. A
reader that needs a longer window asks for it with :meth:`Tracer.ensure_capacity` (the benchmark does,
from its batch size and token counts); :attr:`Tracer.dropped` counts the events the ring overwrote.
"""

from __future__ import annotations

import time
from collections import deque
from typing import NamedTuple

STEP = "__step__"
"""``request_id`` of events that describe a whole engine step rather than one request."""

DEFAULT_MAX_EVENTS = 65_536
"""Ring-buffer size of a tracer (events): about 8 MiB, a few hundred requests of a few hundred tokens."""


class TraceEvent(NamedTuple):
    request_id: str
    stage: str
    event: str
    t_ns: int
    n_tokens: int


class Tracer:
    """Records trace events (monotonic ``time.perf_counter_ns`` clock).

    Args:
        enabled: when False, :meth:`record` returns at once.
        max_events: ring-buffer size; the oldest events are dropped past it (and counted in
            :attr:`dropped`).
    """

    def __init__(self, enabled: bool = True, max_events: int = DEFAULT_MAX_EVENTS) -> None:
        self.enabled = enabled
        self.events: deque[TraceEvent] = deque(maxlen=max_events)
        self.dropped = 0

    @property
    def max_events(self) -> int:
        return self.events.maxlen or 0

    def record(self, request_id: str, stage: str, event: str, n_tokens: int = 0, t_ns: int | None = None) -> None:
        if self.enabled:
            events = self.events
            if len(events) == events.maxlen:
                self.dropped += 1
            events.append(TraceEvent(request_id, stage, event, t_ns or time.perf_counter_ns(), n_tokens))

    def ensure_capacity(self, max_events: int) -> None:
        """Grow the ring to hold at least ``max_events`` events (kept events stay; it never shrinks)."""
        if max_events > self.max_events:
            self.events = deque(self.events, maxlen=max_events)

    def snapshot(self) -> list[TraceEvent]:
        """A copy of the events recorded so far."""
        return list(self.events)

    def clear(self) -> None:
        """Forget the events recorded so far (and the count of dropped ones)."""
        self.events.clear()
        self.dropped = 0
