"""Opt-in process tuning for nodes that receive very large tensor messages.

libzmq allocates a fresh buffer for every message it receives (that buffer is
what we wrap without copying). glibc serves allocations of 32 MiB and more, and
any large allocation made from a non-main arena (libzmq's I/O thread), with a
fresh ``mmap``, so every byte of such a message first costs a page fault that
zeroes the page, and ``munmap`` on release: measured on loopback, a 64 MiB
message then moves at roughly half the speed of one read into a reused buffer
(bench/RESULTS.md, "Transport").

``tune_allocator_for_large_messages()`` makes glibc keep such buffers on its
main heap and reuse them: one arena, a high mmap threshold and a high trim
threshold. It trades a little allocator concurrency and a process footprint
that does not shrink after a burst for page-fault-free large receives. It is a
no-op (returning False) outside glibc. Call it once at daemon start, before
threads allocate; the transport does not call it by itself because it changes
the allocator of the whole process.
"""

from __future__ import annotations

import ctypes
import ctypes.util

from transport.log import get_logger

__all__ = ["tune_allocator_for_large_messages"]

log = get_logger("transport.tuning")

# mallopt parameters from <malloc.h>
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8


def tune_allocator_for_large_messages(max_message_bytes: int = 1 << 30) -> bool:
    """Reuse large receive buffers instead of mapping fresh pages (glibc only)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    limit = min(max_message_bytes + (1 << 20), (1 << 31) - 1)
    ok = (
        mallopt(_M_ARENA_MAX, 1)
        and mallopt(_M_MMAP_THRESHOLD, limit)
        and mallopt(_M_TRIM_THRESHOLD, (1 << 31) - 1)
    )
    log.info("allocator_tuned", ok=bool(ok), mmap_threshold=limit)
    return bool(ok)
