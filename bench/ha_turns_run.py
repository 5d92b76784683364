"""``bench/ha_commands.py --turns``: the daemons (one device, or a 2-device home) and llama-server for
bench/ha_turns.py's whole-turn measurement, and the JSON the issue names (``steps_per_token``,
``parity``, the median turn on and off, against llama.cpp)."""

from __future__ import annotations

import contextlib
import json
import tempfile
import time
from pathlib import Path

from bench._common import finish, machine_banner
from bench.ha_home import COMMANDS, HOME, TOOLS
from bench.ha_turns import llama_turns, run_turns

TURN_COMMANDS = [c for c in COMMANDS if c.tool is not None]


def log(msg: str) -> None:
    import sys

    print(msg, file=sys.stderr, flush=True)


@contextlib.contextmanager
def _one_device(root: Path, path: str, weights: str, core: int, where: dict):
    from bench.ha_commands import Daemon

    d = Daemon(root, path, weights, core)
    try:
        t = time.monotonic()
        d.wait_ready(900)
        log(f"one device: daemon ready in {time.monotonic() - t:.1f} s, pinned to core {core}, one torch thread")
        where["layout"] = "one device"
        yield d.port
    finally:
        d.stop()


@contextlib.contextmanager
def _two_devices(root: Path, path: str, weights: str, where: dict):
    from bench.home_assistant import start_homes
    from bench.soak import stop_all

    spawned: list = []
    args = ["--model", path, "--self-profile", "off", *(["--weights", weights] if weights != "auto" else [])]
    try:
        home = start_homes(root, {"mesh": []}, args, [0, 1], spawned, 900.0)[0]
        log(f"2-device home up in {home.up_s:.1f} s: plan {home.layout()} ({home.plan.get('reason')})")
        where.update(layout=home.layout(), plan_reason=home.plan.get("reason"))
        yield home.coordinator.api_port
    finally:
        stop_all(spawned)


def main_turns(args) -> int:
    from meshd.model.store import resolve_model

    model = (args.models or ("qwen2.5-coder-0.5b-instruct" if args.quick else "qwen2.5-coder-1.5b-instruct"))
    model = model.split(",")[0]
    n = args.commands or (3 if args.quick else 12)  # --quick: ~4 minutes (three cold prefills of HA's prompt)
    commands = TURN_COMMANDS[:n]
    path = str(resolve_model(model))
    core = 0 if args.core is None else args.core
    setup = {**machine_banner(), "model": model, "weights": args.weights, "turns": n, "entities": len(HOME),
             "tools": len(TOOLS), "devices": 2 if args.mesh else 1,
             "threads": "each daemon pinned to its own core, one torch thread" if args.mesh
             else f"one daemon pinned to core {core}, one torch thread",
             "decoding": "greedy, num_predict 96, up to 3 tool rounds a turn",
             "order": "every turn with speculation on, then every turn off, each mode on fresh daemons"}
    log("setup: " + json.dumps(setup))
    where: dict = {}
    with tempfile.TemporaryDirectory(prefix="ha-turns-") as tmp:
        runs = iter(range(2))

        def serve():
            root = Path(tmp) / f"run{next(runs)}"
            root.mkdir()
            return (_two_devices(root, path, args.weights, where) if args.mesh
                    else _one_device(root, path, args.weights, core, where))

        res = run_turns(serve, "meshd" if args.mesh else model, commands, log)
    setup.update(where)
    llama = llama_turns(path, commands, core, Path(args.llama_bin) if args.llama_bin else None, log)
    res["llama_cpp"] = llama
    if "median_turn_s" in llama and res["on"]["median_turn_s"]:
        res["turn_ratio_on_over_llama_cpp"] = round(res["on"]["median_turn_s"] / llama["median_turn_s"], 3)
        res["call_ratio_on_over_llama_cpp"] = round(res["on"]["median_call_done_s"] / llama["median_call_done_s"], 3)
    log(f"[{model}] warm median turn: speculation on {res['on']['median_turn_s']} s, off {res['off']['median_turn_s']} s "
        f"(x{res['turn_ratio_on_over_off']}), llama-server {llama.get('median_turn_s', llama.get('skipped'))}; "
        f"(its calls parsed: {llama.get('calls_parsed')}); steps/token on tool calls {res['steps_per_token']}; "
        f"parity {res['parity_turns']}")
    finish({"setup": setup, **res}, args.out, args.json)
    return 0
