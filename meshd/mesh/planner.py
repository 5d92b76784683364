"""The leader's planning, plan adoption, and two plans under one version.

Every member runs one; only the leader (the lowest ready node id) makes plans, the
others adopt what it sends, in version order. This module is the control plane's one
caller of ``meshd.mesh.home_plan``: what a plan is and how one is made live there.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

from meshd.config import Config
from meshd.log import get_logger
from meshd.mesh.caps import Cap
from meshd.mesh.membership import Debouncer
from meshd.mesh.view import MeshView
from meshd.mesh.home_plan import MemberInput, PlanIssuer, model_name, not_planned, plan_home, plannable_members
from partition.ids import NodeId, PlanVersion
from partition.plan import Plan
from partition.tensor_split import ATTENTIONS
from transport.messages import PlanUpdate

log = get_logger("meshd.planner")

WORKLOAD_CHECK_S = 30.0  # how often the leader looks whether the home's workload moved
# after a re-plan for the workload, the next waits this long: a faster layout lowers the requests in
# flight it was chosen for (Little's law), which must not swing the home back at once
WORKLOAD_HOLD_S = 300.0


def moved(before, now) -> bool:
    """Whether the workload changed enough since ``before`` (None: the default) to price layouts again."""
    if before is None:
        return True
    ratio = lambda a, b: max(a, b) / max(1e-9, min(a, b))  # noqa: E731
    return (ratio(before.in_flight, now.in_flight) >= 1.5 or ratio(before.prompt_tokens, now.prompt_tokens) >= 1.5
            or ratio(max(1, before.answer_tokens), max(1, now.answer_tokens)) >= 1.5
            or abs(before.cached_fraction - now.cached_fraction) >= 0.2)


PROFILE_WAIT_S = 5.0  # how long a plan waits for a joining member's profile (asked for on its first heartbeat)


def plan_from_update(msg: PlanUpdate) -> Plan:
    """The plan a ``PlanUpdate`` carries (ValueError if it is malformed)."""
    return Plan.from_assignment(msg.plan_version, msg.assignment)


def plan_update(plan: Plan) -> PlanUpdate:
    return PlanUpdate(plan.version, plan.to_assignment())


def weights_mode_of(config: Config) -> str:
    """The numeric mode this daemon's plans name when it leads: its own (``--weights``)."""
    from meshd.config import placement_of

    if not config.model_enabled:
        return ""
    try:
        return placement_of(config).mode
    except Exception:  # noqa: BLE001 - a device this machine lacks fails at start-up, loudly, elsewhere
        return ""


class Planner:
    """``link``: sends and broadcasts control messages; ``sharing`` (optional, ``meshd.share``):
    its ``gate`` holds a plan back while members fetch the layers it gives them."""

    def __init__(self, config: Config, view: MeshView, link, debounce: Debouncer,
                 clock: Callable[[], float], say_status: Callable[[str], None] = lambda text: None):
        self.config = config
        self.view = view
        self.link = link
        self.debounce = debounce
        self.clock = clock
        self.say_status = say_status  # sd_notify STATUS=
        self.sharing = None
        self.replans = 0
        self.conflict = False  # a member serves another plan under our version: re-plan above it
        self.excluded: dict[NodeId, str] = {}  # ready members the last plan left out, and why
        self.listeners: list[Callable[[Plan], Any]] = []
        self._warned_model = ""  # the home model this device was last warned it does not hold
        self.issuer = PlanIssuer(self._send)  # the leader's plans leave with their cut table
        self._profile_wait: dict[NodeId, tuple[str, float]] = {}  # member -> (digest, when a plan first waited)
        self._said_old: list[NodeId] = []
        self._planned_for = None  # the workload the last plan was priced for (None: the default)
        self._workload_checked = 0.0
        self._workload_poked = -WORKLOAD_HOLD_S
        self.observe_workload: Callable[[], Any] | None = None  # the home's workload (None: the default)

    @property
    def plan(self) -> Plan | None:
        return self.view.plan

    @property
    def weights_mode(self) -> str:
        """Read from the config each time: ``--weights auto`` becomes the measured mode once the model
        is open (``meshd.model.host``), and plans from then on name it."""
        return weights_mode_of(self.config)

    def poke(self) -> None:
        """Something a plan depends on changed: re-plan once the debounce settles."""
        self.debounce.poke(self.clock())

    def maybe_replan(self) -> None:
        view = self.view
        node_id = view.node_id
        if view.leader() != node_id:
            return  # the coordinator (lowest ready node id) plans; we wait for its PlanUpdate
        all_ready = view.ready_ids()
        ready, model, num_layers, excluded = self._plannable(all_ready)
        if excluded != self.excluded:
            log.info("members_not_planned", excluded=excluded)
        self.excluded = excluded
        if not ready:
            log.info("replan_waiting", reason="no member has a model loaded yet", excluded=excluded)
            return
        awaited = self.profiles_awaited(ready)
        if awaited:  # planning now would guess their speed, then re-plan (and reload) when it arrives
            log.info("replan_waiting", reason="profiles on their way", members=awaited)
            self.poke()
            return
        seen = [int(view.membership.peers[n].info.get("plan_version", 0))
                for n in all_ready if n in view.membership.peers]
        current = view.plan
        version = max([current.version if current else 0, *seen]) + 1
        layout = self.layout_for(ready)
        # tensor groups among the layouts "auto" prices: members that all take a seat, in the gguf mode
        tensor = layout == "tensor" or (layout == "auto" and self.weights_mode == "gguf"
                                        and all(Cap.TENSOR_GROUPS in self.view.caps_of(n) for n in ready))
        # the attention held whole only where every member knows to (else a member would split it)
        attentions = (ATTENTIONS if all(Cap.TENSOR_WHOLE_ATTENTION in self.view.caps_of(n) for n in ready)
                      else ("split",))
        plan_over = lambda ids: plan_home(version, node_id, self._plan_inputs(ids), num_layers,  # noqa: E731
                                          self.weights_mode, model, layout, self.workload(), current, tensor,
                                          attentions, self.config.link)
        plan = plan_over(ready)
        if self.sharing is not None:  # a plan waits for members still fetching its layers (meshd.share.gate)
            plan = self.sharing.gate(plan, current, ready, model, plan_over)
            if plan is None and self.conflict and current is not None:
                # Our plan goes on serving while members fetch, but not under a version
                # another plan holds too: re-issue it above both.
                plan = dataclasses.replace(current, version=PlanVersion(version), leader=NodeId(node_id))
            if plan is None:
                self.issuer.withdraw()  # the current plan serves on: one still being finished is moot
                return
        if self.issuer.waiting_for(plan):
            return  # decided already: it goes out once its cut table is built
        self.issuer.withdraw()  # any other decision replaces one still being finished
        cur = current
        if cur is not None and cur.digest() == plan.digest() and cur.weights == plan.weights \
                and cur.model == plan.model and cur.members == plan.members and cur.leader == node_id \
                and version <= cur.version + 1 and not self.conflict:
            # Same assignment, mode, model and members: keep the version, so requests running on it
            # are not failed as stale and no stage reloads anything. (A member joining that the
            # planner leaves out still makes a new plan: status lists whom a plan was made over.)
            log.debug("replan_unchanged", version=cur.version)
            return
        self.replans += 1
        log.info("replan", version=version, members=ready, model=model, reason=plan.reason,
                 stages=[[s.node_id, s.first, s.end] for s in plan.stages])
        self.issuer.issue(plan, self._plan_inputs(list(plan.members)))

    def layout_for(self, ready: list[NodeId]) -> str:
        """The layout this leader plans: the configured one, but one pipeline while a member runs a
        meshd that follows only one (it would refuse a plan of several routes)."""
        wanted = str(getattr(self.config, "layout", "pipeline") or "pipeline")
        if wanted == "pipeline":
            return wanted
        old = [n for n in ready if Cap.LAYOUTS not in self.view.caps_of(n)
               or (wanted == "tensor" and Cap.TENSOR_GROUPS not in self.view.caps_of(n))]
        if old:
            if old != self._said_old:
                log.info("layout_pipeline_only", members=old, wanted=wanted,
                         reason="these members follow one pipeline only (an older meshd)")
            self._said_old = old
            return "pipeline"
        return wanted

    def workload(self):
        """What the home's coordinators observe (``meshd.pipeline.coordinator.workload``), priced by the layout
        planner."""
        work = self.observe_workload() if self.observe_workload is not None else None
        self._planned_for = work
        return work

    def check_workload(self) -> None:
        """The leader of an "auto" home re-plans when the workload moved a lot since its plan (the
        planner then keeps the served routes unless another layout is clearly faster); it looks at
        most once per WORKLOAD_CHECK_S, and after such a re-plan not again for WORKLOAD_HOLD_S."""
        now = self.clock()
        if now - self._workload_checked < WORKLOAD_CHECK_S or self.observe_workload is None \
                or now - self._workload_poked < WORKLOAD_HOLD_S:
            return
        self._workload_checked = now
        if self.view.leader() != self.view.node_id or self.plan is None or \
                str(getattr(self.config, "layout", "pipeline")) == "pipeline":
            return
        work = self.observe_workload()
        if work is not None and moved(self._planned_for, work):
            log.info("workload_moved", planned_for=str(self._planned_for), now=str(work))
            self._workload_poked = now
            self.poke()

    def _send(self, plan: Plan) -> None:
        """Adopt and broadcast a plan this leader decided, unless leadership or a newer plan came first
        while its cut table was being built."""
        current = self.view.plan
        if self.view.leader() != self.view.node_id or (current is not None and plan.version <= current.version):
            self.poke()
            return
        self.adopt(plan)
        self.link.broadcast(plan_update(plan), [n for n in self.view.ready_ids() if n != self.view.node_id])

    def withdraw(self) -> None:
        """Stopping: a plan still being finished never goes out."""
        self.issuer.withdraw()

    def profiles_awaited(self, ids: list[NodeId]) -> list[NodeId]:
        """Joining members whose heartbeat announced a profile this device has not received yet
        (asked for on that heartbeat), each profile waited for at most ``PROFILE_WAIT_S``: then the
        plan guesses. Members of the current plan are never waited for: a re-plan after a loss or
        a conflict must not be delayed, and their new profile re-plans when it arrives."""
        now, waiting, current = self.clock(), [], self.view.plan
        planned = set(current.members) if current is not None else set()
        waits: dict[NodeId, tuple[str, float]] = {}
        for nid in ids:
            announced = str(self.view.info_of(nid).get("profile_digest") or "") if nid != self.view.node_id else ""
            if not announced or nid in planned or self.view.profile_digests.get(nid) == announced:
                continue
            digest, since = self._profile_wait.get(nid, (announced, now))
            if digest != announced:  # a new profile (a restart, a re-measure): wait for this one
                since = now
            waits[nid] = (announced, since)
            if now - since < PROFILE_WAIT_S:
                waiting.append(nid)
        self._profile_wait = waits  # members that left or whose profile came drop out
        return waiting

    def _plan_inputs(self, ids: list[NodeId]) -> list[MemberInput]:
        inputs = []
        for nid in ids:
            budget = self.config.memory_budget_mb if nid == self.view.node_id else int(
                self.view.info_of(nid).get("memory_budget_mb", 0) or 0)
            inputs.append(MemberInput(nid, budget, self.view.profile_of(nid)))
        return inputs

    def _plannable(self, ready: list[NodeId]) -> tuple[list[NodeId], str, int, dict[NodeId, str]]:
        """The members a plan may use: model loaded, and the same model file as the home's.

        The home's model is the one most loaded members hold (ties: the one the current
        plan serves, then the lowest node id's; ``meshd.mesh.home_plan.plannable_members``), so a
        device with another file is listed with its reason instead of silently mixing
        layers of two models.
        """
        plan = self.view.plan
        members, model, layers, excluded = plannable_members(
            self.view.model_facts(ready), plan.model if plan is not None else "")
        return members, model, layers or self.config.plan_layers, excluded

    def not_planned(self) -> dict[NodeId, str]:
        """Why each ready member holds no layers of the current plan (on every member, not only
        the leader: ``meshd.mesh.home_plan.not_planned``)."""
        return not_planned(self.view.plan, self.view.model_facts(self.view.ready_ids()))

    # -- plans from the leader -----------------------------------------------------------
    def on_plan_update(self, msg: PlanUpdate, sender: NodeId) -> None:
        try:
            plan = plan_from_update(msg)
        except ValueError as exc:
            log.warning("plan_rejected", peer=sender, error=str(exc))
            return
        cur = self.view.plan
        # Strictly newer only: a stage checks the version alone, so two different plans
        # must never share one. (Two leaders of a briefly split home may both issue a
        # version; the lowest node id re-plans above both once the home is whole.)
        if cur is None or plan.version > cur.version:
            self.adopt(plan)
        elif plan.version == cur.version and plan.digest() != cur.digest():
            self.on_conflict(sender, plan.version, plan.leader)

    def on_peer_plan(self, sender: NodeId, version: int, digest: str) -> None:
        """A member's heartbeat names the plan it serves: send it ours if it lags, note a conflict."""
        cur = self.view.plan
        if cur is None:
            return
        if version < cur.version:
            self.link.send(sender, plan_update(cur))
        elif version == cur.version and digest and digest != cur.digest():
            self.on_conflict(sender, version)

    def on_conflict(self, peer: NodeId, version: int, their_leader: str = "") -> None:
        """Two plans share one version (two members each led a view of the home for a moment).

        Only the leader can settle it, and its own plan may look unchanged to it, so it
        re-plans under a new version even then; members that are not the leader wait for
        that (the leader sees the conflict in their heartbeats). Logged once per version.
        """
        if not self.conflict:
            log.warning("plan_version_conflict", version=version, peer=peer, leader=their_leader or None,
                        ours=self.view.plan.digest() if self.view.plan else None, settles=self.view.leader())
        self.conflict = True
        self.poke()

    def adopt(self, plan: Plan) -> None:
        self.view.plan = plan
        self.conflict = False  # a newer version settles any conflict under the old one
        layers = plan.layers_of(self.view.node_id)
        log.info("plan_adopted", version=plan.version, leader=plan.leader,
                 layers=list(layers) if layers else None)
        home = self.view.home
        self.say_status(f"home {home.name if home else '?'}: {len(self.view.ready_ids())} member(s) ready, "
                        f"plan v{plan.version}, layers {list(layers) if layers else 'none'} here")
        self.check_home_model()
        for listener in self.listeners:  # the serving role redeploys layer ranges here
            try:
                listener(plan)
            except Exception:
                log.exception("plan_listener_failed")

    # -- a device holding another model than its home --------------------------------------
    def check_home_model(self) -> None:
        """Say at once, once per home model, when this device holds another model than its home serves.

        The home's model is the current plan's (else the one most ready members hold).
        While this device's model still loads, its file name already tells a different
        model apart (an identity is "file name@sha256 prefix"), so ``meshd join`` warns as
        soon as the first plan arrives, not after seconds of loading. Such a device serves
        no layers and refuses requests (``meshd.pipeline``); the warning says what to change.
        """
        local = self.view.local
        own = local.model_identity()[0] if local.load_state == "loaded" else ""
        name = own.rpartition("@")[0] if own else self._configured_model_file
        if not name:
            return
        plan = self.view.plan
        home = plan.model if plan is not None and plan.model else plannable_members(
            self.view.model_facts(self.view.ready_ids()))[1]
        differs = home != own if own else home.rpartition("@")[0] not in ("", name)
        if not home or not differs or self._warned_model == home:
            return
        self._warned_model = home
        from meshd.model.store import model_flag_for

        log.warning("model_differs_from_home", holds=own or name, home_serves=home,
                    hint=f"every member of a home holds the same model: restart this device "
                         f"{model_flag_for(home)} (or move most of the home to {model_name(name)}); "
                         f"until then it serves no layers and refuses requests")

    @functools.cached_property
    def _configured_model_file(self) -> str:
        """The file name of the model this daemon opens ("" when none, or not on this device yet)."""
        if not self.config.model_enabled or self.config.engine:
            return ""
        from meshd.model.store import resolve_model

        try:
            return resolve_model(self.config.model or None).name
        except Exception:  # noqa: BLE001 - not here (fetched from the home, or missing): the load says so
            return ""
