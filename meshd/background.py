"""Work a device does for later (hashing its model for lending), kept out of serving's way.

Such work runs in a thread of its own at the lowest CPU priority (Linux gives each thread its
own nice value), so on a one-core device it takes only time nothing else wants: a start that
hashed a 1 GB file beside loading the model was ready ~2 s later. The thread is its own, not
the loop's pool: an unprivileged process cannot raise a thread's priority back. The work must
not hold the GIL for long (file reads and hashlib release it), or the main thread would wait on
a thread that rarely runs.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

IDLE_NICE = 19


async def run_idle(fn: Callable[..., T], *args, name: str = "meshd-idle") -> T:
    """``fn(*args)`` in a new thread at nice 19; its result or exception, awaited."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def settle(ok: bool, value) -> None:
        if done.cancelled():
            return
        done.set_result(value) if ok else done.set_exception(value)

    def body() -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), IDLE_NICE)
        except (AttributeError, OSError):  # not Linux, or not allowed: the usual priority
            pass
        try:
            result = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task
            outcome = (False, exc)
        else:
            outcome = (True, result)
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:
            pass  # the loop closed while we worked: nobody is waiting

    threading.Thread(target=body, name=name, daemon=True).start()
    return await done
