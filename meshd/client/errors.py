"""What a client call raises besides :class:`~meshd.errors.MeshdError`: no daemon, or its error object."""

from __future__ import annotations

import os

from meshd.errors import MeshdError


class DaemonNotRunning(MeshdError):
    """No meshd answers on the socket (missing, refused, or not accessible)."""

    def __init__(self, socket_path: str | os.PathLike, why: str):
        self.socket_path = str(socket_path)
        super().__init__(
            f"no meshd daemon is running at {socket_path} ({why}); start it with "
            f"'systemctl start meshd' (or 'meshd join' in a terminal), or pass --socket PATH "
            f"if it listens elsewhere"
        )


class ApiError(MeshdError):
    """The daemon answered with an OpenAI-style error object."""

    def __init__(self, status: int, message: str, type: str | None = None,
                 code: str | None = None, param: str | None = None):
        self.status, self.type, self.code, self.param = status, type, code, param
        super().__init__(f"{message} (HTTP {status}{', ' + code if code else ''})")
