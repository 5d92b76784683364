"""This device's part of the mesh, owned by the daemon: its stage, its coordinator, its plans.

The daemon owns one ``ServingRole``. It serves this device's pipeline stage for
every coordinator in the home, runs the coordinator for requests that arrive
here, and follows the daemon's plans: adopting them in version order only,
loading the new layer range, building the plan's cut table, and sending a tiny
warm-up request through every stage (links, CURVE handshakes, first forwards),
so the first real answer does not pay for them. The API's engine
(``meshd.pipeline.engine.PipelineEngine``) only borrows the coordinator and the
cut points; nothing here knows about HTTP.
"""

from __future__ import annotations

import asyncio

from decoding.sampling import SamplingSpec
from decoding.stage import EXACT_BLOCK
from meshd.log import get_logger
from meshd.pipeline.coordinator import PipelineCoordinator, StepsRequest
from meshd.pipeline.engine import UNCUT_PROMPT, aligned_cuts, default_cuts
from meshd.pipeline.route import Route, model_mismatch
from partition.plan import LayerAssignment

log = get_logger("meshd.serving")


class DaemonDirectory:
    """Node id → (stage endpoint, CURVE key), from the daemon's membership view.

    Peers announce their stage port in heartbeats; their address is the one mDNS
    resolved. Looked up on every use, so a member that restarts on a new port or
    address is followed at once. A member whose endpoint is not known yet gives
    an empty address (its key is still known: enough to answer its requests).
    """

    def __init__(self, daemon):
        self.daemon = daemon

    def own_host(self) -> str:
        listen = self.daemon.config.listen
        if listen not in ("0.0.0.0", "", "::"):
            return listen
        for iface in self.daemon.interfaces:
            if iface.addresses:
                return iface.addresses[0]
        return "127.0.0.1"

    def __call__(self, node_id: str) -> tuple[str, str]:
        d = self.daemon
        if node_id == d.node_id:
            return f"tcp://{self.own_host()}:{d.stage_port}", d.public_key
        member = d.members.get(node_id)
        if member is None:
            raise KeyError(f"{node_id} is not a member of this home")
        peer = d.membership.peers.get(node_id) if d.membership else None
        port = int((peer.info if peer else {}).get("stage_port") or 0)
        if node_id not in d.addresses or not port:
            return "", member.public_key
        return f"tcp://{d.addresses[node_id][0]}:{port}", member.public_key

    def version_of(self, node_id: str) -> str:
        """The meshd version ``node_id`` announced in its heartbeats ("": not known)."""
        d = self.daemon
        peer = d.membership.peers.get(node_id) if d.membership else None
        return str((peer.info if peer else {}).get("version") or "")


def route_from_plan(plan: LayerAssignment, directory) -> Route:
    """The plan's stages (same ``[first, end)`` ranges) with each node's address and key."""
    from meshd.pipeline.route import StageEndpoint

    stages = []
    for s in plan.stages:
        try:
            address, key = directory(s.node_id)
        except KeyError:
            address, key = "", ""
        stages.append(StageEndpoint(s.node_id, address, key, s.first, s.end))
    return Route(plan.version, tuple(stages), getattr(plan, "weights", "") or "", getattr(plan, "model", "") or "")


CUT_TABLE_MAX_SEQ = 2048


def _route_timings(route: Route, profiles: dict[str, dict], num_layers: int, link_spec: str):
    """Per-stage timing models of this route (None if a member's profile is missing or for another model)."""
    from partition.link import parse_link
    from partition.plan import StageAssignment
    from partition.planner import stage_timings
    from partition.profile import DeviceProfile

    devs = {}
    for s in route.stages:
        data = profiles.get(s.node_id)
        if data is None:
            return None
        p = DeviceProfile.from_dict(data)
        if p.num_layers != num_layers:
            return None
        devs[s.node_id] = p
    stages = tuple(StageAssignment(s.node_id, s.first, s.end) for s in route.stages)
    return stage_timings(stages, devs, parse_link(link_spec))


def cut_table_for(route: Route, profiles: dict[str, dict], num_layers: int, link_spec: str):
    """The sequence partitioner's cut table for this route's stages (None if profiles are missing).

    Pure: device profiles (plain dicts, as members share them) + layer ranges + link →
    ``partition.plan.CutTable``; a lookup then gives a prompt's cut points in O(1).
    """
    from partition.sequence import build_cut_table

    timings = _route_timings(route, profiles, num_layers, link_spec)
    return None if timings is None else build_cut_table(timings, CUT_TABLE_MAX_SEQ)


def verify_cost_slope(route: Route, profiles: dict[str, dict], num_layers: int, link_spec: str) -> float | None:
    """The profiles' estimate of what an extra token in a speculative verify round costs on this route."""
    from partition.sequence import round_cost_slope

    timings = _route_timings(route, profiles, num_layers, link_spec)
    return None if timings is None else round_cost_slope(timings)


class ServingRole:
    """Stage + coordinator + plan adoption for one daemon.

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
        self.warm = asyncio.Event()  # set once a plan has served a warm-up request end to end
        self.warm_version = 0
        self.model_mismatch = ""  # why this device cannot serve the current plan's model ("": it can)

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
            route = route_from_plan(plan, self.directory)
            self.model_mismatch = model_mismatch(route.model, str(getattr(self.source, "identity", "") or ""))
            if self.model_mismatch:
                # (the daemon's model_differs_from_home warning says what to do about it)
                log.info("plan_for_another_model", plan_version=route.plan_version, error=self.model_mismatch)
            # Requests running on the old plan pause now (they replay on this one once it
            # serves), rather than keep a vanished device's stage in their path.
            self.coordinator.set_route(None)
            if self.profiles_for is not None and len(route.stages) > 1:
                try:
                    table = await asyncio.to_thread(cut_table_for, route, self.profiles_for(),
                                                    self.source.config.num_layers, self.link_spec)
                    if table is not None:
                        self._cut_tables = {route.plan_version: table}
                    slope = verify_cost_slope(route, self.profiles_for(), self.source.config.num_layers,
                                              self.link_spec)
                    if slope is not None:
                        self.coordinator.round_cost.prior(slope)
                except Exception as exc:  # planning help is optional: equal chunks still work
                    self.cut_table_errors += 1
                    log.warning("cut_table_failed", plan_version=route.plan_version, error=str(exc))
            try:
                await self.stage.deploy(route)
            except Exception:  # a bad plan must not kill the daemon; the next plan may fix it
                log.exception("stage_deploy_failed", plan_version=route.plan_version)
                return
            self._deployed = route.plan_version
            self.coordinator.set_route(route)
        if not self.model_mismatch:  # (requests here are refused at once: nothing to warm)
            await self.warm_up(route)

    async def warm_up(self, route: Route) -> None:
        """One tiny greedy request through every stage of ``route`` (best effort)."""
        ids = list(self.source.tokenizer.encode("Hello"))[:4] or [0]
        try:
            async for _ in self.coordinator.steps(StepsRequest(f"warmup-{route.plan_version}-{id(self)}", ids, 2,
                                                               SamplingSpec(), wait_s=self.wait_s)):
                pass
        except Exception as exc:  # a newer plan, a device leaving: the next plan warms up again
            log.info("warm_up_skipped", plan_version=route.plan_version, error=str(exc))
            return
        if route.plan_version >= self.warm_version:
            self.warm_version = route.plan_version
            self.warm.set()
            log.info("pipeline_warm", plan_version=route.plan_version)

    def cuts(self, prompt_len: int, route: Route) -> list[int]:
        if prompt_len < UNCUT_PROMPT or len(route.stages) <= 1:
            return []
        table = self._cut_tables.get(route.plan_version)
        if table is not None and prompt_len <= table.max_seq:
            cuts = list(table.lookup(prompt_len))
        else:
            cuts = default_cuts(prompt_len, len(route.stages))
        if (route.weights or getattr(self.stage, "mode", "")).startswith("packed"):
            cuts = aligned_cuts(cuts, prompt_len, EXACT_BLOCK)  # a packed stage's exactness (decoding.stage)
        return cuts

    async def aclose(self) -> None:
        await self.coordinator.close()
        await self.stage.close()




async def start_serving(daemon) -> ServingRole:
    """Open the model, start the stage service and the coordinator, follow the daemon's plans.

    Loads the local model file's metadata and tokenizer (weights are loaded per
    plan, only for this device's layer range) on the daemon's CURVE transport.
    """
    from meshd.config import placement_of
    from meshd.drafting import medusa_factory
    from meshd.model_store import open_model
    from meshd.pipeline.stage import StageService
    from meshd.plan import DEFAULT_LINK, default_profile

    cfg = daemon.config
    sharing = getattr(daemon, "sharing", None)  # no local file: the home's members lend it (meshd.share)
    source = await (sharing.obtain_source() if sharing is not None else
                    asyncio.to_thread(open_model, cfg.model or None))
    # Everything lazy is done now, off the event loop: the tokenizer, and the file's
    # identity (a sha256 over the file, cached) that heartbeats carry.
    await asyncio.to_thread(lambda: (source.tokenizer, getattr(source, "identity", None)))
    directory = DaemonDirectory(daemon)
    node = daemon.link.node
    placement = placement_of(cfg)
    wire = getattr(cfg, "wire_dtype", "float32")
    stage = StageService(node, daemon.node_id, source, directory, dtype=placement.dtype, device=placement.device,
                         packed=placement.packed,
                         activation_dtype=None if wire == "float32" else wire,
                         medusa=medusa_factory(source, getattr(cfg, "medusa_heads", None)),
                         peer_version=directory.version_of)
    stage_port = cfg.port + 2 if cfg.port else 0  # 7412 by default: transport 7410, pairing 7411
    address = await stage.start(f"tcp://{cfg.listen}:{stage_port}")
    daemon.stage_port = int(address.rsplit(":", 1)[1])
    coordinator = PipelineCoordinator(node, daemon.node_id, directory, resume_timeout_s=cfg.request_wait_s,
                                      model=source.identity, vocab_size=source.config.vocab_size)
    await coordinator.start(f"tcp://{cfg.listen}:0", advertise_host=directory.own_host())

    def profiles_for() -> dict[str, dict]:
        fallback = default_profile(daemon.weights_mode, source.identity)
        known = {**daemon.profiles, daemon.node_id: daemon.own_profile}
        return {nid: known.get(nid) or fallback for nid in daemon.members if (known.get(nid) or fallback)}

    role = ServingRole(source, coordinator, stage, directory, profiles_for, DEFAULT_LINK,
                       wait_s=cfg.request_wait_s)
    daemon.plan_listeners.append(role.follow)
    if daemon.plan is not None:
        role.follow(daemon.plan)
    log.info("serving_started", stage=address, coordinator=coordinator.address, model=source.identity,
             **placement.describe())
    if placement.device.type != "cpu":  # say it once: plans cannot know yet (issue #14)
        log.warning("gpu_stage_planned_as_cpu", device=str(placement.device),
                    reason="profiles measure the CPU only; the planner sees this device's CPU speed and memory")
    return role
