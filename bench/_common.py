"""Helpers shared by the benchmarks: setup banner, CPU pinning, peak RSS, JSON last line."""

from __future__ import annotations

import json
import os
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
    return {
        "cpu": platform.processor() or platform.machine(),
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


def served_reference_stage(source):
    """The whole model as one stage in the numeric mode a daemon serves in by default (``--weights
    auto``: packed on a CPU with torch's int4 kernel), warmed up as a daemon is before it serves (a
    process's first packed forward may differ in the last bits): what a mesh's answers must equal."""
    from decoding.device import Placement

    p = Placement.resolve("cpu")
    stage = source.load_stage(0, source.config.num_layers, p.dtype, packed=p.packed)
    kv = stage.new_cache(64)
    kv.create("warm-up", 8)
    stage.forward(kv, "warm-up", torch.tensor([1, 2, 3]))
    return stage
