"""structlog setup: one call configures the level and the output stream for the whole package."""

from __future__ import annotations

import logging
import sys
import threading

import structlog


class StdoutLogger:
    """structlog's ``PrintLogger`` for standard output, looked up at each call (so pytest's or a notebook's
    capture still sees the lines) and held in a local while writing.

    Why not ``PrintLogger()`` itself: it calls ``print(message, file=None)``, and CPython 3.11's ``print``
    borrows ``sys.stdout`` without a reference, so a thread that logs while another thread replaces
    ``sys.stdout`` (pytest's capture between tests, a notebook cell) can crash the process (seen once as
    a segfault in ``print`` in the server thread of the test suite).
    """

    _lock = threading.Lock()

    def msg(self, message: str) -> None:
        out = sys.stdout  # a strong reference for the whole write
        if out is None:  # pragma: no cover - pythonw, closed stdout
            return
        with self._lock:
            out.write(message + "\n")
            out.flush()

    log = debug = info = warn = warning = msg
    fatal = failure = err = error = critical = exception = msg


def use_safe_default_output() -> None:
    """Unless the application configured structlog itself, send llminfer's default log output through
    :class:`StdoutLogger` (same destination and format as structlog's default)."""
    if not structlog.is_configured():
        structlog.configure(logger_factory=lambda *_args: StdoutLogger())


def reset_logging() -> None:
    """structlog's defaults again (undoing :func:`configure_logging`), with llminfer's safe default output."""
    structlog.reset_defaults()
    use_safe_default_output()


def configure_logging(level: str = "warning", json: bool = False) -> None:
    """Send llminfer's logs to stderr at ``level`` (debug, info, warning, error); quiet transformers."""
    lvl = getattr(logging, level.upper(), logging.WARNING)
    processors: list = [
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso"),
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False),
    ]
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    try:
        import transformers

        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
    except ImportError:  # pragma: no cover
        pass
