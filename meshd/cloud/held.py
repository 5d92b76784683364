"""This member's copy of the home's cloud record: ``cloud.json`` in its state directory.

``meshd.cloud.record`` says what a record is and which of two is newer; this
module reads and writes the one a member holds (the CLI pairs and unpairs
through it, the daemon's sync saves the records it learns from peers).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from meshd.cloud.record import CloudRecord
from meshd.state import StateDir, StateError

__all__ = ["held_record", "paired_cloud", "save_record", "change_pairing"]


def held_record(state: StateDir) -> CloudRecord | None:
    """The newest pairing or unpairing this member knows; None if none.

    Raises ``ValueError`` when ``cloud.json`` is not a valid record."""
    value = state.cloud_document()
    return None if value is None else CloudRecord.from_json(value)


def paired_cloud(state: StateDir) -> dict[str, Any] | None:
    """The cloud verifier the home is paired with (``meshd cloud pair``), if any."""
    try:
        rec = held_record(state)
    except ValueError:
        return None
    return rec.to_json() if rec is not None and rec.paired else None


def save_record(state: StateDir, record: CloudRecord) -> None:
    state.write_cloud_document(record.to_json())


def change_pairing(state: StateDir, value: dict[str, Any] | None) -> None:
    """Pair (a record from ``pair_with_cloud``) or unpair (None: a tombstone, so the home forgets it too)."""
    try:
        prev = held_record(state)
    except (ValueError, StateError):
        prev = None
    # Newer than anything this member holds even if its clock is behind the member that made that.
    stamp = max(time.time(), prev.changed_at + 0.001 if prev is not None else 0.0)
    record = CloudRecord(stamp) if value is None else CloudRecord.from_json(value)
    save_record(state, replace(record, changed_at=stamp))
