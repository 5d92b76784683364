"""Waiting on a condition with a deadline: how tests wait, never by sleeping a guessed time.

A sleep long enough on an idle machine is too short on a loaded one (the suite runs with four
workers on two cores); a wait on the condition itself returns as soon as it holds and fails,
naming what it waited for, only when the deadline passes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, TypeVar

from meshd.errors import MeshdError

T = TypeVar("T")

# What a poll may raise while the thing it watches is still coming up (a daemon's socket not yet
# there, a status without the key yet): retried until the deadline, then reported.
TRANSIENT = (OSError, LookupError, TypeError, MeshdError)


def _failure(what: str, timeout_s: float, last_exc: BaseException | None,
             explain: Callable[[], Any] | None) -> AssertionError:
    detail = ""
    if explain is not None:
        try:
            detail = "\n" + str(explain())
        except Exception as exc:  # noqa: BLE001 - diagnostics only
            detail = f"\n(explain failed: {exc})"
    return AssertionError(f"timed out after {timeout_s:g} s waiting for {what}"
                          + (f" (last error: {last_exc!r})" if last_exc else "") + detail)


def _intervals(longest_s: float):
    """Poll often at first (most waits are short), then back off so a long wait costs little CPU."""
    interval = 0.005
    while True:
        yield interval
        interval = min(longest_s, interval * 1.5)


def wait_until(predicate: Callable[[], T], timeout_s: float = 10.0, what: str = "condition", *,
               longest_interval_s: float = 0.2, explain: Callable[[], Any] | None = None) -> T:
    """Poll ``predicate`` until it returns something truthy, and return that.

    Raises AssertionError naming ``what`` (plus ``explain()``, e.g. the daemons' status) when
    ``timeout_s`` passes first; so ``assert wait_until(...)`` and a bare ``wait_until(...)`` both
    check the claim.
    """
    deadline = time.monotonic() + timeout_s
    last_exc: BaseException | None = None
    for interval in _intervals(longest_interval_s):
        try:
            value = predicate()
            if value:
                return value
        except TRANSIENT as exc:
            last_exc = exc
        left = deadline - time.monotonic()
        if left <= 0:
            raise _failure(what, timeout_s, last_exc, explain)
        time.sleep(min(interval, left))  # sleep-ok: the poll interval of a wait with a deadline


async def eventually(predicate: Callable[[], T], timeout_s: float = 10.0, what: str = "condition", *,
                     longest_interval_s: float = 0.05) -> T:
    """``wait_until`` for code on an event loop: polls without blocking the loop."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    for interval in _intervals(longest_interval_s):
        value = predicate()
        if value:
            return value
        left = deadline - loop.time()
        if left <= 0:
            raise _failure(what, timeout_s, None, None)
        await asyncio.sleep(min(interval, left))  # sleep-ok: the poll interval of a wait with a deadline
