"""Which cloud verifier the home uses: one record, the newest change wins across members.

``meshd cloud pair`` runs on one member, but the home is every member: any of
them may coordinate a request. So the pairing (or its removal) travels with
the members' heartbeats. Each member keeps the newest record it has seen in
``cloud.json``; a heartbeat carries the record's order key, and a member that
holds a newer record than a peer's sends it to that peer. Unpairing writes a
tombstone rather than deleting the file, so an older pairing still held by a
member that was away cannot come back.

Pure: validation and ordering only, no I/O. The daemon applies a record.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any

from transport.errors import KeyStoreError
from transport.keys import validate_public_key

MAX_FIELD = 512  # characters of an address, model name or fingerprint: generous, but bounded


@dataclass(frozen=True)
class CloudRecord:
    """A pairing (``address`` set) or a tombstone (``address`` empty), stamped when it was made."""

    changed_at: float
    address: str = ""
    server_key: str = ""
    model: str = ""
    tokenizer: str = ""

    @property
    def paired(self) -> bool:
        return bool(self.address)

    @property
    def digest(self) -> str:
        body = "\n".join([repr(self.changed_at), self.address, self.server_key, self.model, self.tokenizer])
        return hashlib.sha256(body.encode()).hexdigest()[:16]

    @property
    def order(self) -> tuple[float, str]:
        """Newest first by time; equal times are settled by the digest, so every member picks the same."""
        return (self.changed_at, self.digest)

    def to_json(self) -> dict[str, Any]:
        if not self.paired:
            return {"unpaired_at": self.changed_at}
        return {"address": self.address, "server_key": self.server_key, "model": self.model,
                "tokenizer": self.tokenizer, "paired_at": self.changed_at}

    @classmethod
    def from_json(cls, value: Any) -> "CloudRecord":
        """Validate a record from ``cloud.json`` or from a member; ``ValueError`` says what is wrong."""
        if not isinstance(value, dict):
            raise ValueError("a cloud record must be an object")
        if "unpaired_at" in value:
            return cls(_stamp(value.get("unpaired_at")))
        fields = {}
        for name in ("address", "server_key", "model", "tokenizer"):
            v = value.get(name, "")
            if not isinstance(v, str) or len(v) > MAX_FIELD:
                raise ValueError(f"cloud record field {name!r} must be a string of at most {MAX_FIELD} characters")
            fields[name] = v
        if not fields["address"].startswith("tcp://") or ":" not in fields["address"][len("tcp://"):]:
            raise ValueError("a cloud record's address must be tcp://HOST:PORT")
        try:
            validate_public_key(fields["server_key"])
        except KeyStoreError as exc:
            raise ValueError(f"a cloud record's server key is unusable ({exc})") from None
        return cls(_stamp(value.get("paired_at")), **fields)


def _stamp(value: Any) -> float:
    try:
        stamp = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan
    except OverflowError:  # an integer beyond any float
        stamp = math.nan
    if not math.isfinite(stamp) or stamp < 0:
        raise ValueError("a cloud record needs a finite, non-negative time stamp")
    return stamp


def newer(candidate: CloudRecord | None, held: CloudRecord | None) -> bool:
    """Whether ``candidate`` should replace ``held`` (nothing held: any record is newer)."""
    if candidate is None:
        return False
    return held is None or candidate.order > held.order


def heartbeat_key(record: CloudRecord | None) -> tuple[float, str]:
    """What a heartbeat says about the record its sender holds ((0, "") for none)."""
    return record.order if record is not None else (0.0, "")
