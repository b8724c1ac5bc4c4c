"""The grammar compile server: a child process that compiles structured-output constraints, each in a
process of its own that can be killed (xgrammar's compile cannot be interrupted).

One server per :class:`~llminfer.sampling.grammar_compiler.GrammarCompiler`, started with
``python -m llminfer.sampling.grammar_worker`` (a fresh interpreter: never a fork of the multi-threaded
engine process). It imports xgrammar once, builds xgrammar's compiler from the tokenizer info it is sent,
then for each job forks a child (a fork of this single-threaded server costs milliseconds and shares the
tokenizer info) that compiles and sends back ``CompiledGrammar.serialize_json()``. A ``kill`` message ends
a job's child at once: the CPU it used and the parent's slot are free again.

Protocol (``multiprocessing.connection`` framing over the server's stdin / a duplicate of its stdout):
the parent sends the tokenizer info JSON first, then ``("compile", job_id, spec)`` and ``("kill", job_id)``;
the server answers ``(job_id, ("ok", grammar_json))`` or ``(job_id, ("error", message))``, nothing for a
killed job. It exits when its stdin closes.
"""

from __future__ import annotations

import os
import select
import signal
import sys
from multiprocessing.connection import Connection
from typing import Any


def _compile_child(compiler: Any, spec: Any, out: Connection) -> None:
    from llminfer.sampling.grammar_compiler import _compile_spec, clean_error

    try:
        reply = ("ok", _compile_spec(compiler, spec).serialize_json())
    except Exception as exc:  # noqa: BLE001 - xgrammar reports bad input as RuntimeError
        reply = ("error", clean_error(exc))
    out.send(reply)


def serve() -> None:
    """Run the server on stdin / stdout until stdin closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the parent; this ends when its stdin closes
    protocol_out = os.dup(1)
    os.dup2(2, 1)  # stray prints (a library's warning) must not corrupt the protocol
    inbox = Connection(0, writable=False)
    outbox = Connection(protocol_out, readable=False)
    import xgrammar

    try:
        info_json = inbox.recv()
    except (EOFError, OSError):  # the parent exited before it was up (a CLI that failed early)
        return
    info = xgrammar.TokenizerInfo.deserialize_json(info_json)
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    outbox.send(("ready", None))
    jobs: dict[int, tuple[int, int, Connection]] = {}  # read fd -> (job id, pid, connection)
    by_id: dict[int, int] = {}  # job id -> read fd
    while True:
        readable, _, _ = select.select([0, *jobs], [], [])
        for fd in readable:
            if fd == 0:
                try:
                    message = inbox.recv()
                except (EOFError, OSError):
                    for _job, pid, _conn in jobs.values():
                        os.kill(pid, signal.SIGKILL)
                    return
                if message[0] == "compile":
                    _, job_id, spec = message
                    r, w = os.pipe()
                    pid = os.fork()
                    if pid == 0:  # the child: compile, reply, exit without running any cleanup
                        try:
                            os.close(r)
                            _compile_child(compiler, spec, Connection(w, readable=False))
                        finally:
                            os._exit(0)
                    os.close(w)
                    jobs[r] = (job_id, pid, Connection(r, writable=False))
                    by_id[job_id] = r
                elif message[0] == "kill":
                    fd_of = by_id.pop(message[1], None)
                    if fd_of is not None:
                        _job, pid, conn = jobs.pop(fd_of)
                        os.kill(pid, signal.SIGKILL)
                        os.waitpid(pid, 0)
                        conn.close()
                continue
            job_id, pid, conn = jobs.pop(fd)
            by_id.pop(job_id, None)
            try:
                reply = conn.recv()
            except (EOFError, OSError):
                reply = ("error", "the compile process died (out of memory?)")
            conn.close()
            os.waitpid(pid, 0)
            try:
                outbox.send((job_id, reply))
            except OSError:  # the parent is gone
                return


if __name__ == "__main__":
    sys.exit(serve())
