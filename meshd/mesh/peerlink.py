"""The daemon's control channel between members, on the transport's CURVE links.

A thin adapter over ``transport.node.TransportNode``: one ``StageServer``
(ROUTER, CURVE server, ZAP allow-list) receives control messages from every
member; one ``Peer`` (DEALER) per admitted member sends ours. Control traffic
is one-way (heartbeats, key sync, plans): liveness needs no replies because
each side heartbeats the other, and a slow or unreachable member must never
stall the loop that watches the others, so sends run as background tasks with
a short timeout and failures only count as "no heartbeat delivered".

The one request/reply on this link is the round-trip probe (``meshd status``'s
RTT column, ``/metrics``' ``meshd_link_rtt_seconds``): the transport's own
``LinkProbe`` request, answered here with a ``LinkProbeAck`` and never passed
on to the daemon. :class:`LinkProbes` decides when each linked member is due
(at once for a new link, then every ``interval_s``), at most one probe per
member is in flight, each is a background task bounded by ``timeout_s``, and
a member that stops answering shows as unreachable (no RTT) instead of
keeping its last value forever.

The sender of every received message is the CURVE public key the ZAP handler
authenticated (``Request.peer_key``), never a field the sender wrote itself,
so a member cannot speak for another member.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshd.log import get_logger
from transport.errors import TransportError
from transport.link import Request
from transport.peer import Peer
from transport.messages import Envelope, LinkProbe, LinkProbeAck
from transport.node import TransportNode
from partition.ids import NodeId

log = get_logger("meshd.mesh.peerlink")

RENEW_AFTER_FAILURES = 2
RENEW_BACKOFF_S = (0.5, 8.0)  # first and longest wait between rebuilds of a failing link
PROBE_INTERVAL_S = 5.0
PROBE_TIMEOUT_S = 2.0
UNREACHABLE_AFTER = 2  # failed probes in a row before a member's link shows as unreachable


def probe_interval_for(heartbeat_interval_s: float) -> float:
    """Probe every 5 heartbeats, within 1-5 s: cheap at home, quick to show with fast test timings."""
    return min(PROBE_INTERVAL_S, max(1.0, 5 * heartbeat_interval_s))


# --------------------------------------------------------------------------- round-trip probes


@dataclass
class LinkHealth:
    """What the probes learnt about the link to one member."""

    rtt_s: float | None = None  # the last measured round trip
    measured_at: float | None = None  # when it was measured (the probes' clock)
    probed_at: float | None = None  # when the last probe started
    in_flight: bool = False
    failures: int = 0  # probes in a row that got no answer
    probes: int = 0
    last_error: str = ""


class LinkProbes:
    """When to probe which member, and what the answers say; no I/O, no clock of its own.

    ``due(ids, now)`` names the members to probe now (a new link at once, then
    every ``interval_s``; never two probes in flight to one member) and marks
    them in flight; ``record`` ends a probe with its round trip or ``None``.
    ``status(now)`` reports per member ``rtt_s`` only while it is fresh: a
    member is unreachable once ``UNREACHABLE_AFTER`` probes in a row failed or
    its last answer is older than ``stale_after_s`` (three intervals plus a
    timeout by default), and then ``rtt_s`` is ``None`` while ``age_s`` keeps
    growing.
    """

    def __init__(self, interval_s: float = PROBE_INTERVAL_S, timeout_s: float = PROBE_TIMEOUT_S,
                 stale_after_s: float | None = None):
        if not (interval_s > 0 and timeout_s > 0):
            raise ValueError("probe interval and timeout must be positive")
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.stale_after_s = stale_after_s if stale_after_s is not None else 3 * interval_s + timeout_s
        self.links: dict[str, LinkHealth] = {}

    def due(self, node_ids: Iterable[str], now: float) -> list[str]:
        out = []
        for nid in node_ids:
            h = self.links.setdefault(nid, LinkHealth())
            if h.in_flight or (h.probed_at is not None and now - h.probed_at < self.interval_s):
                continue
            h.in_flight, h.probed_at = True, now
            h.probes += 1
            out.append(nid)
        return out

    def record(self, node_id: NodeId, now: float, rtt_s: float | None, error: str = "",
               started: float | None = None) -> None:
        """End the probe ``due`` started at ``started`` (if given; a stale probe's answer is dropped)."""
        h = self.links.get(node_id)
        if h is None or (started is not None and h.probed_at != started):
            return  # forgotten (or forgotten and probed anew) while the probe ran
        h.in_flight = False
        if rtt_s is None:
            h.failures += 1
            h.last_error = error or "no answer"
        else:
            h.rtt_s, h.measured_at, h.failures, h.last_error = rtt_s, now, 0, ""

    def forget(self, node_id: NodeId) -> None:
        self.links.pop(node_id, None)

    def reachable(self, node_id: NodeId, now: float) -> bool:
        h = self.links.get(node_id)
        return (h is not None and h.measured_at is not None and h.failures < UNREACHABLE_AFTER
                and now - h.measured_at <= self.stale_after_s)

    def status(self, now: float) -> dict[str, dict[str, Any]]:
        out = {}
        for nid, h in sorted(self.links.items()):
            up = self.reachable(nid, now)
            out[nid] = {
                "rtt_s": round(h.rtt_s, 6) if up and h.rtt_s is not None else None,
                "age_s": round(now - h.measured_at, 3) if h.measured_at is not None else None,
                "reachable": up,
                "failures": h.failures,
                "probes": h.probes,
                **({"last_error": h.last_error} if h.last_error else {}),
            }
        return out


class PeerLink:
    """``on_message(public_key, envelope)`` is called for every well-formed message."""

    def __init__(
        self,
        node_id: NodeId,
        state_dir: Path,
        on_message: Callable[[str, Envelope], None],
        send_timeout_s: float = 1.0,
        probe_interval_s: float = PROBE_INTERVAL_S,
        probe_timeout_s: float = PROBE_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.node_id = node_id
        self.node = TransportNode(node_id, state_dir=state_dir)
        self.on_message = on_message
        self.send_timeout_s = send_timeout_s
        self.probes = LinkProbes(probe_interval_s, probe_timeout_s)
        self.clock = clock
        self._probe_tasks: set[asyncio.Task] = set()
        self.peers: dict[str, tuple[str, str, Peer]] = {}  # node id -> (endpoint, key, Peer)
        self.port = 0
        self.failures: dict[str, int] = {}  # node id -> consecutive failed sends
        self._renew_delay: dict[str, float] = {}  # node id -> backoff before the next rebuild
        self._renew_at: dict[str, float] = {}
        self._renewing: set[str] = set()
        self._tasks: set[asyncio.Task] = set()
        self._server = None

    async def start(self, host: str, port: int) -> int:
        await self.node.start()
        self._server = await self.node.serve(self._handle, f"tcp://{host}:{port}")
        self.port = int(self._server.address.rsplit(":", 1)[1])
        return self.port

    async def _handle(self, msg: Any, req: Request) -> Any:
        if isinstance(msg, LinkProbe):  # a member's round-trip probe: answer at once, nothing else
            return None if req.one_way else LinkProbeAck(self.node_id, 0, time.time())
        key = req.peer_key.decode() if isinstance(req.peer_key, bytes) else req.peer_key
        self.on_message(key, req.envelope)
        return None

    # -- outgoing ---------------------------------------------------------
    async def connect(self, node_id: NodeId, public_key: str, address: str, port: int) -> None:
        """Open (or re-point) the link to ``node_id``; idempotent."""
        endpoint = f"tcp://{address}:{port}"
        current = self.peers.get(node_id)
        if current and current[0] == endpoint and current[1] == public_key:
            return
        if current:
            await self.disconnect(node_id)
        peer = Peer(node_id=self.node_id, context=self.node.context, keypair=self.node.keypair,
                    server_key=public_key, timeout=self.send_timeout_s, hwm=64)
        await peer.connect(endpoint)
        self.peers[node_id] = (endpoint, public_key, peer)

    async def disconnect(self, node_id: NodeId) -> None:
        current = self.peers.pop(node_id, None)
        self.probes.forget(node_id)
        if current:
            await current[2].close()

    # -- round trips ----------------------------------------------------------
    def probe_due(self) -> int:
        """Start a background probe to every linked member that is due; never waits. Returns how many."""
        started = 0
        now = self.clock()
        for node_id in self.probes.due(list(self.peers), now):
            task = asyncio.ensure_future(self._probe(node_id, self.peers[node_id][2], now))
            self._probe_tasks.add(task)
            task.add_done_callback(self._probe_tasks.discard)
            started += 1
        return started

    async def _probe(self, node_id: NodeId, peer: Peer, started: float) -> None:
        rtt, error = None, "cancelled"
        try:
            t0 = time.perf_counter()
            reply = await peer.request(LinkProbe(self.node_id, "probe", 0.0, 0, time.time()),
                                       timeout=self.probes.timeout_s)
            if isinstance(reply, LinkProbeAck):
                rtt = time.perf_counter() - t0
            else:
                error = f"answered {type(reply).__name__}"
        except TransportError as exc:
            error = str(exc) or type(exc).__name__
            log.debug("peer_probe_failed", peer=node_id, error=error)
        finally:
            self.probes.record(node_id, self.clock(), rtt, error, started=started)

    def link_status(self) -> dict[str, dict[str, Any]]:
        """Per linked member: ``rtt_s`` (None unless fresh), ``age_s``, ``reachable``, ``failures``..."""
        return self.probes.status(self.clock())

    def send(self, node_id: NodeId, msg: Any) -> bool:
        """Queue ``msg`` for ``node_id`` in the background; False if there is no link."""
        current = self.peers.get(node_id)
        if current is None:
            return False
        task = asyncio.ensure_future(self._send(node_id, current[2], msg))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return True

    async def _send(self, node_id: NodeId, peer: Peer, msg: Any) -> None:
        try:
            await peer.send(msg, timeout=self.send_timeout_s)
        except TransportError as exc:
            log.debug("peer_send_failed", peer=node_id, message=type(msg).__name__, error=str(exc))
            n = self.failures[node_id] = self.failures.get(node_id, 0) + 1
            now = asyncio.get_running_loop().time()
            if (n >= RENEW_AFTER_FAILURES and node_id not in self._renewing
                    and now >= self._renew_at.get(node_id, 0.0)):
                delay = self._renew_delay.get(node_id, RENEW_BACKOFF_S[0])
                self._renew_delay[node_id] = min(delay * 2, RENEW_BACKOFF_S[1])
                self._renew_at[node_id] = now + delay
                await self._renew(node_id, peer)
        else:
            self.failures[node_id] = 0
            self._renew_delay.pop(node_id, None)
            self._renew_at.pop(node_id, None)

    async def _renew(self, node_id: NodeId, peer: Peer) -> None:
        """Replace a link that keeps failing with a fresh socket.

        libzmq gives up on a connection for good once the server refuses our
        key (a protocol error ends the session; it never reconnects). Between
        members that refusal is usually temporary: a member that has not yet
        heard of a newly paired device refuses it until the new key reaches it
        by gossip. So a link that keeps failing is rebuilt, with a backoff
        (0.5 s doubling to 8 s) so an unreachable peer costs little.
        """
        current = self.peers.get(node_id)
        if current is None or current[2] is not peer:
            return  # already replaced or removed
        self._renewing.add(node_id)
        try:
            endpoint, key, _ = current
            del self.peers[node_id]
            await peer.close()
            address, port = endpoint[len("tcp://"):].rsplit(":", 1)
            await self.connect(node_id, key, address, int(port))
            self.failures[node_id] = 0
            log.debug("peer_link_renewed", peer=node_id)
        finally:
            self._renewing.discard(node_id)

    def broadcast(self, msg: Any, node_ids=None) -> int:
        ids = list(node_ids if node_ids is not None else self.peers)
        return sum(self.send(n, msg) for n in ids)

    async def flush(self, timeout_s: float = 0.5) -> None:
        """Wait (bounded) for queued sends, e.g. a goodbye before closing."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout_s)

    async def stop(self) -> None:
        tasks = [*self._tasks, *self._probe_tasks]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for node_id in list(self.peers):
            await self.disconnect(node_id)
        await self.node.close()
