"""``meshd demo``: the quick-start main job — a real 2-daemon mesh on loopback answers a question.

Starts two daemons (separate state dirs, each pinned to its own CPU core with
one torch thread), creates a home on the first and pairs the second with an
invite token, waits until the plan splits the model's layers between them,
streams an answer through the first daemon's unix socket, prints a summary
line, and stops both daemons cleanly (SIGTERM, exit 0).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from meshd.errors import MeshdError

DEMO_PROMPT = ("The living room is at 17°C, the window is open and the heating is off. "
               "In two short sentences: what should I do to warm the room up quickly?")
FAST = ["--heartbeat-interval", "0.5", "--suspect-after", "2", "--gone-after", "4"]
# Each daemon stands for a CPU device pinned to its own core: on a GPU machine, join's default
# (auto) would put both on the one GPU and the demo would no longer show what it says.
CPU_DEVICE = ["--device", "cpu"]
# Each stands for a small device that cannot hold the model alone (packed, the embedded model and a
# 2,048-token cache need ~154 MiB): a home splits the model only when that pays or is needed, and
# on one machine a split of a 135M model never pays.
SMALL_DEVICE = ["--memory-budget-mb", "120"]
WEAK_MODEL_NOTE = ("note: the embedded SmolLM2-135M is a demo model: fast, but too small for dependable answers, "
                   "and it cannot call Home Assistant's tools. For a home: `meshd model pull "
                   "qwen2.5-coder-1.5b-instruct`, then `--model qwen2.5-coder-1.5b-instruct` (see the README).")


def register(sub) -> None:
    p = sub.add_parser("demo", help="start a 2-daemon mesh on loopback and answer a prompt (quick start)")
    p.add_argument("--prompt", default=DEMO_PROMPT)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--model", default=None, help="model path (default: the embedded SmolLM2-135M)")
    p.add_argument("--keep", action="store_true", help="keep the demo's state dirs and logs")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.set_defaults(func=run)


class DemoDaemon:
    def __init__(self, root: Path, name: str, core: int, model: str | None, extra: list[str]):
        self.name, self.dir = name, root / name
        self.dir.mkdir(parents=True)
        self.state, self.socket, self.log = self.dir / "state", self.dir / "api.sock", self.dir / "daemon.log"
        cmd = [sys.executable, "-m", "meshd", "join", "--state-dir", str(self.state), "--socket",
               str(self.socket), "--name", name, "--port", "0", "--pairing-port", "0",
               "--interface", "127.0.0.1", "--listen", "127.0.0.1", *FAST, *CPU_DEVICE, *SMALL_DEVICE, *extra]
        if model:
            cmd += ["--model", model]
        env = {k: v for k, v in os.environ.items() if not k.startswith("MESHD_") or k == "MESHD_HOME"}
        env.update(OMP_NUM_THREADS="1", MESHD_REPLAN_DEBOUNCE_S="0.5")
        ncpu = os.cpu_count() or 1

        def pin():
            if hasattr(os, "sched_setaffinity"):
                os.sched_setaffinity(0, {core % ncpu})

        self.proc = subprocess.Popen(cmd, stdout=open(self.log, "ab"), stderr=subprocess.STDOUT,
                                     env=env, preexec_fn=pin)

    def client(self, timeout: float = 300.0):
        from meshd.client import MeshdClient

        return MeshdClient(self.socket, timeout=timeout)

    def status(self) -> dict | None:
        if self.proc.poll() is not None:
            raise MeshdError(f"daemon {self.name} exited ({self.proc.returncode}); log: {self.log}\n"
                             + "\n".join(self.log.read_text(errors="replace").splitlines()[-15:]))
        try:
            return self.client(5.0).status()
        except MeshdError:
            return None

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                return None
        return self.proc.returncode


def _wait(what: str, cond, timeout: float, quiet: bool):
    deadline = time.monotonic() + timeout
    if not quiet:
        print(f"… waiting for {what}", file=sys.stderr, flush=True)
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.25)
    raise MeshdError(f"timed out after {timeout:.0f}s waiting for {what}")


def two_stage_plan(a: DemoDaemon, b: DemoDaemon):
    """Both daemons agree on a plan that gives each of them layers, and both serve it warm."""
    sa, sb = a.status(), b.status()
    pa, pb = (sa or {}).get("plan") or {}, (sb or {}).get("plan") or {}
    if (len(pa.get("stages") or []) == 2 and pa.get("version") == pb.get("version")
            and sa.get("ready") and sb.get("ready")):
        return sa
    return None


def start_home(root: Path, model: str, quiet: bool, daemons: list[DemoDaemon]) -> dict:
    """Start demo-a (a new home) and demo-b (paired with an invite) under ``root``, appending each
    to ``daemons`` as it starts (the caller stops them, also on failure); the status once both
    serve one warm plan that splits the layers between them."""
    a = DemoDaemon(root, "demo-a", 0, model, ["--new-home", "demo"])
    daemons.append(a)
    _wait("daemon demo-a to serve its API", a.status, 90, quiet)
    invite = subprocess.run([sys.executable, "-m", "meshd", "invite", "--state-dir", str(a.state), "--json"],
                            capture_output=True, text=True)
    if invite.returncode != 0:
        raise MeshdError(f"meshd invite failed: {invite.stderr.strip()}")
    token = json.loads(invite.stdout.strip().splitlines()[-1])["token"]
    b = DemoDaemon(root, "demo-b", 1, model, ["--token", token])
    daemons.append(b)
    _wait("daemon demo-b to pair and serve", b.status, 90, quiet)
    return _wait("the plan to split the layers over both devices", lambda: two_stage_plan(a, b), 120, quiet)


def run(args) -> int:
    from meshd.model.store import resolve_model

    model = str(resolve_model(args.model))  # fails early, with a clear message, if not pulled
    root = Path(tempfile.mkdtemp(prefix="meshd-demo-"))
    quiet = args.json
    daemons: list[DemoDaemon] = []
    try:
        status = start_home(root, model, quiet, daemons)
        a = daemons[0]
        names = {m["node_id"]: m["name"] for m in status.get("members", [])}
        devices = [{"device": names.get(s["node_id"], s["node_id"]), "node_id": s["node_id"],
                    "layers": s["layers"]} for s in status["plan"]["stages"]]
        if not quiet:
            print(f"\n> {args.prompt}\n")
        stream = a.client().chat(args.prompt, stream=True, max_tokens=args.max_tokens, temperature=0)
        for delta in stream:
            if not quiet:
                sys.stdout.write(delta)
                sys.stdout.flush()
        tokens = (stream.usage or {}).get("completion_tokens", 0)
        ttft = stream.ttft_s or 0.0
        decode_s = max((stream.elapsed_s or 0.0) - ttft, 1e-9)
        tps = (tokens - 1) / decode_s if tokens > 1 else 0.0
        if args.json:
            print(json.dumps({"text": stream.text, "devices": devices, "ttft_s": ttft, "tokens_per_s": tps,
                              "tokens": tokens, "model": status.get("model"),
                              "plan_version": status["plan"]["version"]}))
        else:
            # half-open, as --json and `meshd status --json` write them
            where = ", ".join(f"{d['device']} layers [{d['layers'][0]},{d['layers'][1]})" for d in devices)
            print(f"\n\n[{tokens} tokens | TTFT {ttft * 1000:.0f} ms | {tps:.1f} tokens/s | {where}]")
            if args.model is None:
                print(WEAK_MODEL_NOTE, file=sys.stderr)
    finally:
        codes = [d.stop() for d in daemons]
        if not quiet and daemons:
            print(f"stopped {len(daemons)} daemons (exit codes {codes})", file=sys.stderr)
        if args.keep:
            print(f"demo state and logs kept in {root}", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)
    return 0
