"""Event loop choice: uvloop when installed, the stdlib loop otherwise.

uvloop roughly halves the per-message overhead of the asyncio machinery that
``zmq.asyncio`` sits on (fd readiness callbacks, futures), which is what
dominates small-message latency. It is optional (absent on Windows), so
everything also runs on the default loop.
"""

from __future__ import annotations

import asyncio
from typing import Any, Coroutine, TypeVar

T = TypeVar("T")

try:  # pragma: no cover - depends on the platform
    import uvloop
except ImportError:  # pragma: no cover
    uvloop = None  # type: ignore[assignment]

__all__ = ["run", "new_event_loop", "HAVE_UVLOOP"]

HAVE_UVLOOP = uvloop is not None


def new_event_loop() -> asyncio.AbstractEventLoop:
    return uvloop.new_event_loop() if uvloop is not None else asyncio.new_event_loop()


def run(main: Coroutine[Any, Any, T], *, debug: bool | None = None) -> T:
    """``asyncio.run`` on uvloop when available."""
    with asyncio.Runner(loop_factory=new_event_loop, debug=debug) as runner:
        return runner.run(main)
