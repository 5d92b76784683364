"""API keys for the LAN listener: created once, shown once, stored only as hashes.

``meshd apikey create`` prints a new key (``meshd-<43 url-safe chars>``, 256
random bits) and stores its SHA-256 with a name and creation time in
``api_keys.json`` in the state directory (mode 0600, written atomically).
Keys carry that much entropy, so a plain SHA-256 is the right hash (a slow
password hash protects guessable secrets; these are not guessable) and it
lets the daemon check a key in microseconds. The daemon re-reads the file
when it changes, so ``create``/``revoke`` take effect without a restart.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from meshd.errors import MeshdError

KEYS_FILE = "api_keys.json"
PREFIX = "meshd-"


class ApiKeyError(MeshdError):
    """An API key operation cannot be done (unknown name, duplicate, unreadable store)."""


@dataclass(frozen=True)
class ApiKey:
    name: str
    sha256: str
    created: float  # unix time

    @property
    def key_id(self) -> str:
        """A short, public handle for a key (never enough to use it)."""
        return self.sha256[:8]


def _hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class ApiKeyStore:
    """The hashed keys in ``<state dir>/api_keys.json``."""

    def __init__(self, state_dir: str | os.PathLike):
        self.path = Path(state_dir) / KEYS_FILE
        self._cache: tuple[tuple[int, int], dict[str, ApiKey]] | None = None

    def keys(self) -> list[ApiKey]:
        return sorted(self._load().values(), key=lambda k: k.created)

    def _load(self) -> dict[str, ApiKey]:
        """name -> key, re-read only when the file changed (checked per request: cheap)."""
        try:
            st = self.path.stat()
        except FileNotFoundError:
            self._cache = None
            return {}
        sig = (st.st_mtime_ns, st.st_size)
        if self._cache is not None and self._cache[0] == sig:
            return self._cache[1]
        try:
            raw = json.loads(self.path.read_text())
            keys = {k["name"]: ApiKey(k["name"], k["sha256"], float(k["created"]))
                    for k in raw.get("keys", [])}
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ApiKeyError(f"{self.path} is unreadable or corrupt ({exc}); fix or remove it") from None
        self._cache = (sig, keys)
        return keys

    def _save(self, keys: dict[str, ApiKey]) -> None:
        from meshd.state import atomic_write

        self.path.parent.mkdir(parents=True, exist_ok=True)
        body = {"keys": [asdict(k) for k in sorted(keys.values(), key=lambda k: k.created)]}
        atomic_write(self.path, (json.dumps(body, indent=1) + "\n").encode(), mode=0o600)

    def create(self, name: str) -> str:
        """A new key named ``name``; returns the key itself (it is not stored)."""
        if not name or len(name) > 64 or not all(c.isalnum() or c in "-_." for c in name):
            raise ApiKeyError("a key name is 1-64 letters, digits, '-', '_' or '.'")
        keys = dict(self._load())
        if name in keys:
            raise ApiKeyError(f"a key named {name!r} exists; revoke it first or pick another name")
        key = PREFIX + secrets.token_urlsafe(32)
        keys[name] = ApiKey(name, _hash(key), time.time())
        self._save(keys)
        return key

    def revoke(self, name: str) -> ApiKey:
        keys = dict(self._load())
        gone = keys.pop(name, None)
        if gone is None:
            raise ApiKeyError(f"no key named {name!r} (see `meshd apikey list`)")
        self._save(keys)
        return gone

    def check(self, key: str) -> ApiKey | None:
        """The key's entry if ``key`` is valid (constant-time comparison), else None."""
        digest = _hash(key)
        found = None
        for k in self._load().values():
            if hmac.compare_digest(k.sha256, digest):
                found = k
        return found
