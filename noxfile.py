"""nox sessions: tests, lint, bench. Sessions reuse the project's own virtualenv (``-R`` is fine)."""

from __future__ import annotations

import nox

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["lint", "tests"]


def _install(session: nox.Session, extras: str = "dev") -> None:
    session.install("torch==2.13.0")
    session.install("-e", f".[{extras}]")


@nox.session
def tests(session: nox.Session) -> None:
    """The test suite (slow tests included; ``-- -m 'not slow'`` for the quick part)."""
    _install(session)
    session.run("pytest", "-q", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff over src, tests, bench."""
    session.install("ruff")
    session.run("ruff", "check", "src", "tests", "bench", "noxfile.py")


@nox.session
def bench(session: nox.Session) -> None:
    """The benchmark suite: writes JSON/CSV artifacts under bench/results/ and prints the ratios."""
    _install(session)
    session.run("python", "bench/run_all.py", *session.posargs)
