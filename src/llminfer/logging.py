"""structlog setup: llminfer logs to **stderr at warning** by default, so the Python API prints nothing on
stdout (where a program's own output goes). :func:`configure_logging` changes the level and the format for
the whole package; the ``LLMINFER_LOG_LEVEL`` environment variable (debug, info, warning, error) sets the
default level. An application that configured structlog itself before importing llminfer keeps its setup.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections.abc import Iterator

import structlog

LEVELS = ("debug", "info", "warning", "error")
ENV_LEVEL = "LLMINFER_LOG_LEVEL"


class StreamLogger:
    """structlog's ``PrintLogger`` for a standard stream (``"stderr"`` or ``"stdout"``), looked up at each call
    (so pytest's or a notebook's capture still sees the lines), held in a local and written with
    ``stream.write`` under a lock.

    Why not ``PrintLogger(file=sys.stderr)``: it binds the stream once (a later capture or redirect would not
    see the lines, and a closed one raises); and ``PrintLogger()`` calls ``print(message, file=None)``,
    where CPython 3.11's ``print`` borrows ``sys.stdout`` without a reference, so a thread that logs while
    another thread replaces the stream (pytest's capture between tests, a notebook cell) can crash the
    process (seen once as a segfault in ``print`` in the server thread of the test suite).
    """

    _lock = threading.Lock()

    def __init__(self, stream: str = "stderr") -> None:
        self.stream = stream

    def msg(self, message: str) -> None:
        out = getattr(sys, self.stream)  # a strong reference for the whole write
        if out is None:  # pragma: no cover - pythonw, closed stream
            return
        with self._lock:
            out.write(message + "\n")
            out.flush()

    log = debug = info = warn = warning = msg
    fatal = failure = err = error = critical = exception = msg


def default_level() -> str:
    """``LLMINFER_LOG_LEVEL`` (any case) when it names a level, else ``"warning"``."""
    env = os.environ.get(ENV_LEVEL, "").strip().lower()
    return env if env in LEVELS else "warning"


def _setup(level: str, json: bool) -> None:
    lvl = getattr(logging, level.upper(), logging.WARNING)
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=lambda *_args: StreamLogger("stderr"),
        cache_logger_on_first_use=False,
    )


def use_safe_default_output() -> None:
    """Unless the application configured structlog itself: llminfer's default, stderr at
    :func:`default_level` (``import llminfer`` calls this)."""
    if not structlog.is_configured():
        _setup(default_level(), json=False)


def reset_logging() -> None:
    """structlog's defaults again (undoing :func:`configure_logging`), then llminfer's default output."""
    structlog.reset_defaults()
    use_safe_default_output()


def configure_logging(level: str | None = None, json: bool = False) -> None:
    """Send llminfer's logs to stderr at ``level`` (debug, info, warning or error; None: the
    ``LLMINFER_LOG_LEVEL`` variable, else warning), as key=value lines or, with ``json``, one JSON object
    per line. Configures structlog globally (it replaces an application's own structlog setup).

    Transformers' own warnings and progress bars stay off while llminfer loads a model unless ``level`` is
    debug (see :func:`quiet_transformers`).

    Raises:
        ValueError: ``level`` is not one of the four.
    """
    level = default_level() if level is None else level.lower()
    if level not in LEVELS:
        raise ValueError(f"log level must be debug, info, warning or error, got {level!r}")
    _setup(level, json)


def current_level() -> int:
    """The stdlib number of the level llminfer logs at now (``logging.WARNING`` by default)."""
    cfg = structlog.get_config()
    wrapper = cfg.get("wrapper_class")
    for name in LEVELS:
        lvl = getattr(logging, name.upper())
        if wrapper is structlog.make_filtering_bound_logger(lvl):
            return lvl
    return logging.DEBUG  # pragma: no cover - an application's own setup: assume it wants everything


# ---------------------------------------------------------------------------- status lines
_status = {"enabled": False, "active": False}
_status_lock = threading.Lock()
_status_log = structlog.get_logger("llminfer.status")


def enable_status_lines(enabled: bool = True) -> None:
    """Turn :func:`status` lines on stderr on or off (the CLI turns them on when stderr is a terminal;
    off by default, so the Python API draws nothing)."""
    _status["enabled"] = enabled


@contextlib.contextmanager
def status(message: str) -> Iterator[None]:
    """While the body runs (loading a model, compiling a graph), show ``message`` with a spinner and the
    elapsed time on stderr, erased when it ends. Only when :func:`enable_status_lines` is on and no other
    status line is showing; ``message`` is always logged at debug level (``llminfer.status``)."""
    _status_log.debug(message)
    with _status_lock:
        show = _status["enabled"] and not _status["active"]
        if show:
            _status["active"] = True
    if not show:
        yield
        return
    try:
        from rich.console import Console
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                      console=Console(stderr=True), transient=True) as bar:
            bar.add_task(message, total=None)
            yield
    finally:
        with _status_lock:
            _status["active"] = False


_quiet_lock = threading.Lock()
_quiet_depth = [0]
_quiet_saved: list = []


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Inside the block transformers logs errors only and draws no progress bar (its settings are put back
    after it; nested and concurrent blocks restore once, when the last one ends). Does nothing when
    llminfer logs at debug level."""
    if current_level() <= logging.DEBUG:
        yield
        return
    from transformers.utils import logging as hf_logging

    with _quiet_lock:
        if _quiet_depth[0] == 0:
            _quiet_saved[:] = [hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()]
            hf_logging.set_verbosity_error()
            hf_logging.disable_progress_bar()
        _quiet_depth[0] += 1
    try:
        yield
    finally:
        with _quiet_lock:
            _quiet_depth[0] -= 1
            if _quiet_depth[0] == 0:
                verbosity, bar = _quiet_saved
                hf_logging.set_verbosity(verbosity)
                if bar:
                    hf_logging.enable_progress_bar()
