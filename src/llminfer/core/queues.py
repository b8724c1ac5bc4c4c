"""Waiting queues of the scheduler: FCFS, and priority (lower ``priority`` first, then arrival).

The scheduler admits by popping in policy order and hands back what it skipped (:meth:`WaitingQueue.prepend`),
as vLLM v1's ``request_queue.py`` does, so a step never sorts or scans the whole queue. Removal of an
aborted request is O(1): its entry is marked dead and dropped when it reaches the head (lazy deletion, as
in the ``heapq`` documentation's priority-queue recipe).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterable, Iterator

from llminfer.request import Request


class _Entry:
    """One place in a queue; ``alive`` is cleared by :meth:`WaitingQueue.remove`."""

    __slots__ = ("alive", "req")

    def __init__(self, req: Request) -> None:
        self.req = req
        self.alive = True


class WaitingQueue:
    """FCFS waiting queue; preempted requests go back to the head.

    ``push``/``push_front``/``pop``/``peek``/``remove`` are O(1) amortized; iteration is in queue order.
    """

    def __init__(self) -> None:
        self._q: deque[_Entry] = deque()
        self._live: dict[str, _Entry] = {}

    def _new_entry(self, req: Request) -> _Entry:
        if req.request_id in self._live:
            raise ValueError(f"request {req.request_id} is already waiting")
        entry = _Entry(req)
        self._live[req.request_id] = entry
        return entry

    def push(self, req: Request) -> None:
        self._q.append(self._new_entry(req))

    def push_front(self, req: Request) -> None:
        self._q.appendleft(self._new_entry(req))

    def prepend(self, reqs: Iterable[Request]) -> None:
        """Put back requests that :meth:`pop` handed out, keeping their order, ahead of the rest."""
        for req in reversed(list(reqs)):
            self.push_front(req)

    def _drop_dead_head(self) -> None:
        while self._q and not self._q[0].alive:
            self._q.popleft()

    def peek(self) -> Request:
        """The next request in policy order. Raises IndexError when empty."""
        self._drop_dead_head()
        return self._q[0].req

    def pop(self) -> Request:
        """Take the next request in policy order. Raises IndexError when empty."""
        self._drop_dead_head()
        entry = self._q.popleft()
        del self._live[entry.req.request_id]
        return entry.req

    def remove(self, req: Request) -> None:
        """Take ``req`` out wherever it is. Raises ValueError when it is not waiting."""
        entry = self._live.get(req.request_id)
        if entry is None or entry.req is not req:
            raise ValueError(f"request {req.request_id} is not waiting")
        entry.alive = False
        del self._live[req.request_id]

    def __len__(self) -> int:
        return len(self._live)

    def __bool__(self) -> bool:
        return bool(self._live)

    def __iter__(self) -> Iterator[Request]:
        return (e.req for e in self._q if e.alive)


class PriorityWaitingQueue(WaitingQueue):
    """Lower ``priority`` first, then arrival order, on a binary heap: ``push``/``pop`` are O(log n).
    Preempted and skipped requests keep their place by key. Iteration is in no particular order."""

    def __init__(self) -> None:
        super().__init__()
        self._heap: list[tuple[int, int, int, _Entry]] = []
        self._tiebreak = itertools.count()

    def push(self, req: Request) -> None:
        heapq.heappush(self._heap, (req.priority, req.arrival_ns, next(self._tiebreak), self._new_entry(req)))

    push_front = push

    def prepend(self, reqs: Iterable[Request]) -> None:
        for req in reqs:
            self.push(req)

    def _drop_dead_head(self) -> None:
        while self._heap and not self._heap[0][3].alive:
            heapq.heappop(self._heap)

    def peek(self) -> Request:
        self._drop_dead_head()
        return self._heap[0][3].req

    def pop(self) -> Request:
        self._drop_dead_head()
        entry = heapq.heappop(self._heap)[3]
        del self._live[entry.req.request_id]
        return entry.req

    def __iter__(self) -> Iterator[Request]:
        return (e[3].req for e in self._heap if e[3].alive)
