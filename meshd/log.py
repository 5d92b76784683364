"""Structured logging: one event per line, JSON for journald, console for humans.

Every module logs through ``get_logger`` so that node and request ids bound with
``structlog.contextvars`` appear on every line without being passed around.

Format ``auto`` (the daemon's default) picks by where the lines go: under
systemd (``$JOURNAL_STREAM`` names our stream) JSON lines prefixed with the
syslog priority (``<4>``), which journald strips and files as the entry's
priority, so ``journalctl -p warning`` works; on a terminal human-readable
console lines; anywhere else (a pipe, a file) plain JSON lines.
"""

from __future__ import annotations

import logging
import os
import sys

import structlog

_configured = False


class _CurrentStderr:
    """Resolve ``sys.stderr`` at write time, so a logger outlives a swapped stream (tests, daemons)."""

    def write(self, s: str) -> int:
        return sys.stderr.write(s)

    def flush(self) -> None:
        sys.stderr.flush()


# syslog priorities journald reads from a "<N>" line prefix (sd-daemon(3))
_PRIORITY = {"debug": 7, "info": 6, "warning": 4, "warn": 4, "error": 3, "exception": 3,
             "critical": 2}


def resolve_format(fmt: str, stream, env=None) -> str:
    """``auto`` -> ``journald``, ``console`` or ``json`` for ``stream``; other formats unchanged."""
    if fmt != "auto":
        return fmt
    if under_journald(stream, env):
        return "journald"
    isatty = getattr(stream, "isatty", None)
    return "console" if isatty is not None and isatty() else "json"


def under_journald(stream, env=None) -> bool:
    """Whether ``stream`` is the journal stream systemd connected us to (``$JOURNAL_STREAM``)."""
    env = os.environ if env is None else env
    dev_ino = env.get("JOURNAL_STREAM", "")
    if not dev_ino or not hasattr(stream, "fileno"):
        return False
    try:
        st = os.fstat(stream.fileno())
    except (OSError, ValueError):
        return False
    return dev_ino == f"{st.st_dev}:{st.st_ino}"


def _journald_renderer():
    json_render = structlog.processors.JSONRenderer()

    def render(logger, method, event_dict):
        prio = _PRIORITY.get(str(event_dict.get("level", method)).lower(), 6)
        return f"<{prio}>" + json_render(logger, method, event_dict)

    return render


def configure(fmt: str = "console", level: str = "info", stream=None) -> None:
    """Configure structlog once per process.

    ``fmt``: ``console``, ``json``, ``journald`` (JSON with syslog priority
    prefixes) or ``auto`` (see the module docstring).
    """
    global _configured
    fmt = resolve_format(fmt, stream if stream is not None else sys.stderr)
    stream = stream or _CurrentStderr()
    if fmt == "json":
        renderer = structlog.processors.JSONRenderer()
    elif fmt == "journald":
        renderer = _journald_renderer()
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=False)
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
