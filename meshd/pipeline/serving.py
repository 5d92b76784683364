"""This device's part of the mesh: its stage, its coordinator, its plans.

The model host (``meshd.model.host``) owns one ``ServingRole``. It serves this device's pipeline stage for
every coordinator in the home, runs the coordinator for requests that arrive
here, and follows the home's plans: adopting them in version order only,
loading the new layer range, building the plan's cut table, and sending a tiny
warm-up request through every stage (links, CURVE handshakes, first forwards),
so the first real answer does not pay for them. The API's engine
(``meshd.pipeline.engine.PipelineEngine``) only borrows the coordinator and the
cut points; nothing here knows about HTTP.
"""

from __future__ import annotations

import asyncio

from decoding.device import PACKINGS
from decoding.sampling import SamplingSpec
from meshd.log import get_logger
from meshd.pipeline.coordinator.cuts import prompt_cuts
from meshd.pipeline.coordinator.service import PipelineCoordinator
from meshd.pipeline.coordinator.slot import StepsRequest
from meshd.pipeline.route import Route, model_mismatch
from meshd.mesh.caps import PeerCaps
from meshd.mesh.home_plan import cut_table_over, stage_timings_over
from partition.plan import Plan
from partition.ids import NodeId

log = get_logger("meshd.serving")


class MeshDirectory:
    """Node id → (stage endpoint, CURVE key), from the control plane's view of the home.

    Peers announce their stage port in heartbeats; their address is the one mDNS
    resolved. Looked up on every use, so a member that restarts on a new port or
    address is followed at once. A member whose endpoint is not known yet gives
    an empty address (its key is still known: enough to answer its requests).
    """

    def __init__(self, view, listen: str):
        self.view = view  # meshd.mesh.view.MeshView
        self.listen = listen
        self.own_port = 0  # where this device's stage listens (start_serving sets it)
        self.own_group_port = 0  # where it takes a tensor group's links

    def own_host(self) -> str:
        if self.listen not in ("0.0.0.0", "", "::"):
            return self.listen
        for iface in self.view.interfaces:
            if iface.addresses:
                return iface.addresses[0]
        return "127.0.0.1"

    def __call__(self, node_id: NodeId) -> tuple[str, str]:
        view = self.view
        if node_id == view.node_id:
            return f"tcp://{self.own_host()}:{self.own_port}", view.local.public_key
        member = view.members.get(node_id)
        if member is None:
            raise KeyError(f"{node_id} is not a member of this home")
        port = int(view.info_of(node_id).get("stage_port") or 0)
        if node_id not in view.addresses or not port:
            return "", member.public_key
        return f"tcp://{view.addresses[node_id][0]}:{port}", member.public_key

    def group_seat(self, node_id: NodeId):
        """Where ``node_id`` takes a tensor group's links, and its key (``meshd.pipeline.route.GroupSeat``)."""
        from meshd.pipeline.route import GroupSeat

        view = self.view
        if node_id == view.node_id:
            return GroupSeat(node_id, f"tcp://{self.own_host()}:{self.own_group_port}", view.local.public_key)
        member = view.members.get(node_id)
        key = member.public_key if member is not None else ""
        port = int(view.info_of(node_id).get("group_port") or 0) if member is not None else 0
        if node_id not in view.addresses or not port:
            return GroupSeat(node_id, "", key)
        return GroupSeat(node_id, f"tcp://{view.addresses[node_id][0]}:{port}", key)

    def caps_of(self, node_id: NodeId) -> PeerCaps:
        """What ``node_id``'s daemon decodes, as its heartbeats announce it (``meshd.mesh.caps``)."""
        return self.view.caps_of(node_id)


def routes_from_plan(plan: Plan, directory) -> tuple[Route, ...]:
    """Each of the plan's routes (same ``[first, end)`` ranges), with each node's address and key."""
    from meshd.pipeline.route import StageEndpoint

    routes = []
    for stages in plan.routes:
        endpoints = []
        for s in stages:
            try:
                address, key = directory(s.node_id)
            except KeyError:
                address, key = "", ""
            group = tuple(_seat(directory, n) for n in s.group)
            endpoints.append(StageEndpoint(s.node_id, address, key, s.first, s.end, group, s.group_speeds,
                                           s.group_attention))
        routes.append(Route(plan.version, tuple(endpoints), getattr(plan, "weights", "") or "",
                            getattr(plan, "model", "") or "", stages[0].route))
    return tuple(routes)


def free_port(host: str) -> int:
    """A port nothing listens on now (the group socket binds it when a plan seats this device)."""
    import socket

    with socket.socket() as s:
        s.bind((host if host not in ("", "::") else "0.0.0.0", 0))
        return s.getsockname()[1]


def _seat(directory, node_id):
    from meshd.pipeline.route import GroupSeat

    seat = getattr(directory, "group_seat", None)
    try:
        return seat(node_id) if seat is not None else GroupSeat(node_id, "", "")
    except KeyError:
        return GroupSeat(node_id, "", "")


def route_from_plan(plan: Plan, directory) -> Route:
    """The plan's first route (its only one, for a plan of one pipeline); see :func:`routes_from_plan`."""
    return routes_from_plan(plan, directory)[0]


def own_route(routes: tuple[Route, ...], node_id: NodeId) -> Route:
    """The route this node's stage belongs to, or whose tensor group it is in (the first when it holds no
    layers)."""
    return next((r for r in routes if r.index_of(node_id) is not None or r.group_seat(node_id) is not None),
                routes[0])


def cut_table_for(route: Route, profiles: dict[str, dict], num_layers: int, link_spec: str):
    """The sequence partitioner's cut table for this route's stages (None if profiles are missing).

    Members build it only for a plan that arrives without one (its leader runs meshd 0.2);
    the same recipe as the leader's (``meshd.mesh.home_plan.cut_table_over``), so both cut alike.
    """
    return cut_table_over(route.stages, profiles, num_layers, link_spec)


def verify_cost_slope(route: Route, profiles: dict[str, dict], num_layers: int, link_spec: str) -> float | None:
    """The profiles' estimate of what an extra token in a speculative verify round costs on this route."""
    from partition.sequence import round_cost_slope

    timings = stage_timings_over(route.stages, profiles, num_layers, link_spec)
    return None if timings is None else round_cost_slope(timings)


class ServingRole:
    """Stage + coordinator + plan adoption for one device.

    Prompts are cut where the sequence partitioner says, from a cut table built for
    each plan from the members' profiles (the shipped profile for members that have
    none); without usable profiles they fall back to equal chunks. Short prompts are
    never cut.
    """

    def __init__(self, source, coordinator: PipelineCoordinator, stage, directory, profiles_for=None,
                 link_spec: str = "", wait_s: float = 45.0):
        self.source = source
        self.coordinator = coordinator
        self.stage = stage
        self.directory = directory
        self.profiles_for = profiles_for
        self.link_spec = link_spec
        self.wait_s = wait_s
        self._cut_tables: dict[int, object] = {}
        self._deployed = 0
        self._adopt_lock = asyncio.Lock()
        self._tasks: set[asyncio.Task] = set()
        self.cut_table_errors = 0
        self._said_built_locally = False  # "this plan carries no cut table" is said once
        self.warm = asyncio.Event()  # set once a plan has served a warm-up request end to end
        self.warm_version = 0
        self.model_mismatch = ""  # why this device cannot serve the current plan's model ("": it can)

    @property
    def stage_port(self) -> int:
        """The port this device's stage listens on (its heartbeats announce it)."""
        return self.directory.own_port

    @property
    def group_port(self) -> int:
        """The port this device takes a tensor group's links on (its heartbeats announce it)."""
        return self.directory.own_group_port

    def follow(self, plan) -> None:
        """A plan listener: adopt ``plan`` in the background (in order, see :meth:`adopt`)."""
        t = asyncio.get_running_loop().create_task(self.adopt(plan))
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def adopt(self, plan) -> None:
        async with self._adopt_lock:  # in order: a late, older plan must never replace a newer one
            if plan.version <= self._deployed:
                log.info("plan_not_newer", plan_version=plan.version, deployed=self._deployed)
                return
            routes = routes_from_plan(plan, self.directory)
            route = own_route(routes, getattr(self.stage, "node_id", None))
            self.model_mismatch = model_mismatch(route.model, str(getattr(self.source, "identity", "") or ""))
            if self.model_mismatch:
                # (the daemon's model_differs_from_home warning says what to do about it)
                log.info("plan_for_another_model", plan_version=route.plan_version, error=self.model_mismatch)
            # Requests running on the old plan pause now (they replay on this one once it
            # serves), rather than keep a vanished device's stage in their path.
            self.coordinator.set_route(None)
            pipeline = next((r for r in routes if len(r.stages) > 1), None)
            if pipeline is not None:
                await self._plan_cut_table(plan, pipeline)
            try:
                await self.stage.deploy(route)
            except Exception:  # a bad plan must not kill the daemon; the next plan may fix it
                log.exception("stage_deploy_failed", plan_version=route.plan_version)
                return
            self._deployed = route.plan_version
            self.coordinator.set_routes(routes)
        if not self.model_mismatch:  # (requests here are refused at once: nothing to warm)
            await self.warm_up(routes)

    async def _plan_cut_table(self, plan: Plan, route: Route) -> None:
        """Use the cut table the leader shipped; build one here only for a plan that carries none."""
        table = plan.cut_table
        try:
            profiles = self.profiles_for() if self.profiles_for is not None else None
            if table is None and profiles is not None:
                if not self._said_built_locally:
                    self._said_built_locally = True
                    log.info("cut_table_built_here", plan_version=route.plan_version, leader=plan.leader,
                             reason="the plan carries no cut table (its leader runs meshd 0.2, or could not build one)")
                table = await asyncio.to_thread(cut_table_for, route, profiles, self.source.config.num_layers,
                                                self.link_spec)
            if table is not None:
                self._cut_tables = {route.key: table}
            slope = None if profiles is None else verify_cost_slope(
                route, profiles, self.source.config.num_layers, self.link_spec)
            if slope is not None:
                self.coordinator.round_cost.prior(slope)
        except Exception as exc:  # planning help is optional: equal chunks still work
            self.cut_table_errors += 1
            log.warning("cut_table_failed", plan_version=route.plan_version, error=str(exc))

    async def warm_up(self, routes: tuple[Route, ...] | Route) -> None:
        """One tiny greedy request through every stage of every route (best effort), at once: the
        coordinator spreads simultaneous requests over the routes (``meshd.pipeline.coordinator.routes``)."""
        routes = (routes,) if isinstance(routes, Route) else tuple(routes)
        route = routes[0]
        ids = list(self.source.tokenizer.encode("Hello"))[:4] or [0]

        async def one(k: int) -> None:
            async for _ in self.coordinator.steps(StepsRequest(f"warmup-{route.plan_version}-{k}-{id(self)}", ids,
                                                               2, SamplingSpec(), wait_s=self.wait_s)):
                pass
        try:
            await asyncio.gather(*(one(k) for k in range(len(routes))))
        except Exception as exc:  # a newer plan, a device leaving: the next plan warms up again
            log.info("warm_up_skipped", plan_version=route.plan_version, error=str(exc))
            self.stage.warm_grammar()
            return
        self.stage.warm_grammar()  # after the warm-up (not when cancelled: stopping), see StageService.warm_grammar
        if route.plan_version >= self.warm_version:
            self.warm_version = route.plan_version
            self.warm.set()
            log.info("pipeline_warm", plan_version=route.plan_version)

    def cuts(self, prompt_len: int, route: Route) -> list[int]:
        """Where the engine cuts a prompt on ``route``: its plan's cut table (see
        ``meshd.pipeline.coordinator.cuts``)."""
        packed = (route.weights or getattr(self.stage, "mode", "")) in PACKINGS  # rows computed exactly
        return prompt_cuts(prompt_len, len(route.stages), self._cut_tables.get(route.key), packed)

    async def aclose(self) -> None:
        await self.coordinator.close()
        await self.stage.close()


async def start_serving(cfg, view, node, *, sharing=None, weights_mode: str = "",
                        follow_plans=None, choose_mode=None) -> ServingRole:
    """Open the model, start the stage service and the coordinator, follow the home's plans.

    Loads the local model file's metadata and tokenizer (weights are loaded per
    plan, only for this device's layer range) on the control link's CURVE transport
    ``node``. ``view`` (``meshd.mesh.view.MeshView``) says where members' stages are
    and what profiles they shared; ``sharing`` (``meshd.share``) fetches the model from
    the home when this device has no file; ``follow_plans(listener)`` subscribes the
    role to every plan adopted from now on; ``await choose_mode(source)`` settles the numeric mode
    (``--weights auto``: the one this CPU measured fastest) before the stage is built in it.
    """
    from meshd.config import placement_of
    from meshd.engine.drafting import exits_factory, medusa_factory
    from meshd.model.store import open_model
    from meshd.pipeline.pins import pinned_prefixes
    from meshd.pipeline.stage import StageService
    from meshd.pipeline.stage.prefix_cache import PrefixCache
    from meshd.mesh.home_plan import DEFAULT_LINK, default_profile

    source = await (sharing.obtain_source() if sharing is not None else
                    asyncio.to_thread(open_model, cfg.model or None))
    # Everything lazy is done now, off the event loop: the tokenizer, and the file's
    # identity (a sha256 over the file, cached) that heartbeats carry.
    await asyncio.to_thread(lambda: (source.tokenizer, getattr(source, "identity", None)))
    if choose_mode is not None:
        await choose_mode(source)
    directory = MeshDirectory(view, cfg.listen)
    placement = placement_of(cfg)
    wire = getattr(cfg, "wire_dtype", "float32")
    share = float(getattr(cfg, "prefix_cache_share", 0.5))
    pins = await asyncio.to_thread(pinned_prefixes, list(getattr(cfg, "pin_prompts", []) or []), source.tokenizer)
    stage = StageService(node, view.node_id, source, directory, dtype=placement.dtype, device=placement.device,
                         packed=placement.packed,
                         activation_dtype=None if wire == "float32" else wire,
                         medusa=medusa_factory(source, getattr(cfg, "medusa_heads", None)),
                         exits=exits_factory(source, getattr(cfg, "exit_heads", None)),
                         peer_caps=directory.caps_of, prefix_cache=PrefixCache(share, pins))
    stage_port = cfg.port + 2 if cfg.port else 0  # 7412 by default: transport 7410, pairing 7411
    address = await stage.start(f"tcp://{cfg.listen}:{stage_port}")
    directory.own_port = int(address.rsplit(":", 1)[1])
    # a tensor group's links bind here whenever a plan puts this device in a group (7413 by default)
    directory.own_group_port = cfg.port + 3 if cfg.port else free_port(cfg.listen)
    stage.take_groups_at(f"tcp://{cfg.listen}:{directory.own_group_port}")
    coordinator = PipelineCoordinator(node, view.node_id, directory, resume_timeout_s=cfg.request_wait_s,
                                      model=source.identity, vocab_size=source.config.vocab_size,
                                      prefix_cache=share > 0, peer_caps=directory.caps_of)
    await coordinator.start(f"tcp://{cfg.listen}:0", advertise_host=directory.own_host())

    def profiles_for() -> dict[str, dict]:
        fallback = default_profile(weights_mode, source.identity)
        return {nid: view.profile_of(nid) or fallback for nid in view.members if (view.profile_of(nid) or fallback)}

    role = ServingRole(source, coordinator, stage, directory, profiles_for, DEFAULT_LINK,
                       wait_s=cfg.request_wait_s)
    if follow_plans is not None:
        follow_plans(role.follow)
    if view.plan is not None:
        role.follow(view.plan)
    log.info("serving_started", stage=address, coordinator=coordinator.address, model=source.identity,
             **placement.describe())
    if placement.device.type != "cpu":  # say it once: plans cannot know yet (issue #14)
        log.warning("gpu_stage_planned_as_cpu", device=str(placement.device),
                    reason="profiles measure the CPU only; the planner sees this device's CPU speed and memory")
    return role
