"""What this machine is, as a device profile records it: its kind, its memory, its CPU.

Pure facts read from the operating system (no model, no torch), so the profiler that
measures a model (``meshd.model.profiler``), the daemon timing itself and the benchmarks
that label their figures all describe a device the same way.
"""

from __future__ import annotations

import os
import platform


def default_device_id(threads: int) -> str:
    """A stable id for this *kind* of device: ``x86_64-2core-1thread``."""
    return f"{platform.machine() or 'cpu'}-{os.cpu_count() or 1}core-{threads}thread"


def total_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


# The CPU features that decide which kernels a device runs fast: bfloat16/int8 matrix units and dot
# products (x86: AVX2, AVX-512 and its VNNI/BF16 extensions, AVX-VNNI, AMX; ARM: NEON, dot products,
# i8mm, bf16, SVE). A figure measured on one of these kinds says little about another.
RELEVANT_CPU_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx_vnni",
                      "amx_tile", "amx_bf16", "amx_int8", "asimd", "asimddp", "i8mm", "bf16", "sve")


def cpu_flags() -> tuple[str, ...]:
    """The relevant features this CPU reports (``flags`` on x86, ``Features`` on ARM), in a fixed order."""
    have: set[str] = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    have.update(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    return tuple(flag for flag in RELEVANT_CPU_FLAGS if flag in have)
