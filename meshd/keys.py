"""This device's CURVE keypair, kept in the state directory.

Adapter seam: the transport package owns the key store format; until its store
is used here, keys are z85 text files ``keys/public.key`` and ``keys/secret.key``
(the secret one mode 0600), which is what ``zmq.curve_keypair`` produces.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import zmq

from meshd.state import StateError, atomic_write


@dataclass(frozen=True)
class KeyPair:
    public: str  # z85, 40 chars
    secret: str  # z85, 40 chars


def load_or_create_keypair(keys_dir: Path) -> KeyPair:
    pub_path, sec_path = keys_dir / "public.key", keys_dir / "secret.key"
    if pub_path.exists() and sec_path.exists():
        try:
            return KeyPair(pub_path.read_text().strip(), sec_path.read_text().strip())
        except OSError as exc:
            raise StateError(f"cannot read CURVE keys in {keys_dir}: {exc}") from None
    public, secret = zmq.curve_keypair()
    atomic_write(sec_path, secret + b"\n", mode=0o600)
    atomic_write(pub_path, public + b"\n", mode=0o644)
    return KeyPair(public.decode(), secret.decode())
