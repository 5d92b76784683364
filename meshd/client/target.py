"""Where a client's requests go (the unix socket, or a TCP base URL with a key), and why they did not get there.

:class:`ClientBase` is what the blocking and asyncio clients share around it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import httpx

from meshd.client.errors import DaemonNotRunning
from meshd.errors import MeshdError
from meshd.paths import default_socket_path

DEFAULT_TIMEOUT_S = 600.0  # a long answer on slow devices takes minutes


class Target:
    """Where requests go: the unix socket (default) or a TCP base URL, with an optional key."""

    def __init__(self, socket_path, base_url: str | None, api_key: str | None, timeout: float):
        self.socket_path = Path(socket_path) if socket_path else default_socket_path()
        self.base_url = base_url.rstrip("/") if base_url else None
        self.where = self.base_url or str(self.socket_path)
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout_s = timeout
        self.timeout = httpx.Timeout(timeout, connect=min(timeout, 10.0))

    def client_kwargs(self, transport_cls) -> dict[str, Any]:
        kw: dict[str, Any] = {"timeout": self.timeout, "headers": self.headers}
        if self.base_url:
            kw["base_url"] = self.base_url
        else:
            kw["base_url"] = "http://localhost"
            kw["transport"] = transport_cls(uds=str(self.socket_path))
        return kw

    def no_answer(self, exc: httpx.TransportError) -> MeshdError:
        """Why a request got no answer: it timed out, or the daemon could not be reached."""
        if isinstance(exc, httpx.TimeoutException):
            return MeshdError(f"meshd at {self.where} did not answer in {self.timeout_s:g}s")
        return self.unreachable(exc)

    def unreachable(self, exc: BaseException) -> MeshdError:
        if self.base_url:
            return DaemonNotRunning(self.base_url, f"cannot connect: {exc}")
        return not_running(self.socket_path, exc)


def not_running(path: Path, exc: BaseException) -> MeshdError:
    cause = exc
    while cause.__cause__ is not None or cause.__context__ is not None:  # httpx wraps the OSError
        if isinstance(cause, OSError):
            break
        cause = cause.__cause__ or cause.__context__
    if isinstance(cause, FileNotFoundError):
        return DaemonNotRunning(path, "no socket there")
    if isinstance(cause, ConnectionRefusedError):
        return DaemonNotRunning(path, "socket exists but nothing is listening")
    if isinstance(cause, PermissionError):
        return MeshdError(
            f"permission denied on {path}; add your user to the 'meshd' group "
            f"(the socket is mode 0660) and log in again"
        )
    return DaemonNotRunning(path, str(cause))


class ClientBase:
    """What the blocking and asyncio clients share: where they send, how long they wait, the model.

    A subclass names its httpx client and transport classes.
    """

    http_class: type
    transport_class: type

    def __init__(self, socket_path: str | os.PathLike | None = None, *,
                 timeout: float = DEFAULT_TIMEOUT_S, model: str | None = None,
                 base_url: str | None = None, api_key: str | None = None):
        self._target = Target(socket_path, base_url, api_key, timeout)
        self.socket_path = self._target.socket_path
        self.timeout = timeout
        self.model = model
        self._http = self.http_class(**self._target.client_kwargs(self.transport_class))
