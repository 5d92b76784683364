"""Where the API listens: addresses from the command line, and the sockets bound to them.

The unix socket is the trusted door (mode 0660, the meshd group); a socket
file left by a daemon that died is replaced, one that still answers is
another daemon's and is refused. TCP listeners are named ``HOST:PORT``;
``--api-listen`` stays on loopback, ``--http`` may face the LAN (and then
needs API keys, :mod:`meshd.api.auth`). Every error names the flag the user
gave and what to change.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
import ssl
import stat
from pathlib import Path

from meshd.api.common import log
from meshd.errors import MeshdError
from meshd.paths import check_socket_path

SOCKET_MODE = 0o660
OLLAMA_PORT = 11434


class ApiStartError(MeshdError):
    """The API socket or TCP port cannot be opened."""


def parse_listen(spec: str, *, flag: str = "--api-listen", loopback_only: bool = True) -> tuple[str, int]:
    """``127.0.0.1:8080`` / ``[::1]:8080`` / ``localhost:8080`` -> (host, port).

    ``--api-listen`` (``loopback_only``) serves this machine only and needs no
    key (unless ``--require-keys``). ``--http`` may name any address; listeners
    off loopback require an API key on every request. Errors name the flag the
    user actually gave.
    """
    host, sep, port_s = spec.rpartition(":")
    if not sep or not host:
        raise ApiStartError(f"{flag} expects HOST:PORT, e.g. 127.0.0.1:8080 (got {spec!r})")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        port = int(port_s)
    except ValueError:
        raise ApiStartError(f"{flag} port must be a number (got {port_s!r})") from None
    if not 0 <= port <= 65535:
        raise ApiStartError(f"{flag} port must be 0..65535 (got {port})")
    if host == "localhost":
        host = "127.0.0.1"
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        raise ApiStartError(f"{flag} host must be an IP address (got {host!r})") from None
    if loopback_only and not addr.is_loopback:
        raise ApiStartError(
            f"{flag} {spec} refused: {flag} serves this machine only, without authentication, so it "
            f"listens on loopback addresses (127.0.0.0/8 or ::1); for the LAN use "
            f"--http {spec} with an API key from 'meshd apikey create'"
        )
    return str(addr), port


def is_loopback(host: str) -> bool:
    return ipaddress.ip_address(host).is_loopback


def tls_context(cert: str | os.PathLike, key: str | os.PathLike) -> ssl.SSLContext:
    """A server TLS context from a PEM certificate chain and key (TLS 1.2+)."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(str(cert), str(key))
    except (OSError, ssl.SSLError) as exc:
        raise ApiStartError(f"cannot load the TLS certificate {cert} / key {key}: {exc}") from None
    return ctx


def _socket_answers(path: Path) -> bool:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(1.0)
    try:
        s.connect(str(path))
        return True
    except OSError as exc:
        if exc.errno in (errno.ECONNREFUSED, errno.ENOENT):
            return False
        raise ApiStartError(f"cannot check existing socket {path}: {exc}") from exc
    finally:
        s.close()


def bind_unix(path: Path) -> socket.socket:
    path = check_socket_path(path)
    path.parent.mkdir(mode=0o750, parents=True, exist_ok=True)
    if path.exists() or path.is_symlink():
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise ApiStartError(f"{path} exists and is not a socket; refusing to replace it")
        if _socket_answers(path):
            raise ApiStartError(f"another meshd is already serving on {path}; a second daemon on this "
                                f"machine needs its own --socket and --state-dir, and --port 0 "
                                f"--pairing-port 0")
        log.info("api_stale_socket_removed", path=str(path))
        path.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(str(path))
        os.chmod(path, SOCKET_MODE)
    except OSError as exc:
        sock.close()
        raise ApiStartError(f"cannot bind the API socket {path}: {exc}") from exc
    return sock


def bind_tcp(host: str, port: int, spec: str, flag: str = "--api-listen") -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family)
    except OSError as exc:
        raise ApiStartError(f"cannot listen on {spec} ({flag}): {bind_error(exc, flag, port)}") from exc


def bind_error(exc: OSError, flag: str, port: int) -> str:
    """Why an API port cannot be bound, and what to change: the API's own flag, not other ports."""
    reason = os.strerror(exc.errno) if exc.errno else str(exc)
    if exc.errno != errno.EADDRINUSE:
        return reason
    who = (" (an Ollama server listens there by default: stop it, e.g. 'systemctl stop ollama')"
           if port == OLLAMA_PORT else "")
    return f"{reason}: another program listens on that port{who}; stop it or give {flag} another port"
