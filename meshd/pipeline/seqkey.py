"""Home-wide sequence keys: which coordinator owns a sequence, and which of its requests.

Every stage structure (KV cache, sampler, tombstone) and every pipeline message
is keyed by a ``SeqKey``. A bare per-coordinator counter is not enough: two
daemons coordinating at once would both number their sequences from 1, and one
daemon's free would free the other's cache. The key also tells a stage whose
work it holds, so a draining stage knows which sequences belong to other
daemons. The incarnation part keeps a restarted daemon's keys apart from the
ones its previous run left in flight.
"""

from __future__ import annotations

import itertools
import secrets

from partition.ids import NodeId, SeqKey  # the one definition of the id NewTypes

__all__ = ["SeqKey", "SeqKeys", "coordinator_of"]

_SEP = "/"


class SeqKeys:
    """Mints keys ``<node id>/<incarnation>/<n>`` for one coordinator."""

    def __init__(self, node_id: NodeId):
        if _SEP in node_id:
            raise ValueError(f"node id {node_id!r} may not contain {_SEP!r}")
        self.node_id = node_id
        self.incarnation = secrets.token_hex(4)
        self._n = itertools.count(1)

    def next(self) -> SeqKey:
        return SeqKey(f"{self.node_id}{_SEP}{self.incarnation}{_SEP}{next(self._n)}")


def coordinator_of(key: SeqKey) -> NodeId:
    """The node id of the coordinator that owns ``key``."""
    return NodeId(key.split(_SEP, 1)[0])
