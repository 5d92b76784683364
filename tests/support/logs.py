"""Capturing the daemon's structured log events in-process, whatever level an earlier test left.

``meshd.cli.main`` configures structlog for the process (its default level is warning), and
tests that call it share a worker with tests that look for info events: with the filter
left at warning, an info event never reaches ``capture_logs`` — a test asserting one fails,
and one asserting its absence passes for the wrong reason.
"""

from __future__ import annotations

import contextlib

import structlog

from meshd import log


@contextlib.contextmanager
def all_log_events():
    """``structlog.testing.capture_logs`` with every level let through (debug up)."""
    log.configure("console", "debug")
    with structlog.testing.capture_logs() as events:
        yield events
