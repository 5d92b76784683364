"""The plan: who runs which layers, and how to chunk prompts — one vocabulary for the code base.

Plain frozen dataclasses with a versioned JSON form. Layer ranges are half-open
everywhere: a :class:`StageAssignment` runs decoder layers ``[first, end)``,
exactly what ``ModelSource.load_stage(first, end)`` takes. ``Plan.version`` is
the daemon's monotonic plan counter (peers ignore older plans);
``schema_version`` is the format of this object.

The daemon's own plan (``meshd.plan.Plan``: version, leader, members) is made
of the same :class:`StageAssignment` and shares :class:`LayerAssignment`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field

from partition.errors import PartitionError
from partition.ids import NodeId, PlanVersion
from partition.link import LinkModel

PLAN_SCHEMA_VERSION = 2  # 2: stages say "end_layer" (exclusive); 1 said "last_layer" (inclusive)


class PromptTooLongError(PartitionError):
    """A prompt longer than the plan's ``max_seq``."""


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
        }

    @classmethod
    def from_dict(cls, d: dict) -> "StageAssignment":
        end = int(d["end_layer"]) if "end_layer" in d else int(d["last_layer"]) + 1  # schema 1
        return cls(NodeId(d["device"]), int(d["first_layer"]), end, float(d.get("compute_s", 0)),
                   float(d.get("transfer_s", 0)), int(d.get("memory_bytes", 0)),
                   int(d.get("memory_budget_bytes", 0)))


def check_tiling(stages: Iterable[StageAssignment], num_layers: int) -> None:
    """Stages must tile ``[0, num_layers)`` contiguously, one range per node (else ValueError)."""
    stages = tuple(stages)
    if not stages or num_layers <= 0:
        raise ValueError("a plan needs at least one stage and one layer")
    pos = 0
    for s in stages:
        if s.first != pos or s.end <= s.first:
            raise ValueError(f"plan stages do not tile the layers: {stages}")
        pos = s.end
    if pos != num_layers or len({s.node_id for s in stages}) != len(stages):
        raise ValueError(f"plan does not cover {num_layers} layers once: {stages}")


class LayerAssignment:
    """What every plan is: ``stages`` (a tuple of :class:`StageAssignment`) over ``num_layers``."""

    stages: tuple[StageAssignment, ...]
    num_layers: int

    def layers_of(self, node_id: str) -> tuple[int, int] | None:
        """``[first, end)`` of ``node_id``'s stage, or None when it runs no layers."""
        for s in self.stages:
            if s.node_id == node_id:
                return s.layers
        return None

    @property
    def layer_ranges(self) -> list[tuple[int, int]]:
        return [s.layers for s in self.stages]

    def check(self) -> None:
        """Stages must tile [0, num_layers) contiguously, one range per node (else ValueError)."""
        check_tiling(self.stages, self.num_layers)


@dataclass(frozen=True)
class CutTable:
    """Chunk cut points for every prompt length ``0..max_seq``; ``lookup`` is O(1).

    ``cuts[y]`` are the interior chunk boundaries of a prompt of ``y`` tokens:
    ``(300, 650)`` for ``y = 1000`` means chunks [0,300), [300,650), [650,1000).
    """

    max_seq: int
    k_max: int
    min_chunk: int
    cuts: tuple[tuple[int, ...], ...]
    latency_s: tuple[float, ...]

    def lookup(self, prompt_len: int) -> tuple[int, ...]:
        self._check(prompt_len)
        return self.cuts[prompt_len]

    def chunks(self, prompt_len: int) -> list[tuple[int, int]]:
        bounds = (0, *self.lookup(prompt_len), prompt_len)
        return [(a, b) for a, b in zip(bounds, bounds[1:])]

    def predicted_latency_s(self, prompt_len: int) -> float:
        self._check(prompt_len)
        return self.latency_s[prompt_len]

    def _check(self, prompt_len: int) -> None:
        if not 0 <= prompt_len <= self.max_seq:
            raise PromptTooLongError(
                f"prompt of {prompt_len} tokens is outside the plan's range 0..{self.max_seq}"
            )

    def to_dict(self) -> dict:
        return {"max_seq": self.max_seq, "k_max": self.k_max, "min_chunk": self.min_chunk,
                "cuts": [list(c) for c in self.cuts], "latency_s": list(self.latency_s)}

    @classmethod
    def from_dict(cls, d: dict) -> "CutTable":
        return cls(int(d["max_seq"]), int(d["k_max"]), int(d["min_chunk"]),
                   tuple(tuple(int(v) for v in c) for c in d["cuts"]),
                   tuple(float(v) for v in d["latency_s"]))


@dataclass(frozen=True)
class Plan(LayerAssignment):
    """The planner's full answer: the stages, why the bottleneck is where it is, the cut table."""

    model_identity: str
    num_layers: int
    stages: tuple[StageAssignment, ...]
    plan_seq_len: int
    max_seq: int
    link: LinkModel
    bottleneck_stage: int  # index into stages
    bottleneck_s: float
    bottleneck_reason: str  # "compute" | "memory" | "link"
    explanation: str
    unused_devices: tuple[NodeId, ...] = ()
    exact_search: bool = True
    cut_table: CutTable | None = None
    planning_seconds: float = 0.0
    version: PlanVersion = PlanVersion(0)
    schema_version: int = PLAN_SCHEMA_VERSION
    extras: dict = field(default_factory=dict)

    @property
    def devices(self) -> tuple[NodeId, ...]:
        return tuple(s.node_id for s in self.stages)

    def to_dict(self, include_cut_table: bool = True) -> dict:
        d = {
            "schema_version": self.schema_version,
            "version": self.version,
            "model_identity": self.model_identity,
            "num_layers": self.num_layers,
            "stages": [s.to_dict(self.num_layers) for s in self.stages],
            "plan_seq_len": self.plan_seq_len,
            "max_seq": self.max_seq,
            "link": self.link.to_dict(),
            "bottleneck": {
                "stage": self.bottleneck_stage,
                "device": self.stages[self.bottleneck_stage].node_id,
                "seconds": self.bottleneck_s,
                "reason": self.bottleneck_reason,
                "explanation": self.explanation,
            },
            "unused_devices": list(self.unused_devices),
            "exact_search": self.exact_search,
            "planning_seconds": self.planning_seconds,
            "extras": self.extras,
        }
        if include_cut_table and self.cut_table is not None:
            d["cut_table"] = self.cut_table.to_dict()
        return d

    def to_json(self, include_cut_table: bool = True) -> str:
        return json.dumps(self.to_dict(include_cut_table), separators=(",", ":"))

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        if d.get("schema_version") not in (1, PLAN_SCHEMA_VERSION):
            raise PartitionError(f"plan schema version {d.get('schema_version')!r} not supported")
        bn = d["bottleneck"]
        return cls(
            model_identity=d["model_identity"],
            num_layers=int(d["num_layers"]),
            stages=tuple(StageAssignment.from_dict(s) for s in d["stages"]),
            plan_seq_len=int(d["plan_seq_len"]),
            max_seq=int(d["max_seq"]),
            link=LinkModel.from_dict(d["link"]),
            bottleneck_stage=int(bn["stage"]),
            bottleneck_s=float(bn["seconds"]),
            bottleneck_reason=bn["reason"],
            explanation=bn["explanation"],
            unused_devices=tuple(NodeId(n) for n in d.get("unused_devices", ())),
            exact_search=bool(d.get("exact_search", True)),
            cut_table=CutTable.from_dict(d["cut_table"]) if d.get("cut_table") else None,
            planning_seconds=float(d.get("planning_seconds", 0.0)),
            version=PlanVersion(int(d.get("version", 0))),
            extras=dict(d.get("extras") or {}),
        )

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        return cls.from_dict(json.loads(text))
