"""Where the stages of the current plan live: an ordered list of endpoints.

A route is derived from the plan (layer ranges per node) and the membership
directory (address and CURVE key per node). It is versioned with the plan so
every message can be checked against it. Layer ranges are half-open
``[first, end)``, as in :class:`partition.plan.StageAssignment`.
"""

from __future__ import annotations

from dataclasses import dataclass

from partition.ids import NodeId, PlanVersion


@dataclass(frozen=True)
class StageEndpoint:
    node_id: NodeId
    address: str  # tcp://host:port of the node's stage server
    public_key: str  # z85 CURVE key ("" when CURVE is off, e.g. in-process tests)
    first: int
    end: int  # exclusive: the stage runs decoder layers [first, end)

    @property
    def layers(self) -> tuple[int, int]:
        return (self.first, self.end)


@dataclass(frozen=True)
class Route:
    plan_version: PlanVersion
    stages: tuple[StageEndpoint, ...]
    weights: str = ""  # the plan's numeric mode ("": each stage its own)

    def index_of(self, node_id: str) -> int | None:
        for i, s in enumerate(self.stages):
            if s.node_id == node_id:
                return i
        return None

    def next_after(self, index: int) -> StageEndpoint | None:
        return self.stages[index + 1] if index + 1 < len(self.stages) else None

    @property
    def layer_ranges(self) -> list[tuple[int, int]]:
        return [s.layers for s in self.stages]
