"""Drive generation requests through the pipeline stages of the current route.

The coordinator is whichever daemon received the request. It injects the
prompt's sub-sequences back to back into the first stage (stage i then works
on chunk j while stage i+1 works on chunk j-1), waits for the last stage's
sampled token, and feeds each new token back in (one attempt: :mod:`.attempt`;
this module is the request's loop around its attempts). Many requests may be in
flight at once: each has its own home-wide sequence key in every stage's
cache, and the stages interleave their messages, so the devices stay busy.

Answers survive a device leaving. The coordinator keeps each request's
prompt and the tokens generated so far, and owns its sampling state (the
seed, and how many draws earlier tokens spent). When the mesh re-plans under
a request, a stage loses its cache (it restarted) or a link breaks, the
request is *replayed*: after the new plan is ready it re-prefills prompt +
generated tokens on a fresh sequence and continues, so the client sees a
pause, not an error — greedy output is the same tokens, seeded sampling too.
Only when no plan can serve within ``resume_timeout_s`` does it fail, naming
the device that left.

Whatever happens, the request's cache is freed on every stage of every route
it used (frees go straight to each stage; stages keep tombstones so chunks
still queued upstream cannot re-create a freed sequence).
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Callable

from decoding.sampling import SamplingParams
from decoding.speculative.adaptive import RoundCost
from decoding.speculative.params import MAX_CANDIDATES
from meshd.engine.errors import out_of_vocab
from meshd.log import get_logger
from meshd.mesh.caps import Cap, PeerCaps
from meshd.pipeline.coordinator.attempt import attempt
from meshd.pipeline.coordinator.drafter import MeshDrafter
from meshd.pipeline.coordinator.failures import (BadTokens, Interrupted, NoRoute, PipelineError, PrefixMiss,
                                                 gone_message)
from meshd.pipeline.coordinator.flights import LEGACY_PREFILL_S_PER_TOKEN, FlightTable, Replanned
from meshd.pipeline.coordinator.prefix_reuse import PrefixReuse
from meshd.pipeline.coordinator.routes import RouteCounts, RouteTable
from meshd.pipeline.coordinator.slot import (Cuts, Flight, RequestSlot, SharedPrefix, SlotState, StepsRequest,
                                             TokenStep)
from meshd.pipeline.coordinator.workload import WorkloadMeter
from meshd.pipeline.links import Directory, Links
from meshd.pipeline.route import Route
from meshd.pipeline.seqkey import SeqKeys
from partition.ids import NodeId, RequestId
from transport.errors import TransportError
from transport.link import Request
from transport.messages import Ack, ErrorReply
from transport.node import TransportNode
from transport.stage_messages import StageProgress, TokenResult

__all__ = ["PipelineCoordinator"]

log = get_logger("meshd.coordinator")


class PipelineCoordinator:
    def __init__(self, node: TransportNode, node_id: NodeId, directory: Directory,
                 token_timeout_s: float = 30.0, send_timeout_s: float = 10.0,
                 activation_dtype: str | None = None, resume_timeout_s: float = 60.0,
                 model: str = "", vocab_size: int = 0, prefix_cache: bool = True,
                 peer_caps: Callable[[NodeId], PeerCaps] | None = None):
        """``model``: identity of this device's model file (a plan for another is refused at
        once); ``vocab_size``: its vocabulary, which bounds every prompt's token ids (0: unchecked);
        ``prefix_cache``: start requests on the prefix the stages hold of them (see PrefixReuse).
        ``token_timeout_s``: how long a request waits on stages that neither answer nor say they
        advance; ``peer_caps``: what a member's daemon does (None: every peer runs this code)."""
        self.node = node
        self.model = model
        self.vocab_size = vocab_size
        self.node_id = node_id
        self.directory = directory
        self.token_timeout_s = token_timeout_s
        self._peer_caps = peer_caps
        self.send_timeout_s = send_timeout_s
        self.activation_dtype = activation_dtype
        self.resume_timeout_s = resume_timeout_s
        self.workload = WorkloadMeter()  # what requests here look like (the layout planner prices it)
        self.address: str | None = None
        self._server = None
        self._requests: set[RequestId] = set()
        self.keys = SeqKeys(node_id)
        self.links = Links(node, directory)
        self.flights = FlightTable(self.keys, self.links, send_timeout_s)
        self.prefixes = PrefixReuse(self.links, prefix_cache, silent_s=token_timeout_s)
        self.table = RouteTable(node_id, self.links, self.prefixes)  # the plan's routes, which serve, which to take
        self.resumes = 0
        # What a verify round of m tokens costs on this mesh, learnt from every round any request runs.
        self.round_cost = RoundCost()
        self.medusa_paths = MAX_CANDIDATES

    async def start(self, address: str = "tcp://127.0.0.1:0", advertise_host: str | None = None) -> str:
        """Bind; ``advertise_host`` is the address last stages use to reach us (when binding 0.0.0.0)."""
        self._server = await self.node.serve(self._on_message, address)
        self.address = self._server.address
        if advertise_host:
            self.address = f"tcp://{advertise_host}:{self.address.rsplit(':', 1)[1]}"
        return self.address

    async def close(self) -> None:
        self.flights.tell(lambda f: True, lambda f: PipelineError("the coordinator is shutting down"))
        self.table.close()
        await self.links.close()
        if self._server is not None:
            await self._server.close()

    @property
    def reply_to(self) -> str:
        return f"{self.node_id}|{self.address}"

    @property
    def in_flight(self) -> int:
        return len(self._requests)

    @property
    def routes(self) -> tuple[Route, ...]:
        """The current plan's routes (one pipeline, or replicas and a pipeline group; () while one deploys)."""
        return self.table.routes

    @property
    def route(self) -> Route | None:
        """The current plan's first route (None: no plan serving)."""
        return self.table.first

    @property
    def route_counts(self) -> RouteCounts:
        return self.table.counts

    @property
    def waiting_on(self) -> str | None:
        return self.table.waiting_on

    def set_route(self, route: Route | None) -> None:
        """A plan of one route (or none while one deploys); see :meth:`set_routes`."""
        self.set_routes((route,) if route is not None else ())

    def set_routes(self, routes: tuple[Route, ...]) -> None:
        """A new plan's routes (or none while one deploys): requests on the old one replay on the next."""
        if self.table.set(routes):
            new = self.route
            self.flights.tell(lambda f: new is None or f.route.plan_version != new.plan_version,
                              lambda f: Replanned(f.route.plan_version, new.plan_version if new else None))

    def stage_restarted(self, node_id: NodeId) -> None:
        """A member came back with a new incarnation: its caches are gone; re-probe before use."""
        self.table.probe_again()
        self.flights.tell(lambda f: f.route.index_of(node_id) is not None,
                          lambda f: Interrupted(f"{node_id} restarted", node_id))

    # -- incoming ------------------------------------------------------------------
    async def _on_message(self, msg, req: Request):
        if isinstance(msg, StageProgress):
            self.flights.progressed(msg)
            return Ack()
        if isinstance(msg, (TokenResult, ErrorReply)):
            if not self.flights.deliver(msg):
                log.debug("late_result_dropped", request_id=msg.request_id, message_type=type(msg).__name__)
            return Ack()
        log.warning("coordinator_unexpected_message", message_type=type(msg).__name__)
        return ErrorReply("unknown_type", f"the coordinator does not handle {type(msg).__name__}")

    # -- outgoing ------------------------------------------------------------------
    async def send(self, node_id: NodeId, msg) -> None:
        """Send ``msg`` to a stage; a stage out of reach interrupts the request (it is replayed)."""
        try:
            peer = await self.links.to(node_id)
            await peer.send(msg, timeout=self.send_timeout_s, activation_dtype=self.activation_dtype)
        except (TransportError, KeyError) as exc:
            raise Interrupted(f"could not reach {node_id}: {exc}", node_id) from exc

    async def wait_ready(self, route: Route, timeout_s: float = 120.0, poll_s: float = 0.1) -> None:
        """Wait until every stage of ``route`` serves its plan (see :meth:`RouteTable.wait_ready`)."""
        await self.table.wait_ready(route, timeout_s, poll_s)

    async def serving_route(self, timeout_s: float, slot: RequestSlot | None = None) -> Route:
        """A current route once all its stages serve it (see :meth:`RouteTable.serving`)."""
        return await self.table.serving(timeout_s, self.model, slot)

    # -- the request loop ------------------------------------------------------------
    async def steps(self, request: StepsRequest) -> AsyncIterator[TokenStep]:
        """The request's tokens, one step each (EOS included, as the last one).

        This is the one place a mesh request's budget and EOS end it
        (:meth:`RequestSlot.ends_with`): the coordinator must stop feeding tokens
        back to the stages then, whoever its client is, so the API's
        :meth:`~meshd.engine.base.Engine.stream` only labels how it ended.
        """
        slot = self.admit(request)
        running: Route | None = None
        arrived_with, cached = self.in_flight, 0
        try:
            route = await self.serving_route(self.resume_timeout_s if request.wait_s is None else request.wait_s,
                                             slot)
            running = route  # counted in route_counts until given back
            self.table.recent.note(route, slot)
            while True:
                try:
                    async for step in attempt(self, slot, route):
                        slot.generated.append(step.token)
                        if len(slot.generated) == 1:
                            cached = step.cached or 0
                        if running is not None and slot.ends_with(step.token):
                            # its last token: no more load on the route (a client sends its next request
                            # as soon as it has this one, while the attempt still winds down)
                            self.route_counts.give(running)
                            running = None
                        yield step
                    return
                except PrefixMiss as exc:  # evicted since the probe: this request prefills in full
                    self.prefixes.missed()
                    slot.reuse = False
                    log.info("prefix_missed", request_id=slot.request_id, reason=str(exc))
                except Interrupted as exc:
                    if request.keep is not None or request.fork is not None:
                        raise PipelineError(f"a request sharing its prefix was interrupted ({exc}); retry it") \
                            from None
                    slot.state, slot.replays = SlotState.REPLAYING, slot.replays + 1
                    self.note_replay()
                    self.table.probe_again(route)  # re-probe the route before the replay uses it
                    slot.avoid = exc.device
                    log.info("request_replaying", request_id=slot.request_id, generated=len(slot.generated),
                             reason=str(exc), device=exc.device, plan_version=route.plan_version)
                    self.route_counts.give(running)
                    running = None
                    try:
                        route = running = await self.serving_route(self.resume_timeout_s, slot)
                        self.table.recent.note(route, slot)
                    except NoRoute:
                        raise PipelineError(gone_message(route, self.route, exc, self.resume_timeout_s)) from None
        finally:
            if running is not None:
                self.route_counts.give(running)
            if slot.generated and not str(request.request_id).startswith("warmup-"):
                self.workload.record(len(request.prompt_ids), cached, len(slot.generated), arrived_with)
            slot.state = SlotState.DONE
            self.discharge(slot.request_id)

    def admit(self, request: StepsRequest) -> RequestSlot:
        """Check ``request`` and give it a slot (its id is taken until :meth:`discharge`)."""
        sampling = request.sampling
        if request.speculation is not None and request.typical and sampling.shaped:
            raise PipelineError("typical acceptance cannot be combined with structured output or penalties")
        self._take_id(request.request_id)
        bad = out_of_vocab(request.prompt_ids, self.vocab_size)
        if bad:
            self.discharge(request.request_id)
            raise BadTokens(bad)
        if not sampling.greedy and sampling.params.seed is None:
            # We own the random stream: a replay must continue it, so it needs a known seed.
            sampling = sampling.with_seed(secrets.randbits(63))
        return RequestSlot(request, sampling)

    def _take_id(self, request_id: RequestId) -> None:
        if request_id in self._requests:
            raise PipelineError(f"request id {request_id!r} is already running")
        self._requests.add(request_id)

    def discharge(self, request_id: RequestId) -> None:
        """The request is over: its id may be used again."""
        self._requests.discard(request_id)

    def note_replay(self) -> None:
        """Count a request (or a drafter) that lost its sequence and goes on on a fresh one."""
        self.resumes += 1

    def exits_available(self) -> bool | None:
        """Whether a route known to serve checks early exits at its last stage (None: none serves yet)."""
        return self.table.exits_available()

    def drafter(self, request_id: RequestId, capacity: int, sampling: SamplingParams, cuts: Cuts = None,
                wait_s: float | None = None) -> MeshDrafter:
        """Draft through the mesh for a cloud verifier (see :class:`MeshDrafter`); close it when done."""
        self._take_id(request_id)
        if not sampling.greedy and sampling.seed is None:
            sampling = sampling.with_seed(secrets.randbits(63))
        return MeshDrafter(self, request_id, capacity, sampling, cuts,
                           self.resume_timeout_s if wait_s is None else wait_s)

    async def release(self, prefix: SharedPrefix) -> None:
        """Free a kept prefix on every stage (its children's own positions are theirs to free)."""
        if prefix.seq is not None and prefix.route is not None:
            seq, prefix.seq = prefix.seq, None
            await self.flights.free(prefix.route, seq)

    # -- flights: one sequence of a request on one route ---------------------------------
    def open_flight(self, request_id: RequestId, route: Route) -> Flight:
        """A fresh sequence for ``request_id`` on ``route``; its results arrive in its queue."""
        return self.flights.open(request_id, route)

    async def end_flight(self, flight: Flight, cache: bool = False) -> None:
        """Stop listening for ``flight`` and free its sequence on every stage of its route (``cache``:
        every stage keeps it as a cached prefix instead)."""
        await self.flights.end(flight, cache)

    async def next_result(self, flight: Flight, work_tokens: int = 1) -> TokenResult:
        """The next result of ``flight``, which was just sent ``work_tokens`` positions to compute.

        The wait is a backstop (a device that leaves is noticed by membership and
        re-planning first), and it must outlast honest work: a 3,600-token prompt
        takes minutes on a slow device, and a replay after a timeout would start it
        again, for ever. So it follows progress: stages say they advance every few
        seconds, and only ``token_timeout_s`` without a word ends the wait.
        """
        return await self.flights.next_result(flight, self.wait_for(flight.route, work_tokens))

    def wait_for(self, route: Route, work_tokens: int) -> float:
        """How long ``work_tokens`` positions on ``route`` may go without a word: ``token_timeout_s``, and on a
        route with a stage that never reports progress (an older release) a budget per position besides."""
        if self._peer_caps is None or all(Cap.PROGRESS in self._peer_caps(s.node_id) for s in route.stages):
            return self.token_timeout_s
        return self.token_timeout_s + max(0, work_tokens - 1) * LEGACY_PREFILL_S_PER_TOKEN
