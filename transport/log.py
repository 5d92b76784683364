"""Loggers for the ``transport`` package: it only *gets* structlog loggers.

Configuration (renderer, level, stream) belongs to the application: ``meshd.log``
configures structlog once per process, and every logger obtained here follows
that configuration, also one created at import time before it ran (structlog's
lazy proxies resolve the configuration on first use).
"""

from __future__ import annotations

import structlog


def get_logger(name: str | None = None, **bind):
    log = structlog.get_logger(name) if name else structlog.get_logger()
    return log.bind(**bind) if bind else log
