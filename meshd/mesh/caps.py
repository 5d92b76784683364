"""What a member's daemon can do, from the one set its heartbeats announce.

A home mid-upgrade runs several meshd versions, so a daemon must know what a peer decodes
before sending it a field or a reply it would refuse. That used to be two mechanisms:
version gates (``ErrorReply.node`` for members "from 0.3 on", which this tree, still 0.2.0,
never was: the field was never sent) and heartbeat flags added one by one (``layouts``,
``exits``). Now every daemon announces one set, :data:`OURS`, in its heartbeats
(``MeshHeartbeat.caps``) and its peers decide from that set alone; a member whose
heartbeats carry no set runs a release from before it and has none of these capabilities.

One fact the set cannot carry is whether a member may be sent the set at all: meshd 0.1
refuses a heartbeat with any field it lacks. A member without a set is credited with
:attr:`Cap.HEARTBEAT_FIELDS` when the version its heartbeats carry (0.1 sent it too) is 0.2
or later: :meth:`PeerCaps.of` is the one place a version is read.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

#: meshd 0.2 made heartbeats extensible: members since then take fields they do not know.
_EXTENSIBLE_FROM = (0, 2)


class Cap(enum.Enum):
    HEARTBEAT_FIELDS = "heartbeat_fields"  # takes heartbeat fields added after 0.1 (this set among them)
    LAYOUTS = "layouts"  # follows plans of several routes (replicas, mixed layouts), not one pipeline only
    EXITS = "exits"  # its coordinator reads early-exit fields (HelloReply.exits, TokenResult.exit_layer)
    ERROR_NODE = "error_node"  # its coordinator reads ErrorReply.node and .seq_id
    PROGRESS = "progress"  # its stage reports StageProgress during long passes; its coordinator reads them
    TENSOR_GROUPS = "tensor_groups"  # takes a seat in a plan's tensor group (announces its group port)
    # holds a group's attention whole when the plan says so (StageAssignment.group_attention): a member
    # without it would split what the others hold whole
    TENSOR_WHOLE_ATTENTION = "tensor_whole_attention"


@dataclass(frozen=True)
class PeerCaps:
    """The capabilities one member announced (test with ``Cap.X in caps``)."""

    caps: frozenset[Cap] = frozenset()

    def __contains__(self, cap: Cap) -> bool:
        return cap in self.caps

    @classmethod
    def announced(cls, names: Iterable[str]) -> PeerCaps:
        """From a heartbeat's set; names this daemon does not know (a newer member's) are left out."""
        known = {c.value: c for c in Cap}
        return cls(frozenset(known[n] for n in names if n in known) | {Cap.HEARTBEAT_FIELDS})

    @classmethod
    def of(cls, info: Mapping[str, Any]) -> PeerCaps:
        """A member's capabilities from its latest heartbeat's facts (``MeshView.info_of``; {}: none heard)."""
        names = info.get("caps")
        if isinstance(names, (list, tuple)):
            return cls.announced(str(n) for n in names)
        return cls(frozenset({Cap.HEARTBEAT_FIELDS}) if _release(info.get("version")) >= _EXTENSIBLE_FROM
                   else frozenset())

    def to_wire(self) -> list[str]:
        return sorted(c.value for c in self.caps)


def _release(version: Any) -> tuple[int, ...]:
    """"0.2.0" -> (0, 2, 0); anything unparsable (an unknown peer, none heard) -> () (the oldest)."""
    try:
        return tuple(int(x) for x in str(version or "").split("+")[0].split("."))
    except ValueError:
        return ()


#: This daemon's capabilities, announced in every heartbeat it sends.
OURS = PeerCaps(frozenset(Cap))
