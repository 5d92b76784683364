"""Outgoing links of a pipeline node, one per peer, opened on first use.

Stages and coordinators address each other by node id; the directory says
where a node listens and which CURVE key it must present. The directory is
asked again on every use: a member that restarts on a new port or gets a new
DHCP address is followed at once (the stale link is closed), instead of
being dialled at its old address forever.
"""

from __future__ import annotations

from collections.abc import Callable

from meshd.log import get_logger
from transport.peer import Peer
from transport.node import TransportNode
from partition.ids import NodeId

log = get_logger("meshd.links")

Directory = Callable[[str], tuple[str, str]]  # node id -> (address, z85 public key)


class Links:
    def __init__(self, node: TransportNode, directory: Directory):
        self.node = node
        self.directory = directory
        self._peers: dict[str, tuple[tuple[str, str], Peer]] = {}

    async def to(self, node_id: NodeId, address: str | None = None) -> Peer:
        """The link to ``node_id`` (at ``address`` if given, else where the directory says).

        Raises KeyError when the directory does not know the node or where it listens (yet).
        """
        where, public_key = self.directory(node_id)
        target = (address or where, public_key or "")
        if not target[0]:
            raise KeyError(f"no endpoint known for {node_id} yet")
        key = f"{node_id}|{address}" if address else node_id
        cached = self._peers.get(key)
        if cached is not None and cached[0] == target:
            return cached[1]
        if cached is not None:
            log.info("link_redialled", peer=node_id, old=cached[0][0], new=target[0])
            self._peers.pop(key, None)
            await cached[1].close()
        if address:  # a coordinator's new reply address: links to its old ones are dead
            for old in [k for k in self._peers if k.startswith(node_id + "|") and k != key]:
                await self._peers.pop(old)[1].close()
        peer = await self.node.connect(target[0], server_key=target[1] or None)
        self._peers[key] = (target, peer)
        return peer

    async def forget(self, node_id: NodeId) -> None:
        """Close every link to ``node_id`` (it left or restarted)."""
        for key in [k for k in self._peers if k == node_id or k.startswith(node_id + "|")]:
            _, peer = self._peers.pop(key)
            await peer.close()

    async def close(self) -> None:
        for _, peer in self._peers.values():
            await peer.close()
        self._peers.clear()
