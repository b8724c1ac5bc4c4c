"""structlog setup: one call configures the level and the output stream for the whole package."""

from __future__ import annotations

import logging
import sys

import structlog


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
