"""Member gossip: heartbeats out, one handler per control message type in.

Liveness and cheap facts travel in ``MeshHeartbeat``s; anything a heartbeat shows to
differ (the member list, a profile, the plan, the cloud pairing) is then sent or asked
for on its own. Bad input from the network is logged and dropped: nothing a member
sends can stop the daemon.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from meshd.mesh import control
from meshd.errors import USER_ERRORS
from meshd.log import get_logger
from meshd.mesh.caps import OURS, Cap
from meshd.mesh.membership import Change, affects_plan
from meshd.mesh.local import meshd_version
from meshd.mesh.planner import Planner
from meshd.mesh.view import MeshView
from meshd.state import Member, key_fingerprint, members_digest
from partition.ids import NodeId
from transport.messages import Envelope, PlanUpdate

log = get_logger("meshd.gossip")

_UNKNOWN_FIELDS_BOUND = 256


def safe_fingerprint(key: str) -> str:
    try:
        return key_fingerprint(key)
    except Exception:
        return "invalid"


class Gossip:
    """``extras()``: this device's heartbeat fields the control plane does not own (state,
    requests in flight, KV tokens, the cloud record's fields). ``on_members_learned``: the
    allow-list grew (admission re-checks refused sightings). ``on_peer_restarted``: a member
    came back with a new incarnation (its stage forgot every sequence). ``fallback``: a
    message type no handler here takes (model sharing); returns whether it took it."""

    def __init__(self, view: MeshView, planner: Planner, link, cloud_sync, clock: Callable[[], float],
                 extras: Callable[[], dict[str, Any]], on_members_learned: Callable[[], None] = lambda: None,
                 on_peer_restarted: Callable[[NodeId], None] = lambda node_id: None):
        self.view = view
        self.planner = planner
        self.link = link
        self.cloud_sync = cloud_sync
        self.clock = clock
        self.extras = extras
        self.on_members_learned = on_members_learned
        self.on_peer_restarted = on_peer_restarted
        self.fallback: Callable[[NodeId, Any], bool] | None = None
        self._unknown_fields_seen: set[tuple[NodeId, str, tuple[str, ...]]] = set()
        self._handlers: dict[type, Callable[[Any, str, float], None]] = {
            control.MeshHeartbeat: self._on_heartbeat,
            control.MemberList: lambda msg, sender, now: self.merge_members(msg.members, sender),
            control.CloudShare: lambda msg, sender, now: self.cloud_sync.receive(msg.record, sender),
            control.ProfileRequest: self._on_profile_request,
            control.ProfileShare: self._on_profile_share,
            PlanUpdate: lambda msg, sender, now: self.planner.on_plan_update(msg, sender),
            control.Bye: self._on_bye,
        }

    @property
    def handled_types(self) -> frozenset[type]:
        """The message types gossip answers itself (anything else goes to ``fallback``)."""
        return frozenset(self._handlers)

    # -- in ------------------------------------------------------------------------------
    def on_message(self, public_key: str, env: Envelope) -> None:
        sender = self.view.sender_of(public_key)  # ZAP admitted it, so the allow-list may have changed
        msg = env.message
        if sender is None:
            log.warning("message_from_unknown_key", type=type(msg).__name__,
                        fingerprint=safe_fingerprint(public_key))
            return
        now = self.clock()
        if env.unknown_fields:
            self._note_unknown_fields(sender, msg, env.unknown_fields)
        handler = self._handlers.get(type(msg))
        if handler is not None:
            handler(msg, sender, now)
        elif self.fallback is None or not self.fallback(sender, msg):
            log.info("message_ignored", type=type(msg).__name__, peer=sender)

    def _on_heartbeat(self, msg: control.MeshHeartbeat, sender: NodeId, now: float) -> None:
        info = {"name": msg.name, "memory_budget_mb": msg.memory_budget_mb,
                "plan_version": msg.plan_version, "state": msg.state,
                "requests_in_flight": msg.requests_in_flight, "stage_port": msg.stage_port,
                "group_port": msg.group_port,
                "incarnation": msg.incarnation, "load_state": msg.load_state, "model": msg.model,
                "model_layers": msg.model_layers, "version": msg.version,
                "uptime_s": msg.uptime_s, "kv_tokens": msg.kv_tokens, "last_error": msg.last_error,
                "profile_digest": msg.profile_digest,
                "caps": list(msg.caps) if msg.caps is not None else None,
                "workload": dict(getattr(msg, "workload", None) or {})}
        before = dict(self.view.info_of(sender))
        self.apply(self.view.membership.heartbeat(sender, now, info))
        self._on_peer_info(sender, before, info)
        if msg.members_digest != members_digest(self.view.members):
            self.link.send(sender, self.member_list())
        if msg.profile_digest and self.view.profile_digests.get(sender) != msg.profile_digest:
            self.link.send(sender, control.ProfileRequest(self.view.node_id))
        self.planner.on_peer_plan(sender, msg.plan_version, msg.plan_digest)
        share = self.cloud_sync.share_for(msg.cloud_changed_at, msg.cloud_digest)
        if share is not None:
            self.link.send(sender, share)

    def _on_peer_info(self, node_id: NodeId, before: dict, info: dict) -> None:
        """React to what a heartbeat changed: a restart, a new stage port, a model loaded."""
        old_inc = before.get("incarnation")
        if old_inc and old_inc != info.get("incarnation"):
            log.info("peer_restarted", peer=node_id, stage_port=info.get("stage_port"))
            self.on_peer_restarted(node_id)
        if any(before.get(k) != info.get(k) for k in ("load_state", "model", "model_layers", "caps")):
            self.planner.poke()  # who can be planned over changed
            self.planner.check_home_model()

    def _on_profile_request(self, msg: control.ProfileRequest, sender: NodeId, now: float) -> None:
        local = self.view.local
        self.link.send(sender, control.ProfileShare(local.node_id, local.profile_digest(), local.own_profile))

    def _on_profile_share(self, msg: control.ProfileShare, sender: NodeId, now: float) -> None:
        if msg.profile is not None:
            self.view.profiles[sender] = msg.profile
            self.view.profile_digests[sender] = msg.digest
            self.planner.debounce.poke(now)

    def _on_bye(self, msg: control.Bye, sender: NodeId, now: float) -> None:
        log.info("peer_said_bye", peer=sender, reason=msg.reason)
        self.apply(self.view.membership.leave(sender, now))

    def _note_unknown_fields(self, sender: NodeId, msg: Any, fields: tuple[str, ...]) -> None:
        """A newer member's fields this daemon does without: said once per member and field set."""
        key = (sender, type(msg).__name__, fields)
        seen = self._unknown_fields_seen
        if key in seen or len(seen) > _UNKNOWN_FIELDS_BOUND:
            return
        seen.add(key)
        if len(seen) > _UNKNOWN_FIELDS_BOUND:  # bounded: say so once, then stop
            log.warning("peer_fields_unknown_suppressed", reason="too many distinct sets of unknown fields")
            return
        log.warning("peer_fields_unknown", peer=sender, type=type(msg).__name__, fields=list(fields),
                    peer_version=getattr(msg, "version", None) or None, version=meshd_version(),
                    hint="the member runs another meshd version; upgrade every member to the same one")

    def apply(self, changes: list[Change]) -> None:
        """Log membership changes; re-plan when one changes who is active."""
        for c in changes:
            log.info("member_state", peer=c.node_id, old=c.old.value if c.old else None, new=c.new.value)
        if affects_plan(changes):
            self.planner.poke()

    # -- the allow-list ------------------------------------------------------------------
    def member_list(self) -> control.MemberList:
        return control.MemberList([m.to_json() for m in self.view.members.values()])

    def merge_members(self, entries: list[dict[str, str]], sender: NodeId) -> None:
        incoming = []
        for e in entries:
            try:
                incoming.append(Member.from_json(e))
            except (KeyError, TypeError):
                log.warning("member_entry_malformed", sender=sender)
        # Never let gossip replace a key we already trust for a node id (that would
        # let one member hijack another's identity); only add unknown node ids.
        fresh = [m for m in incoming if m.node_id not in self.view.members]
        try:
            added = self.view.state.add_members(fresh)
        except USER_ERRORS as exc:
            log.warning("member_list_rejected", sender=sender, error=str(exc))
            return
        if added:
            log.info("members_learned", sender=sender, nodes=[m.node_id for m in added])
            self.view.reload_members()
            self.on_members_learned()

    # -- out -----------------------------------------------------------------------------
    def heartbeat(self) -> control.MeshHeartbeat:
        view, local, plan = self.view, self.view.local, self.view.plan
        model, layers = local.model_identity()
        return control.MeshHeartbeat(
            node_id=local.node_id, name=local.name, memory_budget_mb=local.memory_budget_mb,
            plan_version=plan.version if plan else 0,
            members_digest=members_digest(view.members), profile_digest=local.profile_digest(),
            timestamp=time.time(), stage_port=local.stage_port, group_port=local.group_port,
            incarnation=local.incarnation,
            load_state=local.load_state, model=model, model_layers=layers,
            version=meshd_version(), uptime_s=round(self.clock() - local.started_at, 1),
            last_error=local.last_error, plan_digest=plan.digest() if plan else "", caps=OURS.to_wire(),
            **self.extras(),
        )

    def send_heartbeat(self, node_id: NodeId | None = None) -> None:
        if self.link is None:
            return
        hb = self.heartbeat()
        # fields at their default are left out on the wire: strict 0.1 daemons refuse any they lack
        legacy = dataclasses.replace(hb, plan_digest="", workload=None, caps=None, group_port=0)
        for peer in ([node_id] if node_id is not None else list(self.link.peers)):
            self.link.send(peer, hb if Cap.HEARTBEAT_FIELDS in self.view.caps_of(peer) else legacy)
