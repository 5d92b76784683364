"""Loggers for the ``partition`` package: it only *gets* structlog loggers.

Configuration (renderer, level, stream) belongs to the application (``meshd.log``
configures structlog once per process); structlog's lazy proxies follow it even
for loggers created at import time, before it ran.
"""

from structlog import get_logger

__all__ = ["get_logger"]
