"""Where the client API socket lives, in one place.

The daemon (which binds the socket) and every client (``meshd chat``,
``meshd status``, ``meshd.client``) must agree on the path without talking to
each other first, so both resolve it through :func:`default_socket_path`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

SOCKET_NAME = "meshd.sock"

# The kernel limit for sun_path is 108 bytes including the trailing NUL.
MAX_SOCKET_PATH_BYTES = 107


def default_socket_path(env: Mapping[str, str] | None = None) -> Path:
    """The client API socket path, first match wins.

    1. ``$MESHD_SOCKET`` — explicit override (tests, unusual set-ups).
    2. ``$RUNTIME_DIRECTORY/meshd.sock`` — set by systemd from
       ``RuntimeDirectory=meshd`` (i.e. ``/run/meshd/meshd.sock``). systemd may
       list several directories separated by ``:``; the first is ours.
    3. ``$XDG_RUNTIME_DIR/meshd/meshd.sock`` — a per-user daemon.
    4. ``~/.local/state/meshd/meshd.sock`` — no runtime dir at all.

    A user-run ``meshd status`` talking to the system daemon passes
    ``--socket /run/meshd/meshd.sock`` (or sets ``MESHD_SOCKET``); we do not
    guess between a system and a user daemon because guessing wrong is worse
    than a clear "no daemon at PATH" message.
    """
    env = os.environ if env is None else env
    explicit = env.get("MESHD_SOCKET")
    if explicit:
        return Path(explicit).expanduser()
    runtime = env.get("RUNTIME_DIRECTORY")
    if runtime:
        return Path(runtime.split(":")[0]) / SOCKET_NAME
    xdg = env.get("XDG_RUNTIME_DIR")
    if xdg:
        return Path(xdg) / "meshd" / SOCKET_NAME
    home = env.get("HOME")
    base = Path(home) if home else Path.home()
    return base / ".local" / "state" / "meshd" / SOCKET_NAME


def check_socket_path(path: str | os.PathLike) -> Path:
    """Return ``path`` as a Path, or raise ValueError if the kernel cannot bind it."""
    p = Path(path)
    if len(os.fsencode(p)) > MAX_SOCKET_PATH_BYTES:
        raise ValueError(
            f"unix socket path is {len(os.fsencode(p))} bytes, over the kernel limit "
            f"of {MAX_SOCKET_PATH_BYTES}: {p}"
        )
    return p
