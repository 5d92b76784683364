"""The plan: who runs which layers, and how to chunk prompts — one type for the code base.

One frozen :class:`Plan` serves the offline planner (``meshd plan``, the benchmarks)
and the daemon (versioned, with its leader and members, broadcast as
``transport.messages.PlanUpdate``). Layer ranges are half-open everywhere: a
:class:`StageAssignment` runs decoder layers ``[first, end)``, exactly what
``ModelSource.load_stage(first, end)`` takes. ``Plan.version`` is the daemon's
monotonic plan counter (peers ignore older plans); ``schema_version`` is the
format of the JSON file form.

Two serialised forms, for two readers: the JSON file (``to_dict``, what ``meshd
plan --out`` writes) and the wire's assignment (``to_assignment``: node id ->
its stage row, what members of every meshd version read). A stage, its routes and
the spelling of its layer range on the wire are ``partition.stages``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from partition.cuttable import CutTable
from partition.errors import PartitionError
from partition.ids import NodeId, PlanVersion
from partition.link import DEFAULT_LINK, LinkModel  # noqa: F401 - DEFAULT_LINK: spelled here since 0.2
from partition.log import get_logger
from partition.stages import StageAssignment, check_tiling, group_routes, range_from_wire, range_to_wire

log = get_logger("partition.plan")

PLAN_SCHEMA_VERSION = 2  # 2: stages say "end_layer" (exclusive); 1 said "last_layer" (inclusive)

# What a home plans for (the daemon's planner and every member's status agree on these)
PLAN_SEQ_LEN = 512  # prompt length the layer split is balanced for
PLAN_MAX_SEQ = 2048  # KV capacity every stage must fit; the cut table covers prompts up to it


def json_digest(obj: Any) -> str:
    """A short digest of a JSON-able value (keys sorted), compared in heartbeats.

    Byte-for-byte the digest meshd has always sent (``meshd.state.json_digest``):
    members of older versions compare it with theirs.
    """
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


#: the most a shipped cut table may take of a message header (capped at 64 KiB by transport.wire)
MAX_SHIPPED_TABLE_BYTES = 40 * 1024

@dataclass(frozen=True)
class Plan:
    """Who runs which layers: the stages over ``num_layers``, why, and how to chunk prompts.

    The first fields are what every member holds (they travel in ``PlanUpdate``):
    the version, the stages, the predicted bottleneck and the reason in words, who
    planned it over whom, the numeric mode (``weights``) and model identity every
    stage computes with ("": not said), and the cut table, which the leader
    computes once so members need not. The rest is the planner's account
    (``partition.planner.make_plan`` fills it; the wire leaves it out).
    """

    version: PlanVersion
    stages: tuple[StageAssignment, ...]
    num_layers: int
    predicted_bottleneck_s: float | None = None
    reason: str = ""
    leader: NodeId = NodeId("")
    members: tuple[NodeId, ...] = ()  # the ready members it was planned over (some may get no layers)
    weights: str = ""  # the numeric mode every stage computes in (the leader's; "": each member its own)
    model: str = ""  # identity of the model file every stage holds (name@sha256 prefix; "": not said)
    cut_table: CutTable | None = None
    # -- the planner's account
    plan_seq_len: int = 0
    max_seq: int = 0
    link: LinkModel | None = None
    bottleneck_stage: int = 0  # index into stages
    bottleneck_reason: str = ""  # "compute" | "memory" | "link"
    explanation: str = ""
    unused_devices: tuple[NodeId, ...] = ()
    exact_search: bool = True
    planning_seconds: float = 0.0
    schema_version: int = PLAN_SCHEMA_VERSION
    extras: dict = field(default_factory=dict)
    layout: str = ""  # "pipeline" | "replicas" | "mixed" ("": a plan from before layouts, one pipeline)

    # -- reading it
    @property
    def devices(self) -> tuple[NodeId, ...]:
        """Every device holding layers (a tensor group's members too)."""
        return tuple(n for s in self.stages for n in s.holders)

    @property
    def routes(self) -> tuple[tuple[StageAssignment, ...], ...]:
        """The plan's routes: each a whole-model chain (one stage: a replica; several: a pipeline)."""
        return group_routes(self.stages)

    @property
    def pipeline_route(self) -> tuple[StageAssignment, ...]:
        """The first route with more than one stage (the one prompts are cut for); () when none."""
        return next((r for r in self.routes if len(r) > 1), ())

    def layers_of(self, node_id: str) -> tuple[int, int] | None:
        """``[first, end)`` of ``node_id``'s stage (a group member: of the stage its group holds), or None
        when it holds no layers."""
        for s in self.stages:
            if node_id in s.holders:
                return s.layers
        return None

    def group_of(self, node_id: str) -> tuple[StageAssignment, int] | None:
        """The stage whose tensor group ``node_id`` is in, and its rank there (0 leads); None: in no group."""
        for s in self.stages:
            if node_id in s.group:
                return s, s.group.index(node_id)
        return None

    @property
    def layer_ranges(self) -> list[tuple[int, int]]:
        return [s.layers for s in self.stages]

    def check(self) -> None:
        """Stages must tile [0, num_layers) contiguously, one range per node (else ValueError)."""
        check_tiling(self.stages, self.num_layers)

    def digest(self) -> str:
        """What a stage's version check stands for: the stages and the layer count.

        Heartbeats carry it beside the version, so two members holding different plans
        under one version (two leaders of a briefly split view) are found and re-planned
        above, instead of each serving its own plan forever. The numeric mode, the model
        and the cut table are left out, so daemons too old to carry them agree with newer
        ones on the digest of the same stages (the leader compares mode and model itself
        before re-issuing a plan).
        """
        if any(s.group for s in self.stages):  # groups: a replica and a group over the same layers differ
            return json_digest([self.num_layers, [[s.node_id, s.first, s.end, s.route, list(s.group),
                                                   list(s.group_speeds),
                                                   *([s.group_attention] if s.group_attention != "split" else [])]
                                                  for s in self.stages]])
        if all(s.route == 0 for s in self.stages):  # one route: the digest every meshd has computed
            return json_digest([self.num_layers, [[s.node_id, s.first, s.end] for s in self.stages]])
        return json_digest([self.num_layers, [[s.node_id, s.first, s.end, s.route] for s in self.stages]])

    def to_status(self) -> dict[str, Any]:
        """The plan in ``meshd status`` (the same document on members of every version)."""
        several = len(self.routes) > 1 or any(s.group for s in self.stages)
        return {
            "version": self.version,
            # half-open [first, end) per stage
            # (routes and the layout only for a plan of several routes: members of every version
            # show a one-pipeline plan alike)
            "stages": [{"node_id": s.node_id, "layers": list(s.layers),
                        **({"route": s.route} if several else {}),
                        **({"tensor_group": list(s.group), "tensor_speeds": list(s.group_speeds),
                            "tensor_attention": s.group_attention} if s.group else {})} for s in self.stages],
            **({"layout": self.layout or "mixed"} if several else {}),
            "num_layers": self.num_layers,
            # seconds the slowest stage takes (compute + hand-off) for one prefill of
            # PLAN_SEQ_LEN prompt tokens: the planner's objective, not a per-token time
            "predicted_bottleneck": self.predicted_bottleneck_s,
            "predicted_bottleneck_for_tokens": PLAN_SEQ_LEN,
            "reason": self.reason,
            "leader": self.leader,
            "members": list(self.members),
            **({"weights": self.weights} if self.weights else {}),
            **({"model": self.model} if self.model else {}),
        }

    # -- the wire: transport.messages.PlanUpdate.assignment
    def to_assignment(self) -> dict[str, Any]:
        """The ``PlanUpdate.assignment`` form: node id -> its stage row.

        Plan-wide fields repeat in every row (members of 0.1 and 0.2 read them from
        any row); the cut table, the one large field, rides in the first stage's row
        only. Readers of every version ignore row keys they do not know.
        """
        rows = {}
        for i, s in enumerate(self.stages):
            rows[s.node_id] = {
                "stage": i, **range_to_wire(s.first, s.end), "num_layers": self.num_layers,
                "predicted_bottleneck_s": self.predicted_bottleneck_s, "reason": self.reason,
                "leader": self.leader, "members": list(self.members), "weights": self.weights,
                "model": self.model, "route": s.route, "layout": self.layout, **s.group_to_wire(),
            }
        if self.cut_table is not None and self.stages:
            wire = self.cut_table.to_wire()
            size = len(wire["cuts"]) + len(wire["latency_s"])
            if size <= MAX_SHIPPED_TABLE_BYTES:
                rows[(self.pipeline_route or self.stages)[0].node_id]["cut_table"] = wire
            else:  # members build their own, as for a leader that ships none
                log.warning("cut_table_not_shipped", plan_version=self.version, bytes=size,
                            limit=MAX_SHIPPED_TABLE_BYTES)
        return rows

    @staticmethod
    def from_assignment(version: int, assignment: dict[str, Any]) -> "Plan":
        """Inverse of :meth:`to_assignment`; ValueError on inconsistent stages.

        A cut table that does not decode is dropped (logged), not the plan: members
        can compute one themselves, as they did before leaders shipped it.
        """
        try:
            rows = sorted(assignment.items(), key=lambda kv: int(kv[1]["stage"]))
            stages = tuple(StageAssignment(NodeId(str(n)), *range_from_wire(d), route=int(d.get("route", 0)),
                                           **StageAssignment.group_from_wire(d))
                           for n, d in rows)
            any_row = rows[0][1] if rows else {}
            num_layers = int(any_row.get("num_layers", stages[-1].end if stages else 0))
            bottleneck = any_row.get("predicted_bottleneck_s")
            plan = Plan(PlanVersion(int(version)), stages, num_layers,
                        None if bottleneck is None else float(bottleneck),
                        str(any_row.get("reason", "")), NodeId(str(any_row.get("leader", ""))),
                        tuple(NodeId(str(m)) for m in any_row.get("members", ())),
                        str(any_row.get("weights", "") or ""), str(any_row.get("model", "") or ""),
                        _shipped_cut_table(int(version), [d for _, d in rows]),
                        layout=str(any_row.get("layout", "") or ""))
        except (KeyError, TypeError, IndexError, ValueError) as exc:
            raise ValueError(f"malformed plan assignment: {exc}") from None
        plan.check()
        return plan

    # -- the file: meshd plan --out
    def to_dict(self, include_cut_table: bool = True) -> dict:
        d: dict[str, Any] = {
            "schema_version": self.schema_version,
            "version": self.version,
            "model_identity": self.model,
            "num_layers": self.num_layers,
            "stages": [s.to_dict(self.num_layers) for s in self.stages],
            "plan_seq_len": self.plan_seq_len,
            "max_seq": self.max_seq,
            **({"link": self.link.to_dict()} if self.link is not None else {}),
            "bottleneck": {
                "stage": self.bottleneck_stage,
                "device": self.stages[self.bottleneck_stage].node_id if self.stages else None,
                "seconds": self.predicted_bottleneck_s,
                "reason": self.bottleneck_reason,
                "explanation": self.explanation,
            },
            "unused_devices": list(self.unused_devices),
            "exact_search": self.exact_search,
            "planning_seconds": self.planning_seconds,
            "extras": self.extras,
            "reason": self.reason,
            "leader": self.leader,
            "members": list(self.members),
            "weights": self.weights,
            "layout": self.layout,
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
        bn = d.get("bottleneck") or {}
        seconds = bn.get("seconds")
        return cls(
            version=PlanVersion(int(d.get("version", 0))),
            stages=tuple(StageAssignment.from_dict(s) for s in d["stages"]),
            num_layers=int(d["num_layers"]),
            predicted_bottleneck_s=None if seconds is None else float(seconds),
            reason=str(d.get("reason", "")),
            leader=NodeId(str(d.get("leader", ""))),
            members=tuple(NodeId(str(m)) for m in d.get("members", ())),
            weights=str(d.get("weights", "")),
            model=str(d.get("model_identity", "")),
            cut_table=CutTable.from_dict(d["cut_table"]) if d.get("cut_table") else None,
            plan_seq_len=int(d.get("plan_seq_len", 0)),
            max_seq=int(d.get("max_seq", 0)),
            link=LinkModel.from_dict(d["link"]) if d.get("link") else None,
            bottleneck_stage=int(bn.get("stage", 0)),
            bottleneck_reason=str(bn.get("reason", "")),
            explanation=str(bn.get("explanation", "")),
            unused_devices=tuple(NodeId(n) for n in d.get("unused_devices", ())),
            exact_search=bool(d.get("exact_search", True)),
            planning_seconds=float(d.get("planning_seconds", 0.0)),
            extras=dict(d.get("extras") or {}),
            layout=str(d.get("layout", "")),
        )

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        return cls.from_dict(json.loads(text))


def _shipped_cut_table(version: int, rows: list[dict[str, Any]]) -> CutTable | None:
    """The cut table a plan's rows carry (None: its leader predates shipping one, or it was unreadable)."""
    wire = next((r["cut_table"] for r in rows if isinstance(r.get("cut_table"), dict)), None)
    if wire is None:
        return None
    try:
        return CutTable.from_wire(wire)
    except ValueError as exc:
        log.warning("cut_table_unreadable", plan_version=version, error=str(exc))
        return None
