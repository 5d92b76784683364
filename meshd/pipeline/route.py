"""Where the stages of one route of the current plan live: an ordered list of endpoints.

A plan has one route per whole-model chain: one pipeline, or a replica per member
holding the whole model, or both (``partition.layout``).

A route is derived from the plan (layer ranges per node) and the membership
directory (address and CURVE key per node). It is versioned with the plan so
every message can be checked against it, and names the plan's model, so a
stage or coordinator holding another model file refuses it (plan versions are
unique in a home: a message's version stands for that model too). Layer ranges are half-open
``[first, end)``, as in :class:`partition.stages.StageAssignment`.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshd.mesh.home_plan import other_model_reason
from partition.ids import NodeId, PlanVersion


@dataclass(frozen=True)
class GroupSeat:
    """One member of a tensor group: where its group links listen, and its key."""

    node_id: NodeId
    address: str  # tcp://host:port of its group socket ("" while unknown)
    public_key: str


@dataclass(frozen=True)
class StageEndpoint:
    node_id: NodeId
    address: str  # tcp://host:port of the node's stage server
    public_key: str  # z85 CURVE key ("" when CURVE is off, e.g. in-process tests)
    first: int
    end: int  # exclusive: the stage runs decoder layers [first, end)
    # a tensor group holds this stage: its members in rank order (``node_id`` first) and their speeds
    group: tuple[GroupSeat, ...] = ()
    group_speeds: tuple[float, ...] = ()
    group_attention: str = "split"  # partition.tensor_split.ATTENTIONS

    @property
    def layers(self) -> tuple[int, int]:
        return (self.first, self.end)

    def rank_of(self, node_id: NodeId) -> int | None:
        """``node_id``'s rank in this stage's tensor group (None: not a member)."""
        return next((i for i, seat in enumerate(self.group) if seat.node_id == node_id), None)


@dataclass(frozen=True)
class Route:
    plan_version: PlanVersion
    stages: tuple[StageEndpoint, ...]
    weights: str = ""  # the plan's numeric mode ("": each stage its own)
    model: str = ""  # identity of the model every stage of the plan holds ("": the plan does not say)
    index: int = 0  # which of the plan's routes this is (a replica, a pipeline group; see partition.layout)

    @property
    def key(self) -> tuple[int, int]:
        """(plan version, route number): unique in a home."""
        return (int(self.plan_version), self.index)

    def index_of(self, node_id: NodeId) -> int | None:
        for i, s in enumerate(self.stages):
            if s.node_id == node_id:
                return i
        return None

    def group_seat(self, node_id: NodeId) -> tuple[int, int] | None:
        """(stage index, rank) of ``node_id`` in a tensor group of this route (None: in none)."""
        for i, s in enumerate(self.stages):
            rank = s.rank_of(node_id)
            if rank is not None:
                return i, rank
        return None

    def next_after(self, index: int) -> StageEndpoint | None:
        return self.stages[index + 1] if index + 1 < len(self.stages) else None

    @property
    def layer_ranges(self) -> list[tuple[int, int]]:
        return [s.layers for s in self.stages]


def model_mismatch(plan_model: str, own: str) -> str:
    """Why a device holding the model ``own`` cannot take part in a plan for ``plan_model`` ("" if it can):
    "holds X, the home serves Y".

    Either side unknown ("": a plan from a daemon too old to name its model, an engine
    without a model file) passes: the check is as strict as what both sides can say.
    """
    if not plan_model or not own or plan_model == own:
        return ""
    return other_model_reason(own, plan_model)
