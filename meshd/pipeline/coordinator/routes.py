"""Which route a request takes: the current plan's routes as one coordinator sees them.

A plan has one route (a pipeline) or several (whole-model replicas, a pipeline
group: ``partition.layout``). The leader's layout decides which routes exist for
the home's workload; this table follows the plans the serving role adopts, probes
each route's stages before its first use (after a re-plan they may still be
loading layers), and picks a route per request from what the coordinator sees
live: how many of its requests each route is running, and how much of this
prompt each route's stages already hold in their prefix caches (a conversation's
next turn belongs where its prompt is cached). A cold prompt counts as one more
request waiting on a route, shrunk by the route's stage count (a pipeline
prefills it that much faster); ties go to the route with fewer stages (fewer hops
per token), then the lower number. Requests that continue a kept prefix (outline
children) go where that prefix lives. A request waits here (bounded) through
re-plans until a route serves it; its loop itself stays in the coordinator.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from meshd.log import get_logger
from meshd.pipeline.coordinator.failures import Interrupted, ModelMismatch, NoRoute
from meshd.pipeline.coordinator.prefix_reuse import MIN_REUSE, MIN_SHARED, RANKING_WAIT_S, PrefixReuse, common_prefix
from meshd.pipeline.coordinator.slot import RequestSlot
from meshd.pipeline.links import Links
from meshd.pipeline.route import Route, model_mismatch
from partition.ids import NodeId
from transport.errors import TransportError
from transport.messages import Hello

log = get_logger("meshd.coordinator")


@dataclass(frozen=True)
class RouteLoad:
    """What a coordinator knows about one route when a request arrives."""

    route: Route
    running: int  # this coordinator's requests on it now
    held: int = 0  # positions of this prompt every stage of it holds (prefix cache)


def route_score(load: RouteLoad, prompt_len: int) -> tuple[float, int, int]:
    """Lower is better: requests ahead plus the prompt's uncached share (per stage), then stages, then number."""
    uncached = (prompt_len - min(load.held, prompt_len)) / max(1, prompt_len)
    stages = max(1, len(load.route.stages))
    return (load.running + uncached / stages, stages, load.route.index)


def pick_route(loads: list[RouteLoad], prompt_len: int) -> Route:
    """The route a request takes: one whose stages hold (within ``MIN_SHARED`` tokens) the longest prefix of
    its prompt, when any holds a useful one; load decides among those, and among all when none does.

    A conversation's next request belongs where its prompt is: prefilling the difference elsewhere costs
    seconds a token-per-token wait behind another request does not (a Home Assistant tool round sends its
    second request while its first is still winding down on its route, whose count then says "busy").
    Load still wins when the holders run more than one request more than the idlest route."""
    best = max(load.held for load in loads)
    if best >= MIN_REUSE:
        holders = [load for load in loads if load.held >= best - MIN_SHARED]
        # ... unless the holders are busier by more than one request than the idlest route: then a shared
        # system prompt would pin every conversation to one replica, and the other would never warm up
        if min(load.running for load in holders) <= min(load.running for load in loads) + 1:
            loads = holders
    return min(loads, key=lambda load: route_score(load, prompt_len)).route


class RecentRequests:
    """The last requests this coordinator ran, by route: where a conversation's previous request left its
    prompt and answer. A stage that cannot answer a ranking probe in time (a busy one-core device) would
    otherwise look empty, and the next turn would go to a replica that holds none of it."""

    def __init__(self, capacity: int = 16):
        self.capacity = capacity
        self._slots: dict[str, tuple[tuple[int, int], RequestSlot]] = {}

    def note(self, route: Route, slot: RequestSlot) -> None:
        self._slots.pop(str(slot.request_id), None)
        self._slots[str(slot.request_id)] = (route.key, slot)
        while len(self._slots) > self.capacity:
            self._slots.pop(next(iter(self._slots)))

    def held(self, route: Route, ids: Sequence[int], asking: RequestSlot | None = None) -> int:
        """The longest prefix of ``ids`` a recent request on ``route`` had (a hint: its stages may have
        evicted it since; the request's own probe then says how much it really reuses). ``asking``'s own
        entry never counts: a replay must not be drawn back to the route that just lost it."""
        n = max((common_prefix(slot.context, ids) for key, slot in self._slots.values()
                 if key == route.key and slot is not asking), default=0)
        return min(n, max(0, len(ids) - 1))


class RouteCounts:
    """Requests this coordinator runs on each route (taken when one is picked, so a burst spreads)."""

    def __init__(self) -> None:
        self._running: Counter = Counter()

    def take(self, route: Route) -> None:
        self._running[route.key] += 1

    def give(self, route: Route) -> None:
        self._running[route.key] -= 1
        if self._running[route.key] <= 0:
            del self._running[route.key]

    def running(self, route: Route) -> int:
        return self._running.get(route.key, 0)

    def to_dict(self) -> dict[str, int]:
        return {f"{v}/{i}": n for (v, i), n in sorted(self._running.items())}


class RouteTable:
    def __init__(self, node_id: NodeId, links: Links, prefixes: PrefixReuse):
        self.node_id = node_id
        self.links = links
        self.prefixes = prefixes
        self.routes: tuple[Route, ...] = ()
        self.counts = RouteCounts()  # this coordinator's requests on each route
        self.recent = RecentRequests()  # where the last requests left their prompts (a hint for the next turn)
        self.waiting_on: str | None = None  # the stage a readiness probe waits for (named in errors)
        self._ready: set[tuple[int, int]] = set()  # routes whose stages all serve their plan
        self._exits: dict[tuple[int, int], int] = {}  # route -> exit layers its last stage checks (when ready)
        self._changed = asyncio.Event()
        self.closed = False  # the coordinator is closing: no request waits for a route any more

    @property
    def first(self) -> Route | None:
        return self.routes[0] if self.routes else None

    def set(self, routes: tuple[Route, ...]) -> bool:
        """Follow a new plan's routes (() while one deploys); True when the plan version changed."""
        old = self.first
        self.routes = tuple(routes)
        new = self.first
        moved = new is None or old is None or new.plan_version != old.plan_version
        if moved:
            self._ready.clear()
        self._changed.set()
        self._changed = asyncio.Event()
        return moved

    def probe_again(self, route: Route | None = None) -> None:
        """Ask ``route``'s stages (every route's: None) whether they serve before the next use."""
        if route is None:
            self._ready.clear()
        else:
            self._ready.discard(route.key)

    def close(self) -> None:
        """The coordinator is closing: wake every request waiting for a plan, and let none wait again."""
        self.closed = True
        self._changed.set()

    async def changed(self, timeout_s: float) -> None:
        """Return when the routes change, or after ``timeout_s``."""
        changed = self._changed
        try:  # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancel (a hang-up)
            async with asyncio.timeout(timeout_s):
                await changed.wait()
        except TimeoutError:
            pass

    async def wait_ready(self, route: Route, timeout_s: float = 120.0, poll_s: float = 0.1) -> None:
        """Wait until every stage of ``route`` has loaded its layers for that plan version.

        After a re-plan, stages may still be loading weights; a request arriving
        then waits (bounded) instead of failing on a half-deployed pipeline.
        """
        if route.key in self._ready:
            return
        async with asyncio.timeout(timeout_s):
            for st in route.stages:
                self.waiting_on = st.node_id
                while True:
                    if route not in self.routes:  # re-planned (e.g. a stage's device left): stop waiting
                        raise Interrupted(f"the mesh re-planned while plan {route.plan_version} loaded")
                    try:
                        peer = await self.links.to(st.node_id)
                        reply = await peer.request(Hello(self.node_id, route.plan_version, ""), timeout=2.0)
                        if reply.plan_version == route.plan_version:
                            if st is route.stages[-1]:
                                self._exits[route.key] = int(reply.exits)
                            break
                        if not reply.accepted and reply.reason:  # it holds another model: it never will
                            raise ModelMismatch(f"stage {st.node_id} {reply.reason}")
                    except (TransportError, KeyError) as exc:
                        log.debug("stage_not_ready", node=st.node_id, error=str(exc))
                    await asyncio.sleep(poll_s)
        self._ready.add(route.key)
        self.waiting_on = None
        log.info("pipeline_ready", plan_version=route.plan_version, route=route.index,
                 stages=[s.node_id for s in route.stages])

    def exits_on(self, route: Route) -> bool:
        """Whether ``route``'s last stage checks early exits (a stage on an older meshd never says so, and
        never gets a message that asks for them)."""
        return self._exits.get(route.key, 0) > 0

    def exits_available(self) -> bool | None:
        """Whether a route known to serve checks early exits (None: none is known to serve yet)."""
        ready = [r for r in self.routes if r.key in self._ready]
        return any(self.exits_on(r) for r in ready) if ready else None

    async def serving(self, timeout_s: float, model: str, slot: RequestSlot | None = None) -> Route:
        """A current route (the one ``slot`` takes, :meth:`pick`) once all its stages serve it; waits
        (bounded) through re-plans. ``model``: the model file this device holds (a plan for another is
        refused at once). With a ``slot``, the route is counted as running it from the moment it is
        picked (so a burst spreads over the routes): ``counts.give`` it back."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or self.closed:
                why = (f"device {self.waiting_on} of plan {self.first.plan_version} did not answer"
                       if self.waiting_on and self.first is not None
                       else "devices still joining, loading layers or re-planning")
                raise NoRoute(f"no pipeline plan could serve within {timeout_s:g}s ({why}); retry")
            route = await self.pick(slot)
            mismatch = model_mismatch(route.model, model) if route is not None else ""
            if mismatch:
                from meshd.model.store import model_flag_for

                raise ModelMismatch(f"this device {mismatch}, so it answers no requests: restart it "
                                    f"{model_flag_for(route.model)} (every member of a home holds the same "
                                    f"model) or send requests to another member")
            if route is None or not route.stages:
                await self.changed(left)
                continue
            if slot is not None:
                self.counts.take(route)
            try:
                await self.wait_ready(route, timeout_s=left)
                return route
            except (Interrupted, TimeoutError):
                if slot is not None:
                    self.counts.give(route)
                continue
            except BaseException:
                if slot is not None:
                    self.counts.give(route)
                raise

    async def pick(self, slot: RequestSlot | None) -> Route | None:
        """The route ``slot``'s request takes among the current ones (None: no plan serves)."""
        routes = self.routes
        if len(routes) <= 1 or slot is None:
            return self.first
        fork = slot.request.fork
        if fork is not None and fork.route in routes:
            return fork.route  # a child reads its parent's positions in place
        ids = slot.request.prompt_ids  # what an attempt reuses (a replay's answer tokens are prefilled again)
        held = await asyncio.gather(*(self.prefixes.reusable(r, ids, count=False, wait_s=RANKING_WAIT_S)
                                      for r in routes)) \
            if self.prefixes.enabled and slot.reuse else [(0, False)] * len(routes)
        hinted = self.prefixes.enabled and slot.reuse
        loads = [RouteLoad(r, self.counts.running(r), max(h, self.recent.held(r, ids, slot) if hinted else 0))
                 for r, (h, _) in zip(routes, held) if r in self.routes]
        if not loads:  # re-planned during the probes
            return self.first
        # Routes known to serve first (one still loading, or whose stage failed to deploy, would hold
        # the request for its whole wait), and not through a device that just failed this request.
        for keep in (lambda load: load.route.key in self._ready,
                     lambda load: slot.avoid is None or load.route.index_of(slot.avoid) is None):
            loads = [load for load in loads if keep(load)] or loads
        route = pick_route(loads, len(slot.context))
        log.debug("route_picked", request_id=slot.request_id, route=route.index,
                  loads=[(load.route.index, load.running, load.held) for load in loads])
        return route
