"""Helpers for the daemon tests: spawn real ``meshd join`` processes and always clean up.

The mesh, pairing, lifecycle, serving and sharing tests use these (the ``mesh`` fixture is in
tests/conftest.py). Every
daemon is a separate process with its own state directory, API socket and
ephemeral ports, talking mDNS on loopback (or inside a network namespace).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from meshd.client import MeshdClient
from tests.support.repo import ROOT
from decoding.device import default_cpu_mode
from tests.support.waiting import wait_until

# Fast timings so membership changes show within a few seconds. Not faster: on a test machine running four
# workers' daemons on two cores a daemon's loop is seen to stall 2-4 s (a busy machine), and a member it
# cannot hear from for that long would flap suspect/gone/ready and re-plan under the test.
SUSPECT_AFTER_S, GONE_AFTER_S = 2.0, 4.0
FAST = ["--heartbeat-interval", "0.3", "--suspect-after", str(SUSPECT_AFTER_S), "--gone-after", str(GONE_AFTER_S)]
# The embedded model is fastest on one device of this machine, so a home of two splits it only when neither
# can hold it all: ~190 MiB with a 2048-token cache packed, ~290 MiB in the gguf mode (float32 activations
# and KV cache), which either CPU default mode may be (decoding.device.default_cpu_mode).
HALF_THE_MODEL = ("--memory-budget-mb", "250" if default_cpu_mode() == "gguf" else "120")
# Self-profiling is off unless a test turns it on: two daemons timing themselves on one loaded
# test machine would get different plans from run to run (tests/mesh/test_self_profile.py covers it).
FAST_ENV = {"MESHD_REPLAN_DEBOUNCE_S": "0.5", "MESHD_DRAIN_TIMEOUT_S": "0.5", "MESHD_SELF_PROFILE": "off"}


class DaemonProc:
    def __init__(self, mesh: "Mesh", name: str, args: list[str], env: dict, prefix: list[str]):
        self.name = name
        self.dir = mesh.root / name
        self.state_dir = self.dir / "state"
        self.socket = self.dir / "api.sock"
        self.log_path = self.dir / "daemon.log"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.cmd = [*prefix, sys.executable, "-m", "meshd", "join", "--state-dir", str(self.state_dir),
                    "--socket", str(self.socket), "--name", name, "--model", "none",
                    "--port", "0", "--pairing-port", "0",
                    # one pipeline, as these tests were written for, unless a test picks a layout (a
                    # daemon of an older tree, run through ``prefix``, knows no layouts)
                    *([] if "--layout" in args or prefix else ["--layout", "pipeline"]), *args]
        self.env = env
        self.proc: subprocess.Popen | None = None

    def start(self) -> "DaemonProc":
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=self.env, cwd=ROOT)
        return self

    def status(self) -> dict:
        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError(f"daemon {self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
        return MeshdClient(self.socket, timeout=5.0).status()

    def wait_serving(self, timeout: float = 30.0) -> dict:
        return wait_until(self.status, timeout, what=f"daemon {self.name} to serve its API")

    def node_id(self) -> str:
        return (self.state_dir / "node_id").read_text().strip()

    def events(self) -> list[dict]:
        out = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
        return out

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def cleanup(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)
        with contextlib.suppress(Exception):
            self._log.close()


class Mesh:
    """Spawns daemons under one short temp dir (unix socket paths have a 107-byte limit)."""

    def __init__(self):
        self.root = Path(tempfile.mkdtemp(prefix="meshd-t-"))
        self.procs: list[DaemonProc] = []

    def env(self, extra: dict | None = None) -> dict:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("MESHD_") and k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC",
                                                           "WATCHDOG_PID", "STATE_DIRECTORY",
                                                           "RUNTIME_DIRECTORY")}
        env.update(FAST_ENV)
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        env.update(extra or {})
        return env

    def spawn(self, name: str, *args: str, new_home: str | None = None, token: str | None = None,
              interface: str = "127.0.0.1", env: dict | None = None, prefix: list[str] | None = None,
              start: bool = True) -> DaemonProc:
        extra = list(args) + ["--interface", interface] + FAST
        if new_home:
            extra += ["--new-home", new_home]
        if token:
            extra += ["--token", token]
        p = DaemonProc(self, name, extra, self.env(env), prefix or [])
        self.procs.append(p)
        return p.start() if start else p

    def invite(self, member: DaemonProc) -> str:
        """A token from ``meshd invite`` run against the member's state directory."""
        rc, out = run_cli("invite", "--state-dir", str(member.state_dir), "--json")
        assert rc == 0, out
        return json.loads(out.strip().splitlines()[-1])["token"]

    def pair(self, home: str, *args: str, names=("alpha", "beta"), timeout: float = 60.0
             ) -> tuple[DaemonProc, DaemonProc]:
        """Two daemons with the same ``args`` in a new home: the first creates it, the second joins by
        invite; each serving before this returns (the plan over both is the caller's to wait for)."""
        a = self.spawn(names[0], *args, new_home=home)
        a.wait_serving(timeout)
        b = self.spawn(names[1], *args, token=self.invite(a))
        b.wait_serving(timeout)
        return a, b

    def cleanup(self) -> None:
        for p in self.procs:
            p.cleanup()
        if os.environ.get("MESHD_TEST_KEEP"):  # debugging: keep logs and state dirs
            print(f"kept {self.root}")
            return
        shutil.rmtree(self.root, ignore_errors=True)


def summary(*procs: DaemonProc) -> str:
    """One line per daemon: members' states and the plan, for failure messages."""
    lines = []
    for p in procs:
        try:
            s = p.status()
            plan = s.get("plan") or {}
            lines.append(f"{p.name}: {states(s)} plan v{plan.get('version')} over "
                         f"{plan.get('members')} stages {[st['node_id'] for st in plan.get('stages', [])]} "
                         f"not_admitted={s.get('not_admitted')}")
        except Exception as exc:  # noqa: BLE001
            lines.append(f"{p.name}: no status ({exc})\n{p.log_tail(10)}")
    return "\n".join(lines)


def states(status: dict) -> dict[str, str]:
    """node name -> membership state, from a status dict."""
    return {m["name"]: m["state"] for m in status.get("members", [])}


def run_cli(*argv: str) -> tuple[int, str]:
    """Run the real ``meshd`` CLI in this process (no interpreter start-up); (exit code, stdout)."""
    from meshd import log
    from meshd.cli import main

    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            rc = main(list(argv))
    finally:  # commands configure logging on sys.stdout; do not leave it on our buffer
        log.configure("console", "warning", stream=sys.__stderr__)
    return rc, buf.getvalue()


def meshd_status_json(p: DaemonProc) -> dict:
    """``meshd status --json --socket P``, as a user runs it."""
    rc, out = run_cli("status", "--json", "--socket", str(p.socket))
    assert rc == 0, out
    return json.loads(out)


def kill_hard(p: DaemonProc) -> None:
    p.signal(signal.SIGKILL)
    p.wait(10)


READY_WITHIN_S = 10.0  # the bound for a home to be ready, counted from when all its daemons serve their API


def all_ready(procs, names):
    """A predicate: every daemon sees exactly ``names``, all ready, and a plan over all of them."""
    def check():
        for p in procs:
            s = p.status()
            if states(s) != {n: "ready" for n in names}:
                return False
            plan = s.get("plan") or {}
            if plan.get("members") != sorted(q.node_id() for q in procs):
                return False
        return True
    return check


def plan_nodes(proc) -> list[str]:
    return [s["node_id"] for s in ((proc.status().get("plan") or {}).get("stages") or [])]


def both_ready(a, b) -> bool:
    """Both daemons ready, on one plan version, and the plan spans two stages."""
    sa, sb = a.status(), b.status()
    va, vb = (sa.get("plan") or {}).get("version"), (sb.get("plan") or {}).get("version")
    return (len(plan_nodes(a)) == 2 and va == vb and bool(sa.get("ready")) and bool(sb.get("ready")))


class StreamInBackground:
    """Stream one greedy answer on a thread; ``started`` is set after ``after`` text deltas."""

    def __init__(self, proc, question: str, max_tokens: int, after: int = 3):
        self.started, self.outcome = threading.Event(), {}
        self._args = (proc, question, max_tokens, after)
        self.thread = threading.Thread(target=self._run)
        self.thread.start()

    def _run(self):
        proc, question, max_tokens, after = self._args
        try:
            parts = []
            for delta in MeshdClient(proc.socket, timeout=240).chat(question, stream=True, max_tokens=max_tokens,
                                                                    temperature=0):
                parts.append(delta)
                if len(parts) >= after:
                    self.started.set()
            self.outcome["text"] = "".join(parts)
        except Exception as exc:  # noqa: BLE001 - reported by the test
            self.outcome["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            self.started.set()

    def result(self, timeout: float) -> dict:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the request hung"
        return self.outcome
