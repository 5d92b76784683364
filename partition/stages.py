"""One stage of a plan: which node runs which layers, the routes stages form, and the range on the wire.

A :class:`StageAssignment` runs decoder layers ``[first, end)``, half-open, exactly
what ``ModelSource.load_stage(first, end)`` takes; the stages of one route tile the
model (:func:`check_tiling`). Apart from :class:`~partition.plan.Plan` because
planners, layouts and tests build stages on their own, and because the range's
wire spelling (:func:`range_to_wire` / :func:`range_from_wire`, the only way a
range crosses the wire) has to stay readable by members of every meshd version.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from partition.ids import NodeId
from partition.tensor_split import ATTENTIONS

#: the wire key of a stage's half-open layer range ``[start, stop)``, since meshd 0.3
RANGE_KEY = "layers_v2"


def range_to_wire(start: int, stop: int) -> dict[str, Any]:
    """The wire keys of the half-open layer range ``[start, stop)``.

    ``layers_v2`` names it explicitly; ``first``/``last`` are what members on
    meshd 0.1 and 0.2 read (their ``last`` is the exclusive end, unlike the
    inclusive ``last_layer`` of plan files of schema 1), so a mixed home agrees.
    """
    return {RANGE_KEY: [start, stop], "first": start, "last": stop}


def range_from_wire(row: dict[str, Any]) -> tuple[int, int]:
    """``[start, stop)`` from any spelling a plan row has had, newest first.

    ``layers_v2: [start, stop]``; the wire's ``first``/``last`` (exclusive, meshd
    0.1/0.2); the file's ``first_layer``/``end_layer`` (schema 2) or
    ``first_layer``/``last_layer`` (inclusive, schema 1). KeyError/TypeError/
    ValueError on none of these.
    """
    if RANGE_KEY in row:
        start, stop = row[RANGE_KEY]
        return int(start), int(stop)
    if "first" in row:
        return int(row["first"]), int(row["last"])
    if "end_layer" in row:
        return int(row["first_layer"]), int(row["end_layer"])
    return int(row["first_layer"]), int(row["last_layer"]) + 1


@dataclass(frozen=True)
class StageAssignment:
    """One pipeline stage: ``node_id`` runs decoder layers ``[first, end)``.

    The first stage (``first == 0``) also runs the embedding, the last one
    (``end == num_layers``) the head. The timings and memory are the planner's
    predictions for the plan's ``plan_seq_len``-token prompt (0 when unknown).
    """

    node_id: NodeId
    first: int
    end: int  # exclusive
    compute_s: float = 0.0
    transfer_s: float = 0.0
    memory_bytes: int = 0
    memory_budget_bytes: int = 0
    route: int = 0  # which of the plan's routes (a replica or a pipeline group) this stage belongs to
    # A tensor-parallel group holds this stage: its members in rank order (``node_id`` first: it leads,
    # the others compute their share of every layer beside it) and their relative speeds, from which
    # every member computes the same split (partition.tensor_split). (): one device.
    group: tuple[NodeId, ...] = ()
    group_speeds: tuple[float, ...] = ()
    # how the group holds the attention: "split" by heads, or "whole" on every member (partition.tensor_split)
    group_attention: str = "split"

    @property
    def holders(self) -> tuple[NodeId, ...]:
        """Every device this stage's layers are on: its group, or its one device."""
        return self.group or (self.node_id,)

    @property
    def layers(self) -> tuple[int, int]:
        """``(first, end)``, half-open."""
        return (self.first, self.end)

    @property
    def num_layers(self) -> int:
        return self.end - self.first

    @property
    def has_embedding(self) -> bool:
        return self.first == 0

    def has_head_of(self, model_layers: int) -> bool:
        """Whether this stage runs the head of a ``model_layers``-layer model."""
        return self.end == model_layers

    @property
    def time_s(self) -> float:
        return self.compute_s + self.transfer_s

    def to_dict(self, model_layers: int) -> dict:
        return {
            "device": self.node_id,
            "first_layer": self.first,
            "end_layer": self.end,
            "has_embedding": self.has_embedding,
            "has_head": self.has_head_of(model_layers),
            "compute_s": self.compute_s,
            "transfer_s": self.transfer_s,
            "memory_bytes": self.memory_bytes,
            "memory_budget_bytes": self.memory_budget_bytes,
            "route": self.route,
            **self.group_to_wire(),
        }

    def group_to_wire(self) -> dict:
        """The group's keys of a stage row (none for one device: rows readers of every version know)."""
        if not self.group:
            return {}
        return {"group": list(self.group), "group_speeds": list(self.group_speeds),
                **({"group_attention": self.group_attention} if self.group_attention != "split" else {})}

    @staticmethod
    def group_from_wire(d: dict) -> dict:
        group = tuple(NodeId(str(n)) for n in d.get("group", ()) or ())
        return {"group": group, "group_speeds": tuple(float(x) for x in d.get("group_speeds", ()) or ()),
                "group_attention": str(d.get("group_attention", "split") or "split")}

    @classmethod
    def from_dict(cls, d: dict) -> "StageAssignment":
        first, end = range_from_wire(d)
        return cls(NodeId(d["device"]), first, end, float(d.get("compute_s", 0)),
                   float(d.get("transfer_s", 0)), int(d.get("memory_bytes", 0)),
                   int(d.get("memory_budget_bytes", 0)), int(d.get("route", 0)), **cls.group_from_wire(d))


def group_routes(stages: Iterable[StageAssignment]) -> tuple[tuple[StageAssignment, ...], ...]:
    """The stages of each route, routes in order of their number, stages in pipeline order."""
    routes: dict[int, list[StageAssignment]] = {}
    for s in stages:
        routes.setdefault(s.route, []).append(s)
    return tuple(tuple(routes[r]) for r in sorted(routes))


def check_tiling(stages: Iterable[StageAssignment], num_layers: int) -> None:
    """Each route's stages must tile ``[0, num_layers)`` contiguously, and no node may be in two
    stages (else ValueError)."""
    stages = tuple(stages)
    if not stages or num_layers <= 0:
        raise ValueError("a plan needs at least one stage and one layer")
    for route in group_routes(stages):
        pos = 0
        for s in route:
            if s.first != pos or s.end <= s.first:
                raise ValueError(f"plan stages do not tile the layers: {stages}")
            pos = s.end
        if pos != num_layers:
            raise ValueError(f"plan does not cover {num_layers} layers once: {stages}")
    held = [n for s in stages for n in s.holders]
    if len(set(held)) != len(held):
        raise ValueError(f"a node holds two stages of the plan: {stages}")
    for s in stages:
        if s.group and (s.group[0] != s.node_id or len(s.group) < 2 or len(s.group_speeds) != len(s.group)
                        or min(s.group_speeds) <= 0):
            raise ValueError(f"a tensor group is led by its stage's device and names a speed per member: {s}")
        if s.group_attention not in ATTENTIONS:
            raise ValueError(f"a tensor group holds the attention split or whole, not {s.group_attention!r}: {s}")
