"""Work a device does for later (hashing its model for lending) runs where serving does not feel it."""

from __future__ import annotations

import os
import threading

import pytest

from meshd.background import IDLE_NICE, run_idle


async def test_background_work_runs_at_the_lowest_priority_on_a_thread_of_its_own():
    def where() -> tuple[int, int]:
        tid = threading.get_native_id()
        return tid, os.getpriority(os.PRIO_PROCESS, tid)

    tid, nice = await run_idle(where)
    assert nice == IDLE_NICE
    assert tid != threading.get_native_id()
    # the caller's own thread, and the loop's pool, keep their priority
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) != IDLE_NICE


async def test_background_work_hands_back_its_result_and_its_error():
    assert await run_idle(sum, [1, 2, 3]) == 6
    with pytest.raises(ZeroDivisionError):
        await run_idle(lambda: 1 / 0)
