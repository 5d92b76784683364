"""What this device knows of its home: members, their facts and addresses, the current plan.

One object, so the floors above (serving, sharing, status) read one thing instead of
reaching into the daemon. Gossip, admission and the planner write it; everyone else
reads it and treats it as read-only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from meshd.mesh.caps import OURS, PeerCaps
from meshd.mesh.discovery import Interface
from meshd.mesh.membership import Membership, PeerState
from meshd.mesh.local import LocalMember
from meshd.state import Home, Member, StateDir
from partition.ids import NodeId

if TYPE_CHECKING:  # the planner (meshd.mesh.planner) is this package's one caller of meshd.mesh.home_plan
    from meshd.mesh.home_plan import Plan


class MeshView:
    def __init__(self, state: StateDir, local: LocalMember, membership: Membership, home: Home | None = None,
                 interfaces: list[Interface] | None = None):
        self.state = state
        self.local = local
        self.membership = membership
        self.home = home
        self.interfaces: list[Interface] = list(interfaces or [])
        self.members: dict[NodeId, Member] = {}  # the home's allow-list, as the state dir holds it
        self.by_key: dict[str, NodeId] = {}  # public key -> node id
        self.addresses: dict[NodeId, tuple[str, int]] = {}  # node id -> (ip, transport port), as mDNS resolved it
        self.profiles: dict[NodeId, dict] = {}  # node id -> the device profile it shared
        self.profile_digests: dict[NodeId, str] = {}
        self.plan: Plan | None = None  # the plan this device serves (the planner adopts it)
        self.reload_members()

    @property
    def node_id(self) -> NodeId:
        return self.local.node_id

    def reload_members(self) -> None:
        self.members = self.state.members()
        self.by_key = {m.public_key: nid for nid, m in self.members.items()}

    def sender_of(self, public_key: str) -> NodeId | None:
        """The member a CURVE key belongs to (re-reading the allow-list once: ZAP may know it first)."""
        if public_key not in self.by_key:
            self.reload_members()
        return self.by_key.get(public_key)

    def info_of(self, node_id: NodeId) -> dict[str, Any]:
        """A member's facts from its latest heartbeat ({} if none heard)."""
        peer = self.membership.peers.get(node_id)
        return peer.info if peer is not None else {}

    def caps_of(self, node_id: NodeId) -> PeerCaps:
        """What a member's daemon can do, as its heartbeats announce it (this device: :data:`OURS`)."""
        return OURS if node_id == self.node_id else PeerCaps.of(self.info_of(node_id))

    def state_of(self, node_id: NodeId) -> PeerState | None:
        return self.membership.state_of(node_id)

    def ready_ids(self) -> list[NodeId]:
        return self.membership.ready_ids()

    def leader(self) -> NodeId:
        return self.membership.leader()

    def profile_of(self, node_id: NodeId) -> dict | None:
        return self.local.own_profile if node_id == self.node_id else self.profiles.get(node_id)

    def model_facts(self, ids: list[NodeId]) -> dict[NodeId, tuple[str, str, int]]:
        """Per member: (load state, model identity, layer count), from heartbeats and ourselves."""
        facts: dict[NodeId, tuple[str, str, int]] = {}
        for nid in ids:
            if nid == self.node_id:
                ident, layers = self.local.model_identity()
                facts[nid] = (self.local.load_state, ident, layers)
            else:
                info = self.info_of(nid)
                facts[nid] = (str(info.get("load_state", "loading")), str(info.get("model", "")),
                              int(info.get("model_layers", 0) or 0))
        return facts

    def home_keys(self) -> list[str]:
        return sorted({m.public_key for m in self.members.values()})
