"""systemd's sd_notify protocol without libsystemd: one datagram per state change.

``NOTIFY_SOCKET`` names a unix datagram socket (a leading ``@`` means the
abstract namespace). Outside systemd the variable is unset and every call is a
cheap no-op, so the daemon calls these unconditionally.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping


class Notifier:
    def __init__(self, env: Mapping[str, str] | None = None):
        env = os.environ if env is None else env
        addr = env.get("NOTIFY_SOCKET") or None
        if addr and addr.startswith("@"):
            addr = "\0" + addr[1:]
        self.address = addr
        self.watchdog_interval_s = self._watchdog_interval(env)

    @staticmethod
    def _watchdog_interval(env: Mapping[str, str]) -> float | None:
        """Half of WATCHDOG_USEC (systemd's own advice), if the watchdog targets us."""
        usec = env.get("WATCHDOG_USEC")
        pid = env.get("WATCHDOG_PID")
        if not usec or (pid and pid.isdigit() and int(pid) != os.getpid()):
            return None
        try:
            value = int(usec)
        except ValueError:
            return None
        return value / 1e6 / 2 if value > 0 else None

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def notify(self, *fields: str) -> bool:
        """Send ``fields`` (e.g. "READY=1") as one datagram; False if not under systemd."""
        if not self.address:
            return False
        msg = "\n".join(fields).encode()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
                s.sendto(msg, self.address)
        except OSError:
            return False  # systemd went away; never let this take the daemon down
        return True

    def ready(self, status: str = "") -> bool:
        return self.notify("READY=1", *([f"STATUS={status}"] if status else []))

    def stopping(self) -> bool:
        return self.notify("STOPPING=1")

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    def status(self, text: str) -> bool:
        return self.notify(f"STATUS={text}")
