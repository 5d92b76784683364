"""Helpers shared by the benchmarks: setup banner, CPU pinning, peak RSS, JSON last line."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import platform
import resource
import statistics
import time

import torch


def pin(cores: list[int] | None, threads: int) -> None:
    """Pin this process to ``cores`` and use ``threads`` torch threads (simulated device)."""
    if cores is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, set(cores))
    torch.set_num_threads(threads)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def median_time(fn, reps: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def machine_banner() -> dict:
    """What every figure is measured on: the CPU model and the features that decide its kernels, and
    any ISA cap in force (``ATEN_CPU_CAPABILITY``/``ONEDNN_MAX_CPU_ISA`` emulate an older CPU)."""
    from partition.machine import cpu_flags, cpu_name

    caps = {k: os.environ[k] for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA") if k in os.environ}
    return {
        "cpu": cpu_name(),
        "arch": platform.machine(),
        "flags": list(cpu_flags()),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        **({"isa_cap": caps} if caps else {}),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "load_avg_1m": os.getloadavg()[0],
    }


def emit_json(obj: dict) -> None:
    """The last stdout line of every benchmark run with --json."""
    print(json.dumps(obj), flush=True)


def finish(result: dict, out: str | None, as_json: bool) -> None:
    """A run's end: the JSON into ``out`` when asked (indented, for bench/results/), then the
    one-line JSON object last on stdout with --json."""
    if out:
        with open(out, "w") as f:
            f.write(json.dumps(result, indent=1))
    if as_json:
        emit_json(result)


try:  # Linux: a daemon a benchmark starts dies with it
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):
    _prctl = None


def daemon_env(root) -> dict:
    """The environment of a ``meshd join`` a benchmark starts: no inherited MESHD_ settings (but MESHD_HOME),
    one OpenMP thread, quick re-plans, this checkout importable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESHD_") or k == "MESHD_HOME"}
    env.update(OMP_NUM_THREADS="1", MESHD_REPLAN_DEBOUNCE_S="0.5")
    env["PYTHONPATH"] = str(root) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def pinned_child(core: int):
    """A ``preexec_fn``: the child runs on ``core`` only and is killed when the benchmark dies."""
    def preexec():
        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, {core})
        if _prctl is not None:
            _prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    return preexec
