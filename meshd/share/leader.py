"""The leader's side of sharing: a new plan waits for its members to hold their layers.

``gate`` wraps the pure rule (``meshd.share.gate``): the leader sends each
member of the candidate plan that lacks its layers a ``ShareTarget`` and
re-plans the moment the last of them advertises it holds them.

Targets go only to members of the plan the leader means to adopt, planned with
what the leader knows of them. Before, a member still loading (it held the
header only) was sent the range of a *prospective* plan over it too, so its
fetch could overlap its start-up; but the leader plans a member it has no
profile of with the shipped default, which on a busy machine made the
newcomer look faster than every measured member: the prospective plan gave it
every layer, it fetched the whole file, and the real plan (made once its own
profile arrived) gave it half. A member's first target now comes from a plan
it is a member of.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from meshd.log import get_logger
from meshd.share.deps import ShareDeps
from meshd.share.own_fetch import OwnFetch
from meshd.share.gate import gate_plan
from meshd.share.held import HeldModel
from meshd.share.manifest import needed_tensors
from meshd.share.messages import ShareAdvert, ShareTarget
from meshd.share.peers import PeerBook
from partition.ids import NodeId

log = get_logger("meshd.share")


class FetchGate:
    def __init__(self, deps: ShareDeps, held: HeldModel, peers: PeerBook, own: OwnFetch):
        self.deps = deps
        self.held = held
        self.peers = peers
        self.own = own
        self.waiting: dict[str, tuple[int, int]] = {}  # member -> the range the candidate plan waits for
        self.reason = ""

    def covers(self, nid: NodeId, first: int, end: int, num_layers: int) -> bool:
        """Does ``nid`` hold verified what layers ``[first, end)`` need?"""
        if nid == self.deps.node_id:
            h = self.held.holdings()
            whole_pending = self.own.mode == "whole" and not h.complete
        else:
            p = self.peers.peers.get(nid)
            if p is None:
                return False
            h = p.holdings
            whole_pending = p.fetch_mode == "whole" and not h.complete
        if h.complete:
            return True
        if whole_pending or self.held.tensor_names is None:
            return False  # a whole-file fetch is planned once whole, like a download
        return h.covers(needed_tensors(self.held.tensor_names, num_layers, first, end))

    def _complete(self, nid: NodeId) -> bool:
        if nid == self.deps.node_id:
            return self.held.holdings().complete
        return nid in self.peers.peers and self.peers.peers[nid].holdings.complete

    def gate(self, candidate: Any, current: Any, members: list[str], model: str,
             plan_over: Callable[[list[str]], Any]) -> Any | None:
        """The plan to adopt now (None: keep the current one); sends fetch targets."""
        if not model or model != self.held.identity:
            self.waiting = {}
            return candidate  # model-less engines, or we cannot judge another model's files
        n = candidate.num_layers
        decision = gate_plan(candidate, current, members, lambda nid, f, e: self.covers(nid, f, e, n), plan_over,
                             [nid for nid in members if self._complete(nid)])
        targets = dict(decision.waiting)
        if targets != self.waiting or decision.reason != self.reason:
            log.info("plan_waits_for_fetch" if targets else "plan_fetch_targets",
                     waiting={k: list(v) for k, v in targets.items()}, reason=decision.reason,
                     keeping_current=decision.adopt is None)
        self.waiting, self.reason = targets, decision.reason
        for nid, (f, e) in targets.items():
            self.send_target(nid, f, e)
        return decision.adopt

    def send_target(self, nid: NodeId, first: int, end: int) -> None:
        if nid == self.deps.node_id:
            self.own.set_target(first, end, why="this leader's plan")
        else:
            self.deps.send(nid, ShareTarget(self.held.identity, first, end, self.held.num_layers))

    def on_advert(self, sender: str, a: ShareAdvert) -> None:
        """A waiting member's advert: re-plan once it holds its range; resend a target it lost."""
        if sender not in self.waiting:
            return
        first, end = self.waiting[sender]
        num_layers = self.held.num_layers
        if num_layers and self.covers(sender, first, end, num_layers):
            self.deps.replan_now()  # the plan was waiting for exactly this
        elif (a.fetch or {}).get("target") != [first, end] and a.header:
            self.send_target(sender, first, end)  # lost, or it restarted

    def on_own_fetch_done(self) -> None:
        """Our own fetch finished: a plan we lead may have been waiting for it."""
        me = self.deps.node_id
        n = self.held.num_layers
        if me in self.waiting and n and self.covers(me, *self.waiting[me], n):
            self.deps.replan_now()
