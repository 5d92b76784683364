"""The state directory: everything a device remembers across restarts.

Layout (all under ``--state-dir``, else ``$MESHD_HOME``, ``$STATE_DIRECTORY`` or
``~/.local/state/meshd``: ``meshd.paths.default_state_dir``)::

    node_id            this device's stable id (hex), created on first start
    home.json          {"home_id", "name"}: which home this device belongs to
    members.json       known members: node_id -> {name, public_key}; this IS the
                       allow-list the transport's ZAP handler admits
    invites.json       pending one-time invite tokens, stored hashed with expiry
    api_keys.json      hashed API keys for the LAN listener (``meshd.apikeys``)
    daemon.json        while the daemon runs: its pid, ports, addresses and API socket,
                       for ``meshd invite`` and ``meshd status --state-dir``
    keys/              this device's CURVE keypair and the transport's allow-list
                       (``transport.keys``: node.key, node.key_secret, allowed_peers.json)
    profiles/          device profiles (partition profiler output)
    models/            model cache

Writes are atomic (write to a temp file, rename) so a crash or a concurrent
``meshd invite`` never leaves a half-written file that the daemon then reads.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import secrets
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshd.errors import MeshdError
from meshd.model.profile_files import profile_model, read_profiles
from transport import keys as transport_keys
from transport.errors import KeyStoreError

RUNTIME_FILE = "daemon.json"


class StateError(MeshdError):
    """The state directory is missing, unreadable or inconsistent."""


class MemberConflict(StateError):
    """A member entry that would change whom an existing node id or key identifies.

    A node id, once in the home, keeps the CURVE key it joined with (taking a
    member's node id with another key would hand its layers and activations to
    whoever holds that key), and a key identifies one node id only. No path
    (pairing, gossip, daemon start) may replace either; ``existing`` is the
    member already trusted, ``offered`` the refused entry.
    """

    def __init__(self, message: str, existing: Member, offered: Member):
        super().__init__(message)
        self.existing = existing
        self.offered = offered


@dataclass(frozen=True)
class Home:
    home_id: str
    name: str

    @property
    def digest(self) -> str:
        """What mDNS advertises: identifies the home without revealing its id."""
        return home_digest(self.home_id)


def home_digest(home_id: str) -> str:
    return hashlib.sha256(b"meshd-home\0" + home_id.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Member:
    node_id: str
    name: str
    public_key: str  # z85 CURVE public key

    def to_json(self) -> dict[str, str]:
        return {"node_id": self.node_id, "name": self.name, "public_key": self.public_key}

    @staticmethod
    def from_json(d: dict[str, Any]) -> Member:
        return Member(str(d["node_id"]), str(d.get("name", "")), str(d["public_key"]))


def key_fingerprint(public_key: str) -> str:
    """The transport's human-comparable fingerprint (``ab12-cd34-ef56-7890``)."""
    return transport_keys.fingerprint(public_key)


def _safe_fingerprint(public_key: str) -> str:
    try:
        return key_fingerprint(public_key)
    except Exception:  # noqa: BLE001 - only for a message about a malformed key
        return "?"


def member_conflict(current: dict[str, Member], m: Member) -> MemberConflict | None:
    """Why ``m`` may not be merged into ``current`` (None: it may).

    Allowed: a new node id with a key no member uses, or an existing node id
    with its own key (a name change is fine; re-adding it is a no-op).
    """
    old = current.get(m.node_id)
    if old is not None and old.public_key != m.public_key:
        return MemberConflict(
            f"node id {m.node_id} already belongs to member {old.name!r} of this home with another "
            f"key (trusted {_safe_fingerprint(old.public_key)}, offered {_safe_fingerprint(m.public_key)}); "
            "a device cannot take over an existing member's identity. If this is a new device, "
            "give it a fresh state directory (a new node id)",
            old, m)
    owner = next((o for o in current.values() if o.public_key == m.public_key and o.node_id != m.node_id),
                 None)
    if owner is not None:
        return MemberConflict(
            f"key {_safe_fingerprint(m.public_key)} already belongs to member {owner.name!r} "
            f"(node id {owner.node_id}); one key cannot join under a second node id",
            owner, m)
    return None


def json_digest(obj: Any) -> str:
    """A short digest of a JSON-able value (keys sorted), compared in heartbeats."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def members_digest(members: dict[str, Member]) -> str:
    """Order-independent digest of the allow-list, compared in heartbeats."""
    h = hashlib.sha256()
    for node_id in sorted(members):
        m = members[node_id]
        h.update(f"{node_id}\0{m.public_key}\n".encode())
    return h.hexdigest()[:16]


def atomic_write(path: Path, data: bytes, mode: int = 0o600) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


class StateDir:
    def __init__(self, root: Path):
        self.root = Path(root)

    @classmethod
    def of_home(cls, root: Path) -> StateDir:
        """The state directory of a device already in a home, or a StateError saying what is wrong.

        For the commands that act on a daemon's state from outside (``meshd
        apikey``, ``meshd invite``, ``meshd status --state-dir``): a mistyped
        path or a forgotten ``MESHD_HOME`` must fail here, before anything is
        written, not create a fresh directory that the daemon never reads (a
        key there is a key nobody checks) or suggest creating a second home.
        """
        state = cls(root)
        where = ("check --state-dir or $MESHD_HOME (the systemd service's is /var/lib/meshd: "
                 "sudo -u meshd env MESHD_HOME=/var/lib/meshd meshd ...)")
        if not state.root.is_dir():
            raise StateError(f"no meshd state directory at {state.root}: {where}")
        if not (state.root / "home.json").is_file():
            raise StateError(f"{state.root} holds no home (no home.json): {where}; a device enters a home "
                             "with 'meshd join --token TOKEN' (a token from 'meshd invite' on a member), "
                             "or, on a home's first device only, 'meshd join --new-home NAME'")
        return state

    # -- layout -----------------------------------------------------------
    @property
    def keys_dir(self) -> Path:
        return self.root / "keys"

    @property
    def profiles_dir(self) -> Path:
        return self.root / "profiles"

    @property
    def models_dir(self) -> Path:
        return self.root / "models"

    def ensure(self) -> StateDir:
        try:
            self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
            for d in (self.keys_dir, self.profiles_dir, self.models_dir):
                d.mkdir(exist_ok=True, mode=0o700)
        except OSError as exc:
            raise StateError(f"cannot create state directory {self.root}: {exc}") from None
        return self

    @contextmanager
    def locked(self):
        """Serialise read-modify-write of state files between daemon and CLI."""
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / ".lock", "a+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def _read_json(self, name: str, default: Any) -> Any:
        path = self.root / name
        try:
            return json.loads(path.read_text())
        except FileNotFoundError:
            return default
        except (OSError, ValueError) as exc:
            raise StateError(f"cannot read {path}: {exc}") from None

    def _write_json(self, name: str, value: Any) -> None:
        atomic_write(self.root / name, (json.dumps(value, indent=2, sort_keys=True) + "\n").encode())

    # -- node id ----------------------------------------------------------
    def node_id(self) -> str:
        path = self.root / "node_id"
        with self.locked():
            try:
                value = path.read_text().strip()
                if value:
                    return value
            except FileNotFoundError:
                pass
            value = secrets.token_hex(8)
            atomic_write(path, (value + "\n").encode(), mode=0o644)
            return value

    # -- home -------------------------------------------------------------
    def home(self) -> Home | None:
        d = self._read_json("home.json", None)
        if not d:
            return None
        return Home(str(d["home_id"]), str(d["name"]))

    def set_home(self, home: Home) -> None:
        with self.locked():
            self._write_json("home.json", {"home_id": home.home_id, "name": home.name})

    def create_home(self, name: str) -> Home:
        if self.home() is not None:
            raise StateError(f"this device already belongs to home {self.home().name!r}")
        home = Home(secrets.token_hex(16), name)
        self.set_home(home)
        return home

    # -- keys ---------------------------------------------------------------
    def keypair(self) -> transport_keys.Keypair:
        try:
            return transport_keys.load_or_create_keypair(self.root)
        except KeyStoreError as exc:
            raise StateError(str(exc)) from None

    def allow_list(self) -> transport_keys.AllowList:
        return transport_keys.AllowList.for_state_dir(self.root)

    # -- members / allow-list --------------------------------------------
    def members(self) -> dict[str, Member]:
        raw = self._read_json("members.json", {})
        return {nid: Member.from_json({**m, "node_id": nid}) for nid, m in raw.items()}

    def add_members(self, members: list[Member]) -> list[Member]:
        """Merge members into members.json and the transport's allow-list.

        Returns the ones that were new or changed (a known member's new name).
        Keys are validated first so a malformed key never reaches either file.
        All or nothing: an entry that would give an existing node id another key,
        or reuse a member's key under another node id, raises ``MemberConflict``
        and nothing is written: no caller can swap a member's key.
        """
        for m in members:
            try:
                transport_keys.validate_public_key(m.public_key)
            except KeyStoreError as exc:
                raise StateError(f"member {m.node_id}: {exc}") from None
        with self.locked():
            merged = self.members()
            changed: dict[str, Member] = {}
            for m in members:
                conflict = member_conflict(merged, m)
                if conflict is not None:
                    raise conflict
                if merged.get(m.node_id) != m:
                    merged[m.node_id] = changed[m.node_id] = m
            if changed:
                allow = self.allow_list()
                for m in changed.values():
                    allow.add(m.public_key, name=f"{m.name} ({m.node_id})")
                self._write_json(
                    "members.json",
                    {nid: {"name": m.name, "public_key": m.public_key} for nid, m in merged.items()},
                )
            return list(changed.values())

    # -- invites ----------------------------------------------------------
    def invites(self) -> list[dict[str, Any]]:
        return list(self._read_json("invites.json", []))

    def add_invite(self, token_id: str, key_hash: str, expires_at: float) -> None:
        with self.locked():
            now = time.time()
            keep = [i for i in self.invites() if i["expires_at"] > now]
            keep.append({"id": token_id, "key": key_hash, "expires_at": expires_at})
            self._write_json("invites.json", keep)

    def take_invite(self, token_id: str, now: float) -> dict[str, Any] | None:
        """Remove and return the unexpired invite ``token_id`` (one-time use)."""
        with self.locked():
            invites = self.invites()
            found = next((i for i in invites if i["id"] == token_id), None)
            keep = [i for i in invites if i is not found and i["expires_at"] > now]
            if found is not None or len(keep) != len(invites):
                self._write_json("invites.json", keep)
            if found is None or found["expires_at"] <= now:
                return None
            return found

    def peek_invite(self, token_id: str, now: float) -> dict[str, Any] | None:
        found = next((i for i in self.invites() if i["id"] == token_id), None)
        if found is None or found["expires_at"] <= now:
            return None
        return found

    # -- cloud verifier -------------------------------------------------------
    def cloud_document(self) -> Any:
        """``cloud.json`` as stored (``meshd.cloud.held`` reads it as a record); None if there is none."""
        return self._read_json("cloud.json", None)

    def write_cloud_document(self, value: dict[str, Any]) -> None:
        with self.locked():
            self._write_json("cloud.json", value)

    # -- profiles ---------------------------------------------------------
    def own_profile(self, model: str | None = None) -> dict[str, Any] | None:
        """The newest profile written for this device (``meshd profile --install`` or the daemon's
        own quick measurement), if any; with ``model``, the newest one measured on that model
        (its identity) — a profile of another model's layers would only make the planner fail."""
        for _, data in read_profiles(self.profiles_dir, newest_first=True):
            if model is None or profile_model(data) == model:
                return data
        return None
