"""Outgoing links of a pipeline node, one per peer, opened on first use.

Stages and coordinators address each other by node id; the directory says
where a node listens and which CURVE key it must present.
"""

from __future__ import annotations

from collections.abc import Callable

from transport.link import Peer
from transport.node import TransportNode

Directory = Callable[[str], tuple[str, str]]  # node id -> (address, z85 public key)


class Links:
    def __init__(self, node: TransportNode, directory: Directory):
        self.node = node
        self.directory = directory
        self._peers: dict[str, Peer] = {}

    async def to(self, node_id: str, address: str | None = None) -> Peer:
        """The link to ``node_id`` (at ``address`` if given, else where the directory says)."""
        key = f"{node_id}|{address}" if address else node_id
        peer = self._peers.get(key)
        if peer is None:
            where, public_key = self.directory(node_id)
            peer = await self.node.connect(address or where, server_key=public_key or None)
            self._peers[key] = peer
        return peer

    async def close(self) -> None:
        for peer in self._peers.values():
            await peer.close()
        self._peers.clear()
