"""``meshd status``: who is in the mesh, what each device runs, how fast it goes.

Reads ``GET /v1/mesh/status`` from the local daemon, found by ``--socket``, or
by the socket its state directory records (``--state-dir`` or ``$MESHD_HOME``:
the same directory every other command is given), and prints it as
:mod:`meshd.commands.status_render` lays it out (or as JSON).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from meshd.client import MeshdClient
from meshd.commands.status_render import render_status
from meshd.errors import MeshdError
from meshd.paths import STATE_DIR_HELP
from meshd.readiness import not_ready_reason


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "status", help="show the mesh: devices, layers, plan, speed",
        description="Show the local daemon's view of the mesh.",
    )
    p.add_argument("--socket", help="daemon socket (default: $MESHD_SOCKET, $RUNTIME_DIRECTORY, "
                                    "$XDG_RUNTIME_DIR/meshd/meshd.sock)")
    p.add_argument("--state-dir", default=None,
                   help=f"find the daemon by the socket it records in its {STATE_DIR_HELP}")
    p.add_argument("--json", action="store_true", help="print the raw status as JSON")
    p.add_argument("--watch", nargs="?", type=float, const=2.0, default=None, metavar="SECONDS",
                   help="refresh every SECONDS (default 2) until Ctrl-C")
    p.add_argument("--wait", type=float, default=None, metavar="SECONDS",
                   help="first wait, up to SECONDS, until the daemon answers (for scripts that start "
                        "one in the background); exit 1 if it does not")
    p.add_argument("--ready", action="store_true",
                   help="with --wait: until it is also ready to serve requests (what systemd's READY=1 "
                        "means: model loaded, a plan warm)")
    p.add_argument("--stages", type=int, default=None, metavar="N",
                   help="with --wait: until the plan also gives layers to at least N devices")
    p.set_defaults(func=run)


def wait_for_daemon(client: MeshdClient, timeout_s: float, ready: bool = False, stages: int = 0,
                    interval_s: float = 0.25) -> dict[str, Any]:
    """The daemon's status once it answers (with ``ready``: once it says it is ready to serve;
    with ``stages``: once its plan gives layers to that many devices); a MeshdError naming what it
    still waits for, or why it cannot be asked, when ``timeout_s`` passes first. Lets a script
    start daemons in the background and go on when they can answer, without guessing a sleep."""
    deadline = time.monotonic() + timeout_s
    last = "no answer yet"
    while True:
        try:
            status = client.status()
            plan = status.get("plan") or {}
            spans = len(plan.get("stages") or [])
            if (status.get("ready") or not ready) and spans >= stages:
                return status
            last = (f"model {status.get('load_state', '?')}, "
                    + (f"plan v{plan.get('version')} over {spans} device(s)" if status.get("ready")
                       else not_ready_reason(status)))
        except MeshdError as exc:  # not listening yet: it may still be starting
            last = str(exc)
        if time.monotonic() >= deadline:
            want = "answering" + (", ready" if ready else "") + (f", over {stages} devices" if stages else "")
            raise MeshdError(f"the daemon is not yet {want} after {timeout_s:g} s ({last})")
        time.sleep(interval_s)


def daemon_socket(socket: str | None, state_dir: str | None, env=None) -> Path | None:
    """The socket to ask: ``--socket``; else the one the daemon of ``--state-dir`` records in its
    ``daemon.json`` (an error if that directory holds no home or no running daemon); else, with
    ``$MESHD_HOME`` set and no ``$MESHD_SOCKET``, the one recorded there if any; else None (the
    default path, ``meshd.paths``)."""
    from meshd.state import RUNTIME_FILE, StateDir

    env = os.environ if env is None else env
    if socket:
        return Path(socket).expanduser()
    if state_dir:
        state = StateDir.of_home(Path(state_dir).expanduser())
    elif env.get("MESHD_HOME") and not env.get("MESHD_SOCKET"):
        state = StateDir(Path(env["MESHD_HOME"]).expanduser())
    else:
        return None
    try:
        return Path(json.loads((state.root / RUNTIME_FILE).read_text())["socket"])
    except (OSError, ValueError, KeyError, TypeError):
        if state_dir:
            raise MeshdError(f"no meshd daemon is running with state directory {state.root} "
                             f"(no readable {RUNTIME_FILE}); start it, or pass --socket") from None
        return None


def run(args) -> int:
    client = MeshdClient(daemon_socket(args.socket, args.state_dir), timeout=10.0)
    if (args.ready or args.stages) and args.wait is None:
        raise MeshdError("--ready and --stages go with --wait SECONDS (how long to wait)")
    if args.wait is not None:
        wait_for_daemon(client, args.wait, ready=args.ready, stages=args.stages or 0)
    if args.watch is None:
        print(_show(client.status(), args.json))
        return 0
    interval = max(args.watch, 0.2)
    clear = "\x1b[H\x1b[2J" if sys.stdout.isatty() and not args.json else ""
    try:
        while True:
            try:
                text = _show(client.status(), args.json)
            except MeshdError as exc:  # keep watching: the daemon may be restarting
                text = f"{exc}\n(retrying every {interval:g} s; Ctrl-C to stop)"
            print(clear + text, flush=True)
            time.sleep(interval)
    except KeyboardInterrupt:
        return 0


def _show(status: dict[str, Any], as_json: bool) -> str:
    return json.dumps(status, indent=2, sort_keys=True) if as_json else render_status(status)
