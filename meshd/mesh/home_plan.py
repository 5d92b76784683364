"""The home's plan: how the leader computes it over the members, and why members hold no layers.

The plan itself is the partition package's :class:`~partition.plan.Plan` (the one
plan type of the code base): which member runs which decoder layers ``[first,
end)``, its version (it only grows; every pipeline message carries it so a stage
refuses work computed for another partition), its leader and members, and the
cut table for chunking prompts.

Planning is ``partition.planner.make_plan`` over the members' device profiles:
the profile a member shared, else a profile shipped with meshd (``meshd/profiles``:
used as is with the member's memory budget), else nothing. When any member
lacks a usable profile, or the planner refuses, the fallback is an equal split
in node-id order, so a home always has *some* plan and says why in ``reason``.
The cut table is seconds of work on a small device: :class:`PlanIssuer` builds
it on the leader, off the event loop, and the plan ships with it.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshd.log import get_logger
from meshd.model.profile_files import as_mode, prefer_mode, profile_model, read_profiles
from partition.ids import NodeId, PlanVersion
from partition.cuttable import CutTable
from partition.plan import DEFAULT_LINK, PLAN_MAX_SEQ, PLAN_SEQ_LEN, Plan
from partition.stages import StageAssignment
from partition.tensor_split import ATTENTIONS

__all__ = ["DEFAULT_LINK", "PLAN_MAX_SEQ", "PLAN_SEQ_LEN", "MemberInput", "PlanIssuer", "equal_split",
           "plan_home", "chunks_prompts", "home_cut_table", "stage_timings_over", "shipped_profiles_dir", "default_profile",
           "model_name", "other_model_reason", "plannable_members", "not_planned"]

log = get_logger("meshd.mesh.home_plan")


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
    return Path(__file__).resolve().parent.parent / "profiles"


_said_none_shipped: set[Path] = set()


def shipped_profiles() -> list[dict[str, Any]]:
    """The profiles shipped with meshd; an empty or missing folder is said once (an incomplete
    installation: members that shared no profile are then planned as equals)."""
    where = shipped_profiles_dir()
    found = [data for _, data in read_profiles(where)]
    if not found and where not in _said_none_shipped:
        _said_none_shipped.add(where)
        log.warning("shipped_profiles_missing", path=str(where),
                    consequence="members without a profile of their own get an equal share of the layers",
                    hint="reinstall meshd: its wheel ships meshd/profiles/*.json")
    return found


def default_profile(weights: str = "", model: str = "") -> dict[str, Any] | None:
    """The profile shipped with meshd for a member that shared none: one of ``model`` (its
    identity) when one is shipped — another model's layer times and layer count would make the
    planner refuse and the home fall back to an equal split — measured in the numeric mode
    ``weights`` if possible; else the first (by name) of that mode, else the first of any."""
    shipped = shipped_profiles()
    same_model = [data for data in shipped if model and profile_model(data) == model]
    return as_mode(prefer_mode(same_model or shipped, weights, lambda d: d), weights)


def _device_profiles(members: list[MemberInput], weights: str, model: str) -> list | None:
    """Each member's DeviceProfile under its node id and memory budget (the shipped one for a member
    that shared none); None when some member has neither. Raises on an unreadable profile."""
    from partition.profile import DeviceProfile

    fallback = default_profile(weights, model)
    out = []
    for m in members:
        data = m.profile or fallback
        if data is None:
            return None
        out.append(dataclasses.replace(DeviceProfile.from_dict(data), device_id=m.node_id,
                                       memory_budget_bytes=int(m.memory_budget_mb) * 2**20))
    return out


def plan_home(version: PlanVersion, leader: NodeId, members: list[MemberInput], num_layers: int,
              weights: str = "", model: str = "", layout: str = "pipeline", workload=None,
              current: Plan | None = None, tensor: bool = False,
              tensor_attentions: tuple[str, ...] = ATTENTIONS, link: str = DEFAULT_LINK) -> Plan:
    """The leader's plan over ``members``, without its cut table (:class:`PlanIssuer` adds that).

    ``layout`` "pipeline": ``partition.planner.make_plan`` (one pipeline); "auto"/"replicas":
    ``make_layout_plan`` priced for ``workload`` (a ``partition.layout.Workload``; None: a
    PLAN_SEQ_LEN-token request at a time), keeping ``current``'s routes unless another layout is
    clearly faster (``partition.planner.REPLAN_MARGIN``). Either needs every member's usable profile; else an
    equal split (one pipeline) that says why in ``reason``. ``tensor``: tensor-parallel groups are among
    the layouts "auto" prices (``layout`` "tensor" forces one), holding the attention as the cheaper of
    ``tensor_attentions`` has it. ``link``: the members' link the layouts are priced over (the cut table
    stays on ``DEFAULT_LINK``: members of an older leader compute the same one themselves).
    """
    from partition.link import parse_link
    from partition.planner import make_layout_plan, make_plan

    ids = tuple(sorted(m.node_id for m in members))
    planned = Plan(version, tuple(equal_split(list(ids), num_layers)), num_layers, None,
                   "equal split: no device profiles", leader, ids, weights, model)
    try:
        devs = _device_profiles(members, weights, model)
        if devs is None and not shipped_profiles():
            planned = dataclasses.replace(planned, reason="equal split: no device profiles, and none shipped "
                                                          "with this meshd (an incomplete installation)")
        if devs is not None:
            if devs[0].num_layers != num_layers:
                raise ValueError(f"profiles are for {devs[0].num_layers} layers, model has {num_layers}")
            if layout == "pipeline":
                best = make_plan(devs, parse_link(link), PLAN_MAX_SEQ, plan_seq_len=PLAN_SEQ_LEN,
                                 with_cut_table=False, version=version)
            else:
                best = make_layout_plan(devs, parse_link(link), PLAN_MAX_SEQ, workload=workload,
                                        layout=layout, plan_seq_len=PLAN_SEQ_LEN, with_cut_table=False,
                                        version=version, prefer=served_routes(current), tensor=tensor,
                                        tensor_attentions=tensor_attentions)
            if any(s.group for s in best.stages):  # a group adds float32 partial sums of the file's blocks
                weights = "gguf"
            planned = dataclasses.replace(best, leader=leader, members=ids, weights=weights, model=model)
    except Exception as exc:  # planner refused or profiles unusable: still have a plan
        log.warning("planner_fallback", error=str(exc))
        planned = dataclasses.replace(planned, reason=f"equal split: planner failed ({exc})")
    planned.check()
    return planned


def served_routes(plan: Plan | None):
    """``plan``'s routes as ``partition.layout.Layout.routes`` spells them (None: no plan, or a plan with a
    tensor group: its route would be priced as its first member alone, so none is preferred)."""
    if plan is None or any(s.group for s in plan.stages):
        return None
    return tuple(tuple((s.node_id, s.first, s.end) for s in r) for r in plan.routes)


def stage_timings_over(stages, profiles: dict[str, dict], num_layers: int, link_spec: str = DEFAULT_LINK):
    """The sequence planner's timing model of ``stages`` (anything with ``node_id``, ``first``, ``end``)
    from profiles as members share them (plain dicts by node id); None when a stage's member has no
    profile, or one of a model with another layer count."""
    from partition.link import parse_link
    from partition.planner import stage_timings
    from partition.profile import DeviceProfile

    devs = {}
    for s in stages:
        data = profiles.get(s.node_id)
        if data is None:
            return None
        p = DeviceProfile.from_dict(data)
        if p.num_layers != num_layers:
            return None
        devs[s.node_id] = p
    return stage_timings(tuple(StageAssignment(s.node_id, s.first, s.end) for s in stages), devs,
                         parse_link(link_spec))


def cut_table_over(stages, profiles: dict[str, dict], num_layers: int,
                   link_spec: str = DEFAULT_LINK) -> CutTable | None:
    """The cut table of ``stages`` for prompts up to ``PLAN_MAX_SEQ`` (None: profiles missing).

    The one recipe for leaders (which ship it) and for members whose leader runs a
    meshd that ships none (0.2): both must cut a prompt at the same points.
    """
    from partition.sequence import build_cut_table

    timings = stage_timings_over(stages, profiles, num_layers, link_spec)
    return None if timings is None else build_cut_table(timings, PLAN_MAX_SEQ)


def chunks_prompts(plan: Plan) -> bool:
    """Whether members cut prompts under ``plan``: it has stages to pipeline and a model to serve
    (a control-plane-only home, model "none", serves nothing)."""
    return len(plan.pipeline_route) > 1 and bool(plan.model)


def home_cut_table(plan: Plan, members: list[MemberInput]) -> CutTable | None:
    """``plan``'s cut table from the members' profiles (the shipped one for a member without);
    None when it chunks no prompts, or when profiles are missing."""
    if not chunks_prompts(plan):
        return None
    fallback = default_profile(plan.weights, plan.model)
    profiles = {m.node_id: m.profile or fallback for m in members if m.profile or fallback}
    return cut_table_over(plan.pipeline_route, profiles, plan.num_layers)


class PlanIssuer:
    """The leader's last step before a plan goes out: its cut table, built off the event loop.

    The table takes seconds on a small device and the leader's event loop must keep
    beating hearts meanwhile; before, every member built the same table itself. A
    plan that needs one is held until it is built, then handed to ``send`` (which
    adopts and broadcasts it); a newer plan issued meanwhile replaces it. A plan
    that needs none (one stage, no model served, a table already attached) is sent
    at once.
    """

    def __init__(self, send: Callable[[Plan], None]):
        self.send = send
        self.pending: Plan | None = None
        self._task: asyncio.Task | None = None

    def waiting_for(self, plan: Plan) -> bool:
        """Whether ``plan`` is the one being finished (deciding it again changes nothing)."""
        p = self.pending
        return p is not None and (p.version, p.digest(), p.weights, p.model, p.members, p.leader) == \
            (plan.version, plan.digest(), plan.weights, plan.model, plan.members, plan.leader)

    def issue(self, plan: Plan, members: list[MemberInput]) -> None:
        if self.waiting_for(plan):
            return
        self.withdraw()
        if plan.cut_table is not None or not chunks_prompts(plan):
            self.send(plan)
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # a caller outside any event loop (a script, a test): nothing to keep beating
            table = home_cut_table(plan, members)
            self.send(dataclasses.replace(plan, cut_table=table) if table is not None else plan)
            return
        self.pending = plan
        self._task = loop.create_task(self._finish(plan, list(members)))

    async def _finish(self, plan: Plan, members: list[MemberInput]) -> None:
        try:
            table = await asyncio.to_thread(home_cut_table, plan, members)
        except Exception as exc:  # noqa: BLE001 - chunking help is optional: members compute their own
            log.warning("cut_table_failed", plan_version=plan.version, error=str(exc))
            table = None
        if self.pending is not plan:
            return  # a newer plan replaced it meanwhile
        self.pending, self._task = None, None
        try:
            self.send(dataclasses.replace(plan, cut_table=table) if table is not None else plan)
        except Exception:  # noqa: BLE001 - the next re-plan tries again; the task must not die unread
            log.exception("plan_send_failed", plan_version=plan.version)

    def withdraw(self) -> None:
        """Drop the plan being finished, if any (its thread runs out; its result is not sent)."""
        if self._task is not None:
            self._task.cancel()
        self.pending, self._task = None, None


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
