"""How many threads torch's CPU kernels use for an engine's steps: fixed, or adapted to the idle cores.

Why adapt: torch's CPU kernels (and llminfer's own) run their parallel regions on one OpenMP team whose
threads spin at each region's end waiting for the slowest one. A batch-1 decode step has one or more regions
per linear layer, each a few tens of microseconds. When another process keeps one of the team's cores busy,
the OS time-slices the team's thread on that core against it (slices of milliseconds), so nearly every
region waits a slice for it while the other threads spin. On a 2-core AMD EPYC (Zen 4) VM, batch-1 decode
of the ~114M bench model went from 37 ms per token at 1 thread to 294 ms at 2 threads with the other core
busy (issue 35), while 2 threads beat 1 on a quiet machine. A team no larger than the idle cores avoids
that; the number of idle cores is measured rather than guessed, because it changes while a server runs.

:class:`ThreadGovernor` holds one engine's setting:

* ``num_threads=N`` (``--threads N``): every step runs with N threads, whatever the load.
* ``num_threads=None`` (the default), and ``OMP_NUM_THREADS`` set in the environment: that count, fixed
  (the user chose it; torch reads it at import).
* ``num_threads=None`` otherwise (``auto``): at most torch's default count (the physical cores allowed to
  the process), and at most the cores the *other* processes leave idle: every ``interval_s`` (0.5 s) it
  reads the busy time of the CPUs this process may run on (``/proc/stat``; the hypervisor's steal is not counted,
  see :func:`read_busy_seconds`), subtracts this process's own CPU time and its child processes' (its spinning OpenMP
  threads and its compile workers do not count against it, :func:`own_cpu_seconds`), and sets
  ``idle = cpus - others``; the first call (the model's load) waits for a first window of 0.1 s so that it
  already runs with a suitable count; the team gets ``floor(idle + 0.3)`` threads (at least 1). It drops at once and grows only after two windows in a row agree, so a bursty neighbour
  does not make it flap. Where ``/proc/stat`` cannot be read (not Linux) ``auto`` keeps the default count.

The count is applied with ``torch.set_num_threads`` on the thread that runs the step (the engine's model
thread, :mod:`llminfer.core.model_thread`) right before each call, and only when it differs from what that
thread has (``torch.get_num_threads`` there). OpenMP keeps the count per thread, so this is also what makes
engines that share the one model thread with different settings work: each sets its own count before its
own steps, and a second engine with ``num_threads=4`` next to one with ``num_threads=1`` runs its steps
with 4 threads while the first keeps 1 (the team is reused; changing its size costs microseconds).
"""

from __future__ import annotations

import contextlib
import math
import os
import resource
import threading
import time
from collections.abc import Callable
from typing import Any

INTERVAL_S = 0.5
"""Seconds between two measurements of the idle cores in ``auto`` mode."""

FIRST_WINDOW_S = 0.1
"""The first measurement's window: the first call waits for it (once per engine)."""

_ROUND_UP = 0.3
"""``auto`` gives ``floor(idle + 0.3)`` threads: a core counts only when at least 70 % of it is idle, so a
neighbour using more than 30 % of a core takes it (a team thread there would wait for slices often enough to
cost more than the core brings)."""



def allowed_cpus() -> list[int]:
    """The logical CPUs this process may run on (``sched_getaffinity``; all of ``os.cpu_count()`` where that
    call does not exist)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def read_busy_seconds(cpus: list[int], path: str = "/proc/stat") -> float | None:
    """Seconds the CPUs in ``cpus`` spent busy since boot (user, nice, system, irq and softirq in ``/proc/stat``'s
    ``cpuN`` lines, in ``USER_HZ`` ticks); None where the file cannot be read or parsed.

    Steal (time the hypervisor gave the vCPU to another VM) is left out: a smaller team does not get it back,
    and on a quiet VM steal comes in spikes within single windows, each of which would drop a thread (the
    README's thread section has the figures)."""
    wanted = {f"cpu{i}" for i in cpus}
    try:
        with open(path, encoding="ascii") as f:
            lines = f.read().splitlines()
        ticks = 0
        found = 0
        for line in lines:
            name, _, rest = line.partition(" ")
            if name in wanted:
                fields = [int(x) for x in rest.split()]
                # user nice system idle iowait irq softirq steal [guest guest_nice: already in user/nice]
                ticks += sum(fields[:3]) + sum(fields[5:7])
                found += 1
        if found == 0:
            return None
        return ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def own_cpu_seconds() -> float:
    """CPU seconds (user + system) used so far by this process and its descendants: the living ones with the
    ones they waited for (psutil, about 1 ms to list them on a machine with ~70 processes) and the ended
    ones this process waited for (getrusage). It never decreases.

    Child processes do this engine's own work (Inductor's compile workers, the grammar compile process, vLLM's
    workers), so they are no neighbour. Counted as one, a cold ``torch.compile`` made ``auto`` drop to one
    thread while its workers ran and go back up after: each count change made the compiled graph, whose
    OpenMP regions are sized at compile time (a guard on ``torch.get_num_threads()``), compile again, 10-15 s
    each, inside the first requests."""
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        r = resource.getrusage(who)
        total += r.ru_utime + r.ru_stime
    try:
        import psutil
    except ImportError:
        return total
    try:
        children = psutil.Process().children(recursive=True)
    except psutil.Error:
        return total
    for child in children:
        with contextlib.suppress(psutil.Error):  # it ended meanwhile (counted once waited for)
            times = child.cpu_times()
            # children_*: the processes it started and waited for (a compile process forks one per job)
            total += times.user + times.system + times.children_user + times.children_system
    global _own_high
    with _own_lock:  # never backwards: a descendant that ended and was not yet waited for counts nowhere
        _own_high = max(_own_high, total)
        return _own_high


_own_high = 0.0
_own_lock = threading.Lock()


class ThreadGovernor:
    """One engine's torch thread count, applied before each call on the model thread.

    Args:
        num_threads: a fixed count (>= 1), or None for the environment's ``OMP_NUM_THREADS`` or, without it,
            ``auto`` (see the module docstring).
        interval_s: seconds between two measurements in ``auto`` mode.
        clock: monotonic seconds (injectable for tests).
        busy_reader: ``cpus -> busy seconds of those CPUs or None`` (default: :func:`read_busy_seconds`).
        own_reader: ``() -> this process's CPU seconds`` (default: :func:`own_cpu_seconds`).
        sleep: waits out the first window (default ``time.sleep``).
        cpus: the logical CPUs to watch (default: :func:`allowed_cpus`).
        max_threads: the most threads ``auto`` uses (default: torch's count on the calling thread: the physical
            cores, or what ``torch.set_num_threads`` set there).
        adapt: False keeps ``auto``'s count at ``max_threads`` (mode ``"fixed (compiled graphs)"``): Inductor
            sizes a compiled graph's OpenMP regions at compile time and dynamo guards on the count, so each
            change would compile every step shape again (10-15 s each on the bench model; with a benchmark
            client using half a core, ``auto`` dropped to 1 thread and ``llminfer serve --backend compiled``
            fell from 450 to 227 output tok/s while it recompiled).

    Raises:
        ValueError: ``num_threads`` below 1.
    """

    def __init__(self, num_threads: int | None = None, *, interval_s: float = INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic,
                 busy_reader: Callable[[list[int]], float | None] = read_busy_seconds,
                 own_reader: Callable[[], float] = own_cpu_seconds, cpus: list[int] | None = None,
                 max_threads: int | None = None, sleep: Callable[[float], None] = time.sleep,
                 adapt: bool = True) -> None:
        if num_threads is not None and num_threads < 1:
            raise ValueError(f"num_threads must be >= 1 or None, got {num_threads}")
        import torch

        self.requested = num_threads
        # torch's count on the thread that builds the engine: OMP_NUM_THREADS, or the physical cores, or what
        # the caller set with torch.set_num_threads before
        default = torch.get_num_threads()
        if num_threads is not None:
            self.mode = "fixed"
            self.threads = num_threads
        elif os.environ.get("OMP_NUM_THREADS", "").strip():
            self.mode = "OMP_NUM_THREADS"
            self.threads = default
        elif not adapt:
            self.mode = "fixed (compiled graphs)"
            self.threads = max(1, max_threads or default)
        else:
            self.mode = "auto"
            self.threads = max(1, max_threads or default)
        self.max_threads = self.threads
        self.interval_s = interval_s
        self._clock, self._busy, self._own, self._sleep = clock, busy_reader, own_reader, sleep
        self.cpus = cpus if cpus is not None else allowed_cpus()
        self.others_busy: float | None = None  # cores the other processes used in the last window
        self.changes = 0
        self._pending_up = 0
        self._lock = threading.Lock()
        self._sample = self._take_sample() if self.mode == "auto" else None
        if self.mode == "auto" and self._sample is None:
            self.mode = "auto (no /proc/stat: default count)"

    def _take_sample(self) -> tuple[float, float, float] | None:
        busy = self._busy(self.cpus)
        return None if busy is None else (self._clock(), busy, self._own())

    def update(self) -> int:
        """Measure the idle cores if a window has passed (``auto`` mode) and return the count to use."""
        if self._sample is None:
            return self.threads
        with self._lock:
            t0, busy0, own0 = self._sample
            elapsed = self._clock() - t0
            if self.others_busy is None and elapsed < FIRST_WINDOW_S:
                # the first call (the model's load, right after the engine is built): a short first window,
                # so that loading and the first steps already run with a count that suits the machine
                self._sleep(FIRST_WINDOW_S - elapsed)
            elif self.others_busy is not None and elapsed < self.interval_s:
                return self.threads
            sample = self._take_sample()
            if sample is None:
                return self.threads
            t1, busy1, own1 = sample
            if t1 <= t0:
                return self.threads
            self._sample = sample
            others = max(0.0, ((busy1 - busy0) - (own1 - own0)) / (t1 - t0))
            self.others_busy = others
            want = max(1, min(self.max_threads, math.floor(len(self.cpus) - others + _ROUND_UP)))
            if want < self.threads:
                self.threads, self._pending_up = want, 0
                self.changes += 1
            elif want > self.threads:
                self._pending_up += 1
                if self._pending_up >= 2:
                    self.threads, self._pending_up = want, 0
                    self.changes += 1
            else:
                self._pending_up = 0
            return self.threads

    def apply(self) -> int:
        """Set the calling thread's torch thread count to :meth:`update`'s (only when it differs); returns it."""
        import torch

        n = self.update()
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)
        return n

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` preceded by :meth:`apply` on whatever thread calls it."""
        def governed(*args: Any) -> Any:
            self.apply()
            return fn(*args)
        return governed

    def describe(self) -> dict[str, Any]:
        """Facts for ``engine.info()``: the count in use, how it is chosen, the CPUs watched."""
        facts: dict[str, Any] = {"num_threads": self.threads, "threads_mode": self.mode}
        if self.mode == "auto":
            facts["threads_max"] = self.max_threads
            facts["threads_cpus_watched"] = len(self.cpus)
            if self.others_busy is not None:
                facts["threads_other_processes_busy_cores"] = round(self.others_busy, 2)
        return facts
