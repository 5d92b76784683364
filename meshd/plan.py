"""The mesh's current partition plan and how the coordinator computes a new one.

A :class:`Plan` says which member runs which decoder layers ``[first, end)``:
its stages are the partition package's :class:`~partition.plan.StageAssignment`
(the one stage type of the code base), plus what only the daemon knows — the
plan's version, leader, members and why it was chosen. Its ``version`` only
grows; every pipeline message carries it so a stage refuses work computed for
another partition.

Planning uses the partition package's DP (``partition.stagecount.plan_layers``: the
layer DP at the device count that makes a prompt fastest)
over the members' device profiles: the profile a member shared, else a profile
shipped in ``profiles/`` (scaled to nothing — used as is with the member's
memory budget), else nothing. When any member lacks a usable profile, or the
planner refuses, the fallback is an equal split in node-id order, so a mesh
always has *some* plan and says why in ``reason``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshd.log import get_logger
from meshd.profile_files import profile_model, read_profiles
from meshd.state import json_digest
from partition.ids import NodeId, PlanVersion
from partition.plan import LayerAssignment, StageAssignment

log = get_logger("meshd.plan")

PLAN_SEQ_LEN = 512  # prompt length the planner balances for
PLAN_MAX_SEQ = 2048  # KV capacity every stage must fit
DEFAULT_LINK = "100mbit,2ms"  # a typical home Wi-Fi hop

@dataclass(frozen=True)
class Plan(LayerAssignment):
    """The daemon's plan: partition's stages over ``num_layers``, versioned, with who planned it.

    ``layers_of``, ``layer_ranges`` and ``check`` come from
    :class:`~partition.plan.LayerAssignment`, shared with the planner's own plan.
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

    def to_assignment(self) -> dict[str, Any]:
        """The ``transport.messages.PlanUpdate.assignment`` form: node id -> stage.

        Each stage's layers are half-open ``[first, last)``: the wire key ``last``
        is the exclusive end (kept so daemons of different versions interoperate).
        """
        return {
            s.node_id: {
                "stage": i, "first": s.first, "last": s.end, "num_layers": self.num_layers,
                "predicted_bottleneck_s": self.predicted_bottleneck_s, "reason": self.reason,
                "leader": self.leader, "members": list(self.members), "weights": self.weights,
                "model": self.model,
            }
            for i, s in enumerate(self.stages)
        }

    @staticmethod
    def from_assignment(version: int, assignment: dict[str, Any]) -> Plan:
        """Inverse of :meth:`to_assignment`; raises ValueError on inconsistent input."""
        try:
            rows = sorted(assignment.items(), key=lambda kv: int(kv[1]["stage"]))
            stages = tuple(StageAssignment(NodeId(str(n)), int(d["first"]), int(d["last"])) for n, d in rows)
            any_row = rows[0][1] if rows else {}
            num_layers = int(any_row.get("num_layers", stages[-1].end if stages else 0))
            bottleneck = any_row.get("predicted_bottleneck_s")
            plan = Plan(PlanVersion(int(version)), stages, num_layers,
                        None if bottleneck is None else float(bottleneck),
                        str(any_row.get("reason", "")), NodeId(str(any_row.get("leader", ""))),
                        tuple(NodeId(str(m)) for m in any_row.get("members", ())),
                        str(any_row.get("weights", "") or ""), str(any_row.get("model", "") or ""))
        except (KeyError, TypeError, IndexError) as exc:
            raise ValueError(f"malformed plan assignment: {exc}") from None
        plan.check()
        return plan

    def digest(self) -> str:
        """What a stage's version check stands for: the stages and the layer count.

        Heartbeats carry it beside the version, so two members holding different plans
        under one version (two leaders of a briefly split view) are found and re-planned
        above, instead of each serving its own plan forever. The numeric mode and the model are
        left out, so daemons too old to carry them agree with newer ones on the digest of the
        same stages (the leader compares both itself before re-issuing a plan).
        """
        return json_digest([self.num_layers, [[s.node_id, s.first, s.end] for s in self.stages]])

    def to_status(self) -> dict[str, Any]:
        return {
            "version": self.version,
            # half-open [first, end) per stage
            "stages": [{"node_id": s.node_id, "layers": list(s.layers)} for s in self.stages],
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


@dataclass
class MemberInput:
    """What the planner needs to know about one ready member."""

    node_id: NodeId
    memory_budget_mb: int
    profile: dict[str, Any] | None = field(default=None, repr=False)


def equal_split(node_ids: list[NodeId], num_layers: int) -> list[StageAssignment]:
    """Contiguous, near-equal ranges in node-id order (at most one node per layer)."""
    ids = sorted(node_ids)[: max(1, num_layers)]
    n = len(ids)
    out, pos = [], 0
    for i, nid in enumerate(ids):
        size = num_layers // n + (1 if i < num_layers % n else 0)
        out.append(StageAssignment(nid, pos, pos + size))
        pos += size
    return out


def shipped_profiles_dir() -> Path:
    """The reference profiles shipped with meshd: ``meshd/profiles``.

    In a checkout that is a symbolic link to the repository's top-level
    ``profiles/`` (where profiles are measured and reviewed); a wheel or sdist
    copies the files behind it into the package (``package-data`` in
    pyproject.toml), so an installed meshd, which has no repository around
    it, finds the same profiles at the same place and plans by speed.
    """
    return Path(__file__).resolve().parent / "profiles"


def default_profile(weights: str = "", model: str = "") -> dict[str, Any] | None:
    """The profile shipped in ``profiles/`` for a member that shared none: one of ``model`` (its
    identity) when one is shipped — another model's layer times and layer count would make the
    planner refuse and the home fall back to an equal split — measured in the numeric mode
    ``weights`` if possible; else the first (by name) of that mode, else the first of any."""
    shipped = [data for _, data in read_profiles(shipped_profiles_dir())]
    same_model = [data for data in shipped if model and profile_model(data) == model]
    return prefer_mode(same_model or shipped, weights, lambda d: d)


def prefer_mode(items: list, weights: str, profile_of):
    """The first of ``items`` whose profile (``profile_of(item)``) was measured in ``weights``, else
    the first float32 one (profiles before modes had names), else the first; None for none."""
    for want in (weights, "float32"):
        hit = next((it for it in items if want and profile_of(it).get("dtype") == want), None)
        if hit is not None:
            return hit
    return items[0] if items else None


def compute_stages(
    members: list[MemberInput], num_layers: int, weights: str = "", model: str = ""
) -> tuple[list[StageAssignment], float | None, str]:
    """Stages for ``members``: the partition DP when profiles allow it, else equal split."""
    ids = [m.node_id for m in members]
    fallback = default_profile(weights, model)
    profiles = []
    for m in members:
        data = m.profile or fallback
        if data is None:
            return equal_split(ids, num_layers), None, "equal split: no device profiles"
        profiles.append((m, data))
    try:
        from partition.link import parse_link
        from partition.profile import DeviceProfile

        devs = []
        for m, data in profiles:
            p = DeviceProfile.from_dict(data)
            devs.append(dataclasses.replace(
                p, device_id=m.node_id, memory_budget_bytes=int(m.memory_budget_mb) * 2**20))
        if devs[0].num_layers != num_layers:
            raise ValueError(f"profiles are for {devs[0].num_layers} layers, model has {num_layers}")
        from partition.stagecount import plan_layers

        result = plan_layers(devs, parse_link(DEFAULT_LINK), PLAN_SEQ_LEN, PLAN_MAX_SEQ)
    except Exception as exc:  # planner refused or profiles unusable: still have a plan
        log.warning("planner_fallback", error=str(exc))
        return equal_split(ids, num_layers), None, f"equal split: planner failed ({exc})"
    stages = [StageAssignment(NodeId(devs[d].device_id), first, end) for d, first, end in result.split.stages]
    # the bottleneck's kind ("compute" | "memory" | "link") with the planner's own words on it,
    # so `meshd status` explains a plan instead of printing a bare code word
    reason = f"{result.reason}: {result.explanation}"
    if result.left_out:
        reason += f"; {result.left_out}"
    return stages, result.split.bottleneck_s, reason


def make_plan(version: PlanVersion, leader: NodeId, members: list[MemberInput], num_layers: int,
              weights: str = "", model: str = "") -> Plan:
    stages, bottleneck, reason = compute_stages(members, num_layers, weights, model)
    plan = Plan(version, tuple(stages), num_layers, bottleneck, reason, leader,
                tuple(sorted(m.node_id for m in members)), weights, model)
    plan.check()
    return plan


def model_name(identity: str) -> str:
    """What a person calls a model identity: the file name without its digest or ``.gguf``."""
    name = identity.rpartition("@")[0] or identity
    return name.removesuffix(".gguf")


def other_model_reason(holds: str, serves: str) -> str:
    """Why a member holding ``holds`` is not planned in a home serving ``serves`` (names, and the
    full identities when the names alone do not tell the two files apart)."""
    mine, home = model_name(holds), model_name(serves)
    if mine == home:
        mine, home = holds, serves
    return f"holds {mine or 'no model'}, the home serves {home}"


def plannable_members(facts: dict[str, tuple[str, str, int]], incumbent: str = ""
                      ) -> tuple[list[str], str, int, dict[str, str]]:
    """Which ready members a plan may use, from each one's (load state, model identity, layers).

    One model per home: only members whose model is loaded ("none": a control-plane-only
    member, planned only with its like), and only those holding the home's model. The
    home's model is the identity most of them hold (a real model beats "none"); a tie goes
    to ``incumbent`` (the model the current plan serves), then to the lowest node id's. So
    one device restarted with another model (or a newcomer with the default one) is left
    out, and the home moves to another model only as a whole: once most members hold it.
    Everyone else comes back in ``excluded`` with the reason ``meshd status`` shows
    ("holds X, the home serves Y"), instead of a plan mixing layers of two model files.
    Returns (members, model identity, layer count, excluded).
    """
    excluded = {nid: f"model {st}" for nid, (st, _, _) in facts.items() if st not in ("loaded", "none")}
    eligible = sorted(nid for nid in facts if nid not in excluded)
    if not eligible:
        return [], "", 0, excluded
    counts: dict[tuple[str, int], int] = {}
    first_of: dict[tuple[str, int], int] = {}
    for i, nid in enumerate(eligible):
        key = facts[nid][1:]
        counts[key] = counts.get(key, 0) + 1
        first_of.setdefault(key, i)
    home = max(counts, key=lambda k: (bool(k[0]), counts[k], bool(incumbent) and k[0] == incumbent,
                                      -first_of[k]))
    members = [nid for nid in eligible if facts[nid][1:] == home]
    for nid in eligible:
        if facts[nid][1:] != home:
            excluded[nid] = other_model_reason(facts[nid][1], home[0]) if home[0] else \
                f"holds {model_name(facts[nid][1])}, the home runs no model"
    return members, home[0], home[1], excluded


def not_planned(plan: Plan | None, facts: dict[str, tuple[str, str, int]]) -> dict[str, str]:
    """Why each ready member (``facts`` as for :func:`plannable_members`) holds no layers of ``plan``.

    Every member may answer this, not only the leader: the plan names the model it
    serves, and heartbeats say what each member holds. A member the planner was given
    but left without layers says so with the planner's reason; one the plan predates
    waits for the next plan.
    """
    _, home, _, excluded = plannable_members(facts, plan.model if plan is not None else "")
    serves = plan.model if plan is not None and plan.model else home
    out: dict[str, str] = {}
    for nid, (state, ident, _) in sorted(facts.items()):
        if plan is not None and plan.layers_of(NodeId(nid)):
            continue
        if state not in ("loaded", "none"):
            out[nid] = f"model {state}"
        elif serves and ident != serves:
            out[nid] = other_model_reason(ident, serves)
        elif nid in excluded:
            out[nid] = excluded[nid]
        elif plan is None:
            out[nid] = "no plan yet"
        elif nid in plan.members:
            out[nid] = f"the planner gave it no layers ({plan.reason})" if plan.reason else \
                "the planner gave it no layers"
        else:
            out[nid] = f"not in plan v{plan.version} (made before it was ready); the next plan includes it"
    return out
