"""Cheap stage-level trace events: ``(request_id, stage, event, t_ns, n_tokens)``.

Stages call :meth:`Tracer.record` at a handful of points per request and once per engine step; the
benchmark layer turns :meth:`Tracer.snapshot` into a polars frame. Events are kept in a ring buffer so a
long-running server never grows without bound.
"""

from __future__ import annotations

import time
from collections import deque
from typing import NamedTuple

STEP = "__step__"
"""``request_id`` of events that describe a whole engine step rather than one request."""


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
        max_events: ring-buffer size; the oldest events are dropped past it.
    """

    def __init__(self, enabled: bool = True, max_events: int = 1_000_000) -> None:
        self.enabled = enabled
        self.events: deque[TraceEvent] = deque(maxlen=max_events)

    def record(self, request_id: str, stage: str, event: str, n_tokens: int = 0, t_ns: int | None = None) -> None:
        if self.enabled:
            self.events.append(TraceEvent(request_id, stage, event, t_ns or time.perf_counter_ns(), n_tokens))

    def snapshot(self) -> list[TraceEvent]:
        """A copy of the events recorded so far."""
        return list(self.events)

    def clear(self) -> None:
        self.events.clear()
