"""Wire messages of model sharing (registered with the transport's codec).

Adverts and targets are one-way control messages on the members' CURVE links
(``meshd.mesh.peerlink``). Manifests and pieces are request/reply on each member's
share endpoint (a CURVE server admitting the home's keys only); the bytes
travel as raw tensor frames, never through the msgpack header.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from transport.registry import message


@message
@dataclass(frozen=True)
class ShareAdvert:
    """What a member holds of which model, where it serves pieces, how its own fetch goes.

    Sent to every member each heartbeat interval. ``layers`` are runs of whole
    decoder layers held verified; ``tensors`` the other held tensors by name.
    """

    identity: str = ""  # name@sha256 prefix, as in heartbeats; "" while it has no model
    sha256: str = ""
    size: int = 0
    manifest_digest: str = ""  # "" until the manifest is built or fetched (no pieces served before)
    share_port: int = 0
    complete: bool = False
    header: bool = False
    layers: list[list[int]] = field(default_factory=list)
    tensors: list[str] = field(default_factory=list)
    fetch: dict[str, Any] = field(default_factory=dict)  # progress of this member's own fetch


@message
@dataclass(frozen=True)
class ShareTarget:
    """From the leader: fetch what layers ``[first, end)`` of this model need (a plan waits for it)."""

    identity: str
    first: int
    end: int
    num_layers: int


@message
@dataclass(frozen=True)
class ManifestRequest:
    sha256: str


@message
@dataclass(frozen=True)
class ManifestReply:
    sha256: str
    data: np.ndarray | None = None  # uint8: the manifest's canonical bytes


@message
@dataclass(frozen=True)
class PieceRequest:
    sha256: str
    index: int


@message
@dataclass(frozen=True)
class PieceReply:
    sha256: str
    index: int
    data: np.ndarray | None = None  # uint8: the piece's bytes
