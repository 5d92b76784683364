"""The daemon's control channel between members, on the transport's CURVE links.

A thin adapter over ``transport.node.TransportNode``: one ``StageServer``
(ROUTER, CURVE server, ZAP allow-list) receives control messages from every
member; one ``Peer`` (DEALER) per admitted member sends ours. Control traffic
is one-way (heartbeats, key sync, plans): liveness needs no replies because
each side heartbeats the other, and a slow or unreachable member must never
stall the loop that watches the others, so sends run as background tasks with
a short timeout and failures only count as "no heartbeat delivered".

The sender of every received message is the CURVE public key the ZAP handler
authenticated (``Request.peer_key``), never a field the sender wrote itself,
so a member cannot speak for another member.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

from meshd.log import get_logger
from transport.errors import TransportError
from transport.link import Peer, Request
from transport.messages import Envelope
from transport.node import TransportNode

log = get_logger("meshd.peerlink")

RENEW_AFTER_FAILURES = 2
RENEW_BACKOFF_S = (0.5, 8.0)  # first and longest wait between rebuilds of a failing link


class PeerLink:
    """``on_message(public_key, envelope)`` is called for every well-formed message."""

    def __init__(
        self,
        node_id: str,
        state_dir: Path,
        on_message: Callable[[str, Envelope], None],
        send_timeout_s: float = 1.0,
    ):
        self.node_id = node_id
        self.node = TransportNode(node_id, state_dir=state_dir)
        self.on_message = on_message
        self.send_timeout_s = send_timeout_s
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

    async def _handle(self, msg: Any, req: Request) -> None:
        key = req.peer_key.decode() if isinstance(req.peer_key, bytes) else req.peer_key
        self.on_message(key, req.envelope)
        return None

    # -- outgoing ---------------------------------------------------------
    async def connect(self, node_id: str, public_key: str, address: str, port: int) -> None:
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

    async def disconnect(self, node_id: str) -> None:
        current = self.peers.pop(node_id, None)
        if current:
            await current[2].close()

    def send(self, node_id: str, msg: Any) -> bool:
        """Queue ``msg`` for ``node_id`` in the background; False if there is no link."""
        current = self.peers.get(node_id)
        if current is None:
            return False
        task = asyncio.ensure_future(self._send(node_id, current[2], msg))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return True

    async def _send(self, node_id: str, peer: Peer, msg: Any) -> None:
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

    async def _renew(self, node_id: str, peer: Peer) -> None:
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
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for node_id in list(self.peers):
            await self.disconnect(node_id)
        await self.node.close()
