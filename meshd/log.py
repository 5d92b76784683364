"""Structured logging: one event per line, JSON for journald, console for humans.

Every module logs through ``get_logger`` so that node and request ids bound with
``structlog.contextvars`` appear on every line without being passed around.
"""

from __future__ import annotations

import logging
import sys

import structlog

_configured = False


class _CurrentStderr:
    """Resolve ``sys.stderr`` at write time, so a logger outlives a swapped stream (tests, daemons)."""

    def write(self, s: str) -> int:
        return sys.stderr.write(s)

    def flush(self) -> None:
        sys.stderr.flush()


def configure(fmt: str = "console", level: str = "info", stream=None) -> None:
    """Configure structlog once per process. ``fmt`` is ``json`` or ``console``."""
    global _configured
    stream = stream or _CurrentStderr()
    renderer = (
        structlog.processors.JSONRenderer()
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[level.upper()]
        ),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )
    _configured = True


def get_logger(name: str | None = None, **bind):
    if not _configured:
        configure()
    log = structlog.get_logger(name) if name else structlog.get_logger()
    return log.bind(**bind) if bind else log
