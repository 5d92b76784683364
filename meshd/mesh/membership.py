"""Membership: which admitted peers are alive, as a pure clock-driven state machine.

mDNS only *finds* peers; liveness comes from heartbeats over the authenticated
transport. Each peer moves through::

    joining --heartbeat--> ready --silence > suspect_after--> suspect
    suspect --heartbeat--> ready;  any --silence > gone_after or "bye"--> gone
    gone --heard of again--> joining / ready

Nothing here does I/O or reads a clock: callers pass ``now``, so tests drive it
with a fake clock, and every method returns the state changes it caused.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any
from partition.ids import NodeId


class PeerState(str, enum.Enum):
    JOINING = "joining"
    READY = "ready"
    SUSPECT = "suspect"
    GONE = "gone"


@dataclass(frozen=True)
class Change:
    node_id: NodeId
    old: PeerState | None
    new: PeerState


@dataclass
class MemberRecord:
    """What this device knows of one other member: its liveness state and its latest heartbeat.

    (Not ``transport.peer.Peer``, which is a connection to a stage server.)
    """

    node_id: NodeId
    state: PeerState
    since: float  # when it entered this state
    last_seen: float  # last heartbeat (or first observation while joining)
    info: dict[str, Any] = field(default_factory=dict)  # latest heartbeat payload
    excused_s: float = 0.0  # of the silence since last_seen: time this device itself could not listen


class Membership:
    def __init__(self, self_id: str, suspect_after_s: float, gone_after_s: float):
        if not 0 < suspect_after_s < gone_after_s:
            raise ValueError("need 0 < suspect_after_s < gone_after_s")
        self.self_id = self_id
        self.suspect_after_s = suspect_after_s
        self.gone_after_s = gone_after_s
        self.peers: dict[str, MemberRecord] = {}

    def _set(self, peer: MemberRecord, state: PeerState, now: float) -> list[Change]:
        if peer.state is state:
            return []
        old, peer.state, peer.since = peer.state, state, now
        return [Change(peer.node_id, old, state)]

    def observe(self, node_id: NodeId, now: float) -> list[Change]:
        """A peer was discovered (mDNS/static seed) and is admitted: start talking to it."""
        if node_id == self.self_id:
            return []
        peer = self.peers.get(node_id)
        if peer is None:
            self.peers[node_id] = MemberRecord(node_id, PeerState.JOINING, now, now)
            return [Change(node_id, None, PeerState.JOINING)]
        if peer.state is PeerState.GONE:
            peer.last_seen, peer.excused_s = now, 0.0
            return self._set(peer, PeerState.JOINING, now)
        return []

    def heartbeat(self, node_id: NodeId, now: float, info: dict[str, Any] | None = None) -> list[Change]:
        """A heartbeat arrived over the authenticated transport: the peer is ready."""
        if node_id == self.self_id:
            return []
        changes: list[Change] = []
        peer = self.peers.get(node_id)
        if peer is None:
            peer = self.peers[node_id] = MemberRecord(node_id, PeerState.READY, now, now)
            changes.append(Change(node_id, None, PeerState.READY))
        peer.last_seen = max(peer.last_seen, now)
        peer.excused_s = 0.0
        if info is not None:
            peer.info = dict(info)
        return changes + self._set(peer, PeerState.READY, now)

    def leave(self, node_id: NodeId, now: float) -> list[Change]:
        """The peer said goodbye (graceful shutdown): gone without waiting for timeouts."""
        peer = self.peers.get(node_id)
        return self._set(peer, PeerState.GONE, now) if peer else []

    def tick(self, now: float, stalled_s: float = 0.0) -> list[Change]:
        """Apply timeouts. Call this periodically (every heartbeat interval is plenty).

        ``stalled_s``: how long this device itself could not listen since the last tick (its own loop
        ran late: a busy machine). Heartbeats sent meanwhile wait unread in its sockets, so that time is
        not a peer's silence; counting it would mark every peer gone after one long stall, then ready
        again a moment later when the queued heartbeats are read — two re-plans for nothing."""
        changes: list[Change] = []
        for peer in self.peers.values():
            if peer.state is PeerState.GONE:
                continue
            # never more than the silence itself: a heartbeat read before this tick already ended it
            peer.excused_s = min(peer.excused_s + max(0.0, stalled_s), max(0.0, now - peer.last_seen))
            silent = now - peer.last_seen - peer.excused_s
            if silent > self.gone_after_s:
                changes += self._set(peer, PeerState.GONE, now)
            elif silent > self.suspect_after_s and peer.state is PeerState.READY:
                changes += self._set(peer, PeerState.SUSPECT, now)
        return changes

    def state_of(self, node_id: NodeId) -> PeerState | None:
        peer = self.peers.get(node_id)
        return peer.state if peer else None

    def ready_ids(self) -> list[str]:
        """Active peers (ready, or suspect: a missed heartbeat or two) plus this node, sorted: the set
        the planner partitions over.

        Suspect counts, as in :func:`affects_plan`: a member is out of the plan only once it is
        gone. A re-plan that some other change triggers during a busy member's suspect blip
        would otherwise leave it out, and its recovery (suspect -> ready changes nothing the
        plan sees) would never bring it back: the home would serve on fewer devices for good.
        """
        ids = {n for n, p in self.peers.items() if p.state in _ACTIVE}
        ids.add(self.self_id)
        return sorted(ids)

    def leader(self) -> str:
        """Deterministic coordinator: the lowest node id among active members."""
        return self.ready_ids()[0]


_ACTIVE = (PeerState.READY, PeerState.SUSPECT)


def affects_plan(changes: list[Change]) -> bool:
    """A peer entering or leaving the active set (ready or suspect) changes the stages.

    ready -> suspect alone is only a warning (it may be a lost packet); the
    re-plan comes when the peer is declared gone, or when it recovers nothing
    has to move at all.
    """
    return any((c.old in _ACTIVE) != (c.new in _ACTIVE) for c in changes)


class Debouncer:
    """Coalesces bursts of membership changes into one re-plan.

    ``poke(now)`` (re)arms the timer; ``due(now)`` is True once, ``delay_s``
    after the last poke. A cap (``max_delay_s``) keeps a flapping peer from
    postponing the re-plan forever.
    """

    def __init__(self, delay_s: float, max_delay_s: float | None = None):
        self.delay_s = delay_s
        self.max_delay_s = max_delay_s if max_delay_s is not None else 5 * delay_s
        self._first: float | None = None
        self._last: float | None = None

    @property
    def armed(self) -> bool:
        return self._last is not None

    def poke(self, now: float) -> None:
        if self._first is None:
            self._first = now
        self._last = now

    def due(self, now: float) -> bool:
        if self._last is None or self._first is None:
            return False
        if now - self._last >= self.delay_s or now - self._first >= self.max_delay_s:
            self._first = self._last = None
            return True
        return False
