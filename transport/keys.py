"""A home's CURVE keys: this node's keypair and the allow-list of peer keys.

Layout under the daemon's state directory::

    keys/                 0700
      node.key            public key (pyzmq certificate format, readable)
      node.key_secret     secret key (0600)
      allowed_peers.json  {"peers": {"<z85 public key>": {"name": ..., "added": ...}}}

The certificate files use pyzmq's format so ``zmq.auth.load_certificate`` and
the usual ZeroMQ tools can read them. The allow-list is JSON rather than a
line format because z85 uses ``#`` and most punctuation, which makes
comment syntax ambiguous. Every write goes through a temp file and
``os.replace`` so a daemon reading concurrently never sees half a file, and
``AllowList`` reloads when the file's mtime changes: a ``meshd`` command that
admits a new member takes effect on the running daemon's next handshake.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth

from transport.errors import KeyStoreError

__all__ = [
    "Keypair",
    "AllowList",
    "load_or_create_keypair",
    "keys_dir",
    "allowlist_path",
    "fingerprint",
    "validate_public_key",
]

KEY_NAME = "node"
ALLOWLIST_FILE = "allowed_peers.json"


def keys_dir(state_dir: str | os.PathLike) -> Path:
    return Path(state_dir) / "keys"


def allowlist_path(state_dir: str | os.PathLike) -> Path:
    return keys_dir(state_dir) / ALLOWLIST_FILE


def validate_public_key(key: bytes | str) -> bytes:
    """Return the key as z85 bytes, or raise ``KeyStoreError`` if it is not one."""
    if isinstance(key, str):
        key = key.encode("ascii", "replace")
    if not isinstance(key, bytes) or len(key) != 40:
        raise KeyStoreError(f"a CURVE public key is 40 z85 characters, got {key!r}")
    try:
        raw = zmq.utils.z85.decode(key)
    except Exception:
        raise KeyStoreError(f"not a z85-encoded key: {key!r}") from None
    if len(raw) != 32:
        raise KeyStoreError(f"a CURVE key decodes to 32 bytes, got {len(raw)}")
    return key


def fingerprint(public_key: bytes | str) -> str:
    """A short, human-comparable name for a public key (``ab12-cd34-ef56-7890``).

    Shown in logs and pairing prompts so two people can compare keys by voice;
    64 bits of SHA-256 is plenty to tell apart the keys of one home.
    """
    raw = zmq.utils.z85.decode(validate_public_key(public_key))
    h = hashlib.sha256(raw).hexdigest()[:16]
    return "-".join(h[i : i + 4] for i in range(0, 16, 4))


@dataclass(frozen=True)
class Keypair:
    public: bytes  # z85, 40 bytes
    secret: bytes  # z85, 40 bytes

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.public)

    @classmethod
    def generate(cls) -> "Keypair":
        """A fresh keypair that is not stored anywhere (tests, benchmarks)."""
        public, secret = zmq.curve_keypair()
        return cls(public, secret)

    def __repr__(self) -> str:  # never print the secret into a log
        return f"Keypair(fingerprint={self.fingerprint!r})"


def _ensure_private_dir(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)


def load_or_create_keypair(state_dir: str | os.PathLike) -> Keypair:
    """Load this node's keypair from ``state_dir/keys``, creating it on first run."""
    kdir = keys_dir(state_dir)
    secret_file = kdir / f"{KEY_NAME}.key_secret"
    if not secret_file.exists():
        _ensure_private_dir(kdir)
        # Generate in a private temp dir, then move into place: a second
        # process racing us either sees no key or a complete one.
        with tempfile.TemporaryDirectory(dir=kdir, prefix=".new-") as tmp:
            os.chmod(tmp, 0o700)
            pub_path, sec_path = zmq.auth.create_certificates(tmp, KEY_NAME)
            os.chmod(sec_path, 0o600)
            os.chmod(pub_path, 0o644)
            if not secret_file.exists():
                os.replace(pub_path, kdir / f"{KEY_NAME}.key")
                os.replace(sec_path, secret_file)
    try:
        public, secret = zmq.auth.load_certificate(secret_file)
    except Exception as e:
        raise KeyStoreError(f"cannot read keypair {secret_file}: {e}") from None
    if not public or not secret:
        raise KeyStoreError(f"keypair file {secret_file} lacks a public or secret key")
    mode = secret_file.stat().st_mode & 0o777
    if mode & 0o077:
        raise KeyStoreError(
            f"{secret_file} is readable by others (mode {mode:o}); run: chmod 600 {secret_file}"
        )
    return Keypair(validate_public_key(public), secret)


class AllowList:
    """The public keys admitted into this home, persisted as JSON.

    Reads are cheap and live: ``__contains__`` re-reads the file only when its
    mtime or size changed, so the ZAP handler can call it on every handshake.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._peers: dict[bytes, dict] = {}
        self._stamp: tuple[int, int] | None = None
        self._reload_if_changed()

    @classmethod
    def for_state_dir(cls, state_dir: str | os.PathLike) -> "AllowList":
        return cls(allowlist_path(state_dir))

    def _file_stamp(self) -> tuple[int, int] | None:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return None
        return (st.st_mtime_ns, st.st_size)

    def _reload_if_changed(self) -> None:
        stamp = self._file_stamp()
        if stamp == self._stamp:
            return
        peers: dict[bytes, dict] = {}
        if stamp is not None:
            try:
                data = json.loads(self.path.read_text())
                for key, info in data.get("peers", {}).items():
                    peers[validate_public_key(key)] = dict(info or {})
            except (OSError, ValueError, AttributeError, KeyStoreError) as e:
                raise KeyStoreError(f"cannot read allow-list {self.path}: {e}") from None
        self._peers, self._stamp = peers, stamp

    def _save(self) -> None:
        _ensure_private_dir(self.path.parent)
        data = {"peers": {k.decode("ascii"): v for k, v in sorted(self._peers.items())}}
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".allowed-", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=2, sort_keys=True)
                f.write("\n")
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self._stamp = self._file_stamp()

    def add(self, public_key: bytes | str, name: str = "") -> None:
        key = validate_public_key(public_key)
        self._reload_if_changed()
        self._peers[key] = {"name": name, "added": time.time(), "fingerprint": fingerprint(key)}
        self._save()

    def remove(self, public_key: bytes | str) -> bool:
        key = validate_public_key(public_key)
        self._reload_if_changed()
        if self._peers.pop(key, None) is None:
            return False
        self._save()
        return True

    def __contains__(self, public_key: object) -> bool:
        try:
            key = validate_public_key(public_key)  # type: ignore[arg-type]
        except KeyStoreError:
            return False
        self._reload_if_changed()
        return key in self._peers

    def keys(self) -> list[bytes]:
        self._reload_if_changed()
        return sorted(self._peers)

    def name_of(self, public_key: bytes | str) -> str:
        self._reload_if_changed()
        return self._peers.get(validate_public_key(public_key), {}).get("name", "")

    def __len__(self) -> int:
        self._reload_if_changed()
        return len(self._peers)
