"""The parent's end of the grammar compile server (:mod:`llminfer.sampling.grammar_worker`): starts it, sends
it compile and kill messages, and hands each reply to the job waiting for it."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llminfer.sampling.constraint import StructuredOutput

class _Job:
    __slots__ = ("id", "done", "reply")

    def __init__(self, job_id: int) -> None:
        self.id = job_id
        self.done = threading.Event()
        self.reply: tuple[str, str] = ("error", "the compile server stopped")


class _CompileServer:
    """The parent's end of :mod:`llminfer.sampling.grammar_worker`: starts it (in the background: an
    interpreter importing xgrammar takes seconds), sends jobs, and hands each reply to its :class:`_Job`
    from a reader thread."""

    def __init__(self, info_json: str) -> None:
        import os
        import subprocess
        import sys
        from pathlib import Path

        self.ready = threading.Event()
        self.failed = False
        self._jobs: dict[int, _Job] = {}
        self._next = 0
        self._lock = threading.Lock()
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])  # this llminfer, wherever it came from
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        self.process = subprocess.Popen([sys.executable, "-m", "llminfer.sampling.grammar_worker"],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        from multiprocessing.connection import Connection

        self._out = Connection(os.dup(self.process.stdin.fileno()), readable=False)
        self._in = Connection(os.dup(self.process.stdout.fileno()), writable=False)
        self.process.stdin.close()
        self.process.stdout.close()
        threading.Thread(target=self._read, args=(info_json,), daemon=True,
                         name="llminfer-grammar-server").start()

    def wait_ready(self, deadline: float) -> bool:
        """Wait until the worker has started, failed or ``deadline`` (``time.monotonic()``) has passed;
        return whether it has started."""
        import time

        while not self.ready.wait(0.05):
            if self.failed or time.monotonic() > deadline:
                return False
        return True

    def _read(self, info_json: str) -> None:
        try:
            with self._lock:
                self._out.send(info_json)
            while True:
                job_id, reply = self._in.recv()
                if job_id == "ready":
                    self.ready.set()
                    continue
                with self._lock:
                    job = self._jobs.pop(job_id, None)
                if job is not None:
                    job.reply = reply
                    job.done.set()
        except Exception:  # noqa: BLE001 - the server died, or this process is exiting (a CLI error): stop
            pass
        self.failed = True
        with self._lock:
            jobs, self._jobs = list(self._jobs.values()), {}
        for job in jobs:
            job.done.set()

    def submit(self, spec: StructuredOutput) -> _Job:
        """Start compiling ``spec``; its :class:`_Job` is done when the reply came (or the server died)."""
        with self._lock:
            self._next += 1
            job = self._jobs[self._next] = _Job(self._next)
            try:
                self._out.send(("compile", job.id, spec))
            except OSError:
                self._jobs.pop(job.id)
                job.done.set()
        return job

    def kill(self, job: _Job) -> None:
        """End ``job``'s compile process now (its reply, if one was on its way, is dropped)."""
        with self._lock:
            self._jobs.pop(job.id, None)
            try:
                self._out.send(("kill", job.id))
            except OSError:
                pass

    def close(self) -> None:
        """Stop the server (its stdin closes: it kills its jobs and exits)."""
        try:
            self._out.close()
        except OSError:
            pass
        try:
            self.process.wait(5)
        except Exception:  # noqa: BLE001 - a server that does not exit is killed
            self.process.kill()
        self._in.close()
