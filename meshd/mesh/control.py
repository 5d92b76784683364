"""Control messages between members' daemons (registered with the transport's codec).

They travel on the CURVE link (``meshd.mesh.peerlink``); the transport decodes and
type-checks them, so handlers only ever see well-formed values. Plans travel
as ``transport.messages.PlanUpdate``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from partition.ids import NodeId, PlanVersion
from transport.registry import message


@message(extensible=True)
@dataclass(frozen=True)
class MeshHeartbeat:
    """Sent to every known member each heartbeat interval; liveness + cheap gossip.

    Extensible: a member upgraded first may send fields this version does not know;
    they are left out (and logged) so it stays alive to the rest of the home.
    """

    node_id: NodeId
    name: str
    memory_budget_mb: int
    plan_version: PlanVersion
    members_digest: str  # differs -> the receiver sends us its member list
    profile_digest: str  # differs from what the receiver holds -> it asks for the profile
    timestamp: float
    state: str = "ready"  # "ready" | "draining"
    requests_in_flight: int = 0
    stage_port: int = 0  # where this member's pipeline stage listens (0: no engine yet)
    group_port: int = 0  # where it takes a tensor group's links (transport.group_link; 0: none)
    incarnation: str = ""  # random per daemon start: a change means the member restarted (caches gone)
    load_state: str = "loading"  # "loading" | "loaded" | "failed" | "none" (model = none)
    model: str = ""  # identity of the loaded model file (name@sha256 prefix); "" for model-less engines
    model_layers: int = 0  # its decoder layer count (0: unknown)
    version: str = ""  # meshd version the member runs
    uptime_s: float = 0.0  # seconds since its daemon started
    kv_tokens: int = 0  # KV cache tokens its stage holds now
    last_error: str = ""  # its most recent serving error (model load, stage), "" if none
    cloud_changed_at: float = 0.0  # the cloud pairing record it holds (meshd.cloud.record): when made,
    cloud_digest: str = ""  # and its digest; a member holding a newer one sends it (CloudShare)
    plan_digest: str = ""  # Plan.digest() of the plan it serves: same version, other digest = a conflict
    caps: list[str] | None = None  # what its daemon can do (meshd.mesh.caps); None: a release before the set
    # what its coordinator observes (meshd.pipeline.coordinator.workload); None: not enough yet
    workload: dict | None = None


@message
@dataclass(frozen=True)
class MemberList:
    """Key sync: every member (node id, name, z85 public key) the sender knows."""

    members: list[dict[str, str]] = field(default_factory=list)


@message
@dataclass(frozen=True)
class ProfileRequest:
    node_id: NodeId


@message
@dataclass(frozen=True)
class ProfileShare:
    node_id: NodeId
    digest: str
    profile: dict[str, Any] | None = None


@message
@dataclass(frozen=True)
class Bye:
    """Graceful shutdown: mark me gone now rather than after the heartbeat timeout."""

    node_id: NodeId
    reason: str = "shutdown"


@message
@dataclass(frozen=True)
class CloudShare:
    """The home's newest cloud pairing or unpairing (``meshd.cloud.record``), sent to a member whose
    heartbeat shows it holds an older one."""

    record: dict[str, Any] = field(default_factory=dict)
