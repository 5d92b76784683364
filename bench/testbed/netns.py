"""Thin wrappers over ``ip``/``tc`` for the testbed's namespaces, and crash cleanup.

Naming: a testbed with prefix ``P`` owns namespaces ``P-sw`` (the switch: a
bridge plus the delay proxies) and ``P-h0``, ``P-h1``, ... (the hosts). All its
links live *inside* those namespaces (veth pairs are created in the switch
namespace with their peer directly in the host namespace), so nothing is ever
added to, or changed on, the machine's own interfaces; deleting the namespaces
deletes every link.

Ownership: a live testbed holds an ``flock`` on ``/run/meshd-testbed/P.lock``.
The kernel drops it when the owner dies, however it dies, so "stale" simply
means "namespaces whose lock can be taken" and a cleanup never removes a
testbed another process is still using.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import signal
import subprocess
import time

from meshd.errors import MeshdError

LOCK_DIR = "/run/meshd-testbed"
_NS_RE = re.compile(r"^(?P<base>.+)-(?:sw|h\d+)$")


class TestbedError(MeshdError):
    """The testbed could not be built or torn down (message names the command)."""

    __test__ = False  # not a pytest test class despite the name


def run(cmd: list[str], check: bool = True, timeout: float = 10.0) -> subprocess.CompletedProcess:
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise TestbedError(f"testbed: {' '.join(cmd)}: {e}") from e
    if check and res.returncode != 0:
        raise TestbedError(f"testbed: {' '.join(cmd)}: {res.stderr.strip() or res.returncode}")
    return res


def tools_present() -> bool:
    return shutil.which("ip") is not None and shutil.which("tc") is not None


def list_namespaces() -> list[str]:
    if shutil.which("ip") is None:
        return []
    res = run(["ip", "netns", "list"], check=False)
    # lines look like "name" or "name (id: 3)"
    return [line.split()[0] for line in res.stdout.splitlines() if line.strip()]


def testbed_namespaces(base: str) -> list[str]:
    """Namespaces that belong to the testbed with exactly this prefix."""
    return [ns for ns in list_namespaces() if (m := _NS_RE.match(ns)) and m.group("base") == base]


def ns_pids(ns: str) -> list[int]:
    res = run(["ip", "netns", "pids", ns], check=False)
    return [int(p) for p in res.stdout.split() if p.isdigit()]


def kill_ns_processes(ns: str, grace_s: float = 1.0) -> None:
    """SIGTERM, then SIGKILL, every process still inside ``ns``."""
    pids = ns_pids(ns)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + (grace_s if sig == signal.SIGTERM else 2.0)
        while time.monotonic() < deadline:
            pids = ns_pids(ns)
            if not pids:
                return
            time.sleep(0.02)


def delete_namespace(ns: str) -> None:
    kill_ns_processes(ns)
    run(["ip", "netns", "delete", ns], check=False)


class OwnerLock:
    """An flock that marks a testbed prefix as in use by a live process."""

    def __init__(self, base: str):
        self.path = os.path.join(LOCK_DIR, f"{base}.lock")
        self.fd: int | None = None

    def try_acquire(self) -> bool:
        os.makedirs(LOCK_DIR, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.fd = fd
        return True

    def holder(self) -> str:
        try:
            with open(self.path) as f:
                return f.read().strip() or "?"
        except OSError:
            return "?"

    def release(self, remove: bool = True) -> None:
        if self.fd is None:
            return
        if remove:
            try:
                os.unlink(self.path)
            except OSError:
                pass
        os.close(self.fd)
        self.fd = None


def cleanup(prefix: str = "meshd-tb", force: bool = False) -> tuple[list[str], list[str]]:
    """Remove leftover testbeds whose prefix starts with ``prefix``.

    Returns (removed namespaces, namespaces skipped because a live process owns
    them). ``force`` also removes owned ones.
    """
    groups: dict[str, list[str]] = {}
    for ns in list_namespaces():
        m = _NS_RE.match(ns)
        if m and ns.startswith(prefix):
            groups.setdefault(m.group("base"), []).append(ns)
    removed: list[str] = []
    skipped: list[str] = []
    for base, names in sorted(groups.items()):
        lock = OwnerLock(base)
        if not lock.try_acquire() and not force:
            skipped += names
            continue
        try:
            # hosts first: their processes are the ones doing real work
            for ns in sorted(names, key=lambda n: n.endswith("-sw")):
                delete_namespace(ns)
                removed.append(ns)
        finally:
            lock.release()
    return removed, skipped
