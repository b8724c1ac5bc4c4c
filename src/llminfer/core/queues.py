"""Waiting queues of the scheduler: FCFS, and priority (lower ``priority`` first, then arrival)."""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator

from llminfer.request import Request


class WaitingQueue:
    """FCFS waiting queue; preempted requests go back to the head."""

    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def push(self, req: Request) -> None:
        self._q.append(req)

    def push_front(self, req: Request) -> None:
        self._q.appendleft(req)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove(self, req: Request) -> None:
        self._q.remove(req)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


class PriorityWaitingQueue(WaitingQueue):
    """Lower ``priority`` first, then arrival order. Preempted requests keep their place by key."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, int, Request]] = []
        self._tiebreak = itertools.count()

    def push(self, req: Request) -> None:
        heapq.heappush(self._heap, (req.priority, req.arrival_ns, next(self._tiebreak), req))

    push_front = push

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, req: Request) -> None:
        self._heap = [e for e in self._heap if e[3] is not req]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (e[3] for e in sorted(self._heap))
