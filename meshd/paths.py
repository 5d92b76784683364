"""Where the client API socket and the state directory live, in one place.

The daemon (which binds the socket and owns the state) and every other
command (``meshd chat``, ``meshd status``, ``meshd apikey``, ``meshd invite``,
``meshd.client``) must agree on both paths without talking to each other
first, so all of them resolve them here.
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
    return _user_state_dir(env) / SOCKET_NAME


STATE_DIR_HELP = "state directory (default $MESHD_HOME, else $STATE_DIRECTORY, else ~/.local/state/meshd)"


def default_state_dir(env: Mapping[str, str] | None = None) -> Path:
    """The state directory when neither ``--state-dir`` nor ``$MESHD_STATE_DIR`` names one.

    1. ``$MESHD_HOME`` — one directory for everything meshd keeps: the state
       and the model cache (``models/``, see ``meshd.model.store``). The
       systemd unit sets it, so a one-off command run as the service's user
       with the same variable (``sudo -u meshd env MESHD_HOME=/var/lib/meshd
       meshd apikey create ha``) reads and writes exactly what the service
       does; without that, the state and the models would be looked for in
       two different places and a key would land where the daemon never looks.
    2. ``$STATE_DIRECTORY`` — set by systemd from ``StateDirectory=``; the
       first of several.
    3. ``~/.local/state/meshd``.

    In earlier releases ``$MESHD_HOME`` held only the model cache. A home created then lives in
    ``~/.local/state/meshd``: while ``$MESHD_HOME`` holds no home and that one does, it
    stays the state directory (``legacy_state_dir_note`` says so), so an upgrade never
    turns a member into a stranger with a new node id.
    """
    env = os.environ if env is None else env
    home = env.get("MESHD_HOME")
    if home:
        legacy = _user_state_dir(env)
        if legacy_home_in_use(Path(home).expanduser(), legacy):
            return legacy
        return Path(home).expanduser()
    state = env.get("STATE_DIRECTORY")
    if state:
        return Path(state.split(":")[0])
    return _user_state_dir(env)


def legacy_home_in_use(meshd_home: Path, legacy: Path) -> bool:
    """A home kept where earlier releases put it while ``$MESHD_HOME`` (then only the model cache) has none."""
    return not (meshd_home / "home.json").exists() and (legacy / "home.json").exists()


def legacy_state_dir_note(env: Mapping[str, str] | None = None) -> str | None:
    """What to tell a user whose home is still where earlier releases put it (None when it is not)."""
    env = os.environ if env is None else env
    home = env.get("MESHD_HOME")
    legacy = _user_state_dir(env)
    if not home or not legacy_home_in_use(Path(home).expanduser(), legacy):
        return None
    return (f"this device's home is in {legacy} (where earlier releases kept it), not in $MESHD_HOME "
            f"({home}), which now holds the state too: move it with `mv {legacy}/* {home}/` while the "
            f"daemon is stopped, or keep passing --state-dir {legacy}")


def _user_state_dir(env: Mapping[str, str]) -> Path:
    """``~/.local/state/meshd``: a user's daemon without systemd or $MESHD_HOME (state and socket)."""
    user = env.get("HOME")
    return (Path(user) if user else Path.home()) / ".local" / "state" / "meshd"


def check_socket_path(path: str | os.PathLike) -> Path:
    """Return ``path`` as a Path, or raise ValueError if the kernel cannot bind it."""
    p = Path(path)
    if len(os.fsencode(p)) > MAX_SOCKET_PATH_BYTES:
        raise ValueError(
            f"unix socket path is {len(os.fsencode(p))} bytes, over the kernel limit "
            f"of {MAX_SOCKET_PATH_BYTES}: {p}"
        )
    return p
