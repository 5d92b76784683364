"""How long a device takes from ``meshd join`` to answering: the model already on disk, one core.

For each model: a one-device home (``meshd join --new-home``, pinned to one core, one torch
thread, self-profiling off as in the other benchmarks) is started ``--reps`` times; the time
to its first ``/health`` 200 is the figure (issue #46: the 1.5B in <= 10 s), and the daemon's
own log says where it went (process start to ``daemon_started``: interpreter and imports;
then the model opened, the stage loaded, the pipeline warmed).

    .venv/bin/python bench/ready.py [--quick] [--json] [--models a,b] [--reps N] [--core N]

The device restarts: one state directory across a model's starts, and its first start (which
makes the home, converts the tokenizer and hashes the file for lending it) is not counted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import finish, machine_banner  # noqa: E402
from bench.ha_commands import Daemon  # noqa: E402
from bench.peers import model_path  # noqa: E402

MODELS = ("smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct")
STEPS = ("daemon_started", "model_ready", "stage_loaded", "pipeline_ready", "pipeline_warm", "daemon_ready")


def steps_of(log_path: Path, started: float) -> dict[str, float]:
    """Seconds from the process's start to each of STEPS' first log line (wall clock)."""
    out: dict[str, float] = {}
    for line in log_path.read_text(errors="replace").splitlines():
        try:
            e = json.loads(line)
        except ValueError:
            continue
        ev = e.get("event")
        if ev in STEPS and ev not in out and "timestamp" in e:
            t = datetime.fromisoformat(e["timestamp"].replace("Z", "+00:00")).timestamp()
            out[ev] = round(t - started, 2)
    return out


def one_start(root: Path, path: str, core: int, settle: bool = False) -> dict:
    """Start the device whose state lives in ``root`` (its home, its caches), time it, stop it.
    ``/health`` is asked every 50 ms (the figure is at most that late). ``settle``: stop only once
    the device has also kept what it builds after it is ready (the manifest it lends the model by),
    as a device that has run a while has."""
    import httpx  # noqa: F401 - imported before the clock starts, not in the first poll

    started = time.time()
    t0 = time.monotonic()
    d = Daemon(root, path, "auto", core)
    try:
        d.wait_ready(600, every_s=0.05)
        ready = time.monotonic() - t0
        deadline = time.monotonic() + 120
        kept = ("share_manifest_ready", "share_manifest_failed", "share_manifest_mismatch", "share_not_shareable")
        while settle and not any(d.count(e) for e in kept):
            if time.monotonic() > deadline:
                print("warning: the first start kept no lending manifest in 120 s; the timed starts may build it",
                      flush=True)
                break
            time.sleep(0.2)  # sleep-ok: polling the daemon's log, with a deadline
    finally:
        d.stop()
    return {"ready_s": round(ready, 2), "steps_s": steps_of(d.log_path, started)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=None, help=f"comma list (default: {','.join(MODELS)}; quick: the embedded one)")
    ap.add_argument("--reps", type=int, default=None, help="timed starts per model (default 3; quick: 1)")
    ap.add_argument("--quick", action="store_true", help="the embedded model, one timed start (< 1 min)")
    ap.add_argument("--core", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.models = args.models or (MODELS[0] if args.quick else ",".join(MODELS))
    args.reps = args.reps or (1 if args.quick else 3)
    setup = {**machine_banner(), "core": args.core, "threads": 1, "reps": args.reps,
             "what": "meshd join restarting with the model on disk, until /health answers 200"}
    print("setup:", json.dumps(setup), flush=True)
    rows = []
    for name in args.models.split(","):
        path = model_path(name)
        if path is None:
            print(f"{name}: not pulled here; skipped", flush=True)
            continue
        with tempfile.TemporaryDirectory(prefix="meshd-ready-") as tmp:
            # the first start makes the home and what a device keeps between starts (the tokenizer's
            # conversion, the manifest it lends the model by): not counted, as a restart has them
            one_start(Path(tmp), str(path), args.core, settle=True)
            runs = [one_start(Path(tmp), str(path), args.core) for _ in range(args.reps)]
        row = {"model": name, "ready_s": statistics.median(r["ready_s"] for r in runs),
               "ready_s_each": [r["ready_s"] for r in runs], "steps_s": runs[-1]["steps_s"]}
        rows.append(row)
        print(f"{name}: ready in {row['ready_s']} s (each {row['ready_s_each']}); last start's steps "
              f"{row['steps_s']}", flush=True)
    finish({"setup": setup, "models": rows}, args.out, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
