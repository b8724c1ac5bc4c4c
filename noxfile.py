"""nox sessions: tests, lint, bench.

Sessions build nothing: they run in the project's own environment, the interpreter that runs nox (e.g.
``.venv/bin/nox -s bench``, or ``nox`` from an activated venv where ``pip install -e '.[dev]'`` was
run). ``venv_backend="none"`` gives that; each session checks that llminfer imports there and says
how to install it when it does not.

    nox -s tests -- -m 'not slow'      # pytest arguments after --
    nox -s bench -- --quick            # bench/run_all.py arguments after --
"""

from __future__ import annotations

import subprocess
import sys

import nox

nox.options.sessions = ["lint", "tests"]
PYTHON = sys.executable  # the project's interpreter: the one running nox


def _check_installed(session: nox.Session) -> None:
    probe = subprocess.run([PYTHON, "-c", "import llminfer"], capture_output=True, text=True)
    if probe.returncode != 0:
        session.error(f"llminfer does not import in {PYTHON}: run nox from the project's venv after "
                      "`pip install -e '.[dev]'`")


@nox.session(venv_backend="none")
def tests(session: nox.Session) -> None:
    """The test suite (slow tests included; ``-- -m 'not slow'`` for the quick part)."""
    _check_installed(session)
    session.run(PYTHON, "-m", "pytest", "-q", *session.posargs)


@nox.session(venv_backend="none")
def lint(session: nox.Session) -> None:
    """ruff over src, tests, bench."""
    session.run(PYTHON, "-m", "ruff", "check", "src", "tests", "bench", "noxfile.py")


@nox.session(venv_backend="none")
def bench(session: nox.Session) -> None:
    """The benchmark suite: writes JSON artifacts under bench/results/, prints progress per suite and the
    ratios (``-- --quick`` for each suite's small workload, minutes in all)."""
    _check_installed(session)
    session.run(PYTHON, "bench/run_all.py", *session.posargs)
