"""Drive generation requests through the pipeline stages of the current route.

The coordinator is whichever daemon received the request. It injects the
prompt's sub-sequences back to back into the first stage (stage i then works
on chunk j while stage i+1 works on chunk j-1), waits for the last stage's
sampled token, and feeds each new token back in. Many requests may be in
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

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import torch

from decoding.offload.loop import SUPPORT_MAX, DraftStep, draft_step
from decoding.offload.policy import GAMMA
from decoding.pipeline_local import chunk_bounds
from decoding.sampling import SamplingParams, SamplingSpec
from decoding.speculative.adaptive import RoundCost
from decoding.speculative.params import MAX_CANDIDATES
from decoding.speculative.session import MedusaProposal, SpeculationSession
from decoding.speculative.verify import Verdict
from meshd.engine import out_of_vocab
from meshd.errors import MeshdError
from meshd.log import get_logger
from meshd.pipeline.links import Directory, Links
from meshd.pipeline.route import Route, model_mismatch
from meshd.pipeline.seqkey import SeqKey, SeqKeys
from partition.ids import RequestId
from transport.errors import TransportError
from transport.link import Request
from transport.messages import Ack, ErrorReply, ForkSequence, FreeSequence, Hello, StageForward, TokenResult
from transport.node import TransportNode

log = get_logger("meshd.coordinator")

# Stage error codes that mean "this sequence's cache is gone, the request itself is fine":
# replay it (possibly on a new plan) instead of failing the client.
RESUMABLE_CODES = frozenset({"no_stage", "stale_plan", "unknown_sequence", "position_mismatch", "link",
                             "protocol"})


class PipelineError(MeshdError):
    """A request could not be completed by the pipeline (the message says where and why)."""


class NoRoute(PipelineError):
    pass


class ModelMismatch(PipelineError):
    """This device holds another model than the plan's: it cannot coordinate the home's requests."""


class BadTokens(PipelineError):
    """A prompt holds token ids outside the model's vocabulary (never sent to a stage)."""


class PipelineBusy(PipelineError):
    """A stage has no room for the request now (KV cache full): retry shortly."""

    retry_after_s = 2.0


class _Interrupted(Exception):
    """The request's current sequence is lost; replay it (``device``: who we suspect, if anyone)."""

    def __init__(self, why: str, device: str | None = None):
        super().__init__(why)
        self.device = device


@dataclass(frozen=True)
class TokenStep:
    token: int
    topk_ids: list[int] | None = None
    topk_probs: list[float] | None = None


@dataclass(frozen=True)
class _Replanned:
    old: int
    new: int | None


@dataclass
class SharedPrefix:
    """A sequence kept in every stage's cache after its request ended, for children to fork from.

    Outline decoding writes the outline once and expands every point from it:
    each child reads these ``length`` positions in place on every stage. The
    owner frees it (:meth:`PipelineCoordinator.release`) when the last child is done.
    """

    request_id: RequestId
    route: Route | None = None
    seq: SeqKey | None = None
    length: int = 0


@dataclass
class _Flight:
    request_id: RequestId
    route: Route
    seq: SeqKey
    queue: asyncio.Queue


Cuts = list[int] | Callable[[int, Route], list[int]] | None
# How long a token of prompt may take on the slowest device we wait for (20 tokens/s: a
# 1.5B model in float32 on one small core) before a stage counts as stuck.
PREFILL_BUDGET_S_PER_TOKEN = 0.05


class PipelineCoordinator:
    def __init__(self, node: TransportNode, node_id: str, directory: Directory,
                 token_timeout_s: float = 30.0, send_timeout_s: float = 10.0,
                 activation_dtype: str | None = None, resume_timeout_s: float = 60.0,
                 model: str = "", vocab_size: int = 0):
        """``model``: identity of this device's model file (a plan for another is refused at
        once); ``vocab_size``: its vocabulary, which bounds every prompt's token ids (0: unchecked)."""
        self.node = node
        self.model = model
        self.vocab_size = vocab_size
        self.node_id = node_id
        self.directory = directory
        self.token_timeout_s = token_timeout_s
        self.send_timeout_s = send_timeout_s
        self.activation_dtype = activation_dtype
        self.resume_timeout_s = resume_timeout_s
        self.route: Route | None = None
        self.address: str | None = None
        self._server = None
        self._flights: dict[SeqKey, _Flight] = {}
        self._requests: set[RequestId] = set()
        self.keys = SeqKeys(node_id)
        self.links = Links(node, directory)
        self._ready_version = 0
        self._route_changed = asyncio.Event()
        self.waiting_on: str | None = None  # the stage a readiness probe waits for (named in errors)
        self.resumes = 0
        # What a verify round of m tokens costs on this mesh, learnt from every round any request runs.
        self.round_cost = RoundCost()
        self.medusa_paths = MAX_CANDIDATES
        self.spec_totals = {"rounds": 0, "drafted": 0, "accepted": 0, "requests": 0}
        # Outline decoding: attempts ("requests" = used + fallbacks), fallbacks and declines by reason.
        self.outline_totals = {"requests": 0, "used": 0, "fallbacks": 0, "points": 0,
                               "fallback_reasons": {}, "declined": {}}
        self._closing = False
        self._freeing: set[asyncio.Task] = set()

    async def start(self, address: str = "tcp://127.0.0.1:0", advertise_host: str | None = None) -> str:
        """Bind; ``advertise_host`` is the address last stages use to reach us (when binding 0.0.0.0)."""
        self._server = await self.node.serve(self._on_message, address)
        self.address = self._server.address
        if advertise_host:
            self.address = f"tcp://{advertise_host}:{self.address.rsplit(':', 1)[1]}"
        return self.address

    async def close(self) -> None:
        self._closing = True
        for f in list(self._flights.values()):
            f.queue.put_nowait(PipelineError("the coordinator is shutting down"))
        self._route_changed.set()
        await self.links.close()
        if self._server is not None:
            await self._server.close()

    @property
    def reply_to(self) -> str:
        return f"{self.node_id}|{self.address}"

    @property
    def in_flight(self) -> int:
        return len(self._requests)

    def set_route(self, route: Route | None) -> None:
        """A new plan (or none while one deploys): requests on the old one replay on the next."""
        old, self.route = self.route, route
        if route is None or old is None or route.plan_version != old.plan_version:
            self._ready_version = 0
            for f in list(self._flights.values()):
                if route is None or f.route.plan_version != route.plan_version:
                    f.queue.put_nowait(_Replanned(f.route.plan_version, route.plan_version if route else None))
        self._route_changed.set()
        self._route_changed = asyncio.Event()

    def stage_restarted(self, node_id: str) -> None:
        """A member came back with a new incarnation: its caches are gone; re-probe before use."""
        self._ready_version = 0
        for f in list(self._flights.values()):
            if f.route.index_of(node_id) is not None:
                f.queue.put_nowait(_Interrupted(f"{node_id} restarted", node_id))

    # -- incoming ------------------------------------------------------------------
    async def _on_message(self, msg, req: Request):
        if isinstance(msg, (TokenResult, ErrorReply)):
            flight = self._flights.get(getattr(msg, "seq_id", "")) if isinstance(msg, TokenResult) else None
            if flight is None and isinstance(msg, ErrorReply):
                flight = next((f for f in self._flights.values() if f.request_id == msg.request_id), None)
            if flight is None:
                log.debug("late_result_dropped", request_id=msg.request_id, message_type=type(msg).__name__)
            else:
                flight.queue.put_nowait(msg)
            return Ack()
        log.warning("coordinator_unexpected_message", message_type=type(msg).__name__)
        return ErrorReply("unknown_type", f"the coordinator does not handle {type(msg).__name__}")

    # -- outgoing ------------------------------------------------------------------
    async def _send(self, node_id: str, msg) -> None:
        try:
            peer = await self.links.to(node_id)
            await peer.send(msg, timeout=self.send_timeout_s, activation_dtype=self.activation_dtype)
        except (TransportError, KeyError) as exc:
            raise _Interrupted(f"could not reach {node_id}: {exc}", node_id) from exc

    async def wait_ready(self, route: Route, timeout_s: float = 120.0, poll_s: float = 0.1) -> None:
        """Wait until every stage of ``route`` has loaded its layers for that plan version.

        After a re-plan, stages may still be loading weights; a request arriving
        then waits (bounded) instead of failing on a half-deployed pipeline.
        """
        if self._ready_version == route.plan_version:
            return
        async with asyncio.timeout(timeout_s):
            for st in route.stages:
                self.waiting_on = st.node_id
                while True:
                    if self.route is not route:  # re-planned (e.g. a stage's device left): stop waiting
                        raise _Interrupted(f"the mesh re-planned while plan {route.plan_version} loaded")
                    try:
                        peer = await self.links.to(st.node_id)
                        reply = await peer.request(Hello(self.node_id, route.plan_version, ""), timeout=2.0)
                        if reply.plan_version == route.plan_version:
                            break
                        if not reply.accepted and reply.reason:  # it holds another model: it never will
                            raise ModelMismatch(f"stage {st.node_id} {reply.reason}")
                    except (TransportError, KeyError) as exc:
                        log.debug("stage_not_ready", node=st.node_id, error=str(exc))
                    await asyncio.sleep(poll_s)
        self._ready_version = route.plan_version
        self.waiting_on = None
        log.info("pipeline_ready", plan_version=route.plan_version, stages=[s.node_id for s in route.stages])

    async def serving_route(self, timeout_s: float) -> Route:
        """The current route once all its stages serve it; waits (bounded) through re-plans."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or self._closing:
                why = (f"device {self.waiting_on} of plan {self.route.plan_version} did not answer"
                       if self.waiting_on and self.route is not None
                       else "devices still joining, loading layers or re-planning")
                raise NoRoute(f"no pipeline plan could serve within {timeout_s:g}s ({why}); retry")
            route = self.route
            mismatch = model_mismatch(route.model, self.model) if route is not None else ""
            if mismatch:
                from meshd.model_store import model_flag_for

                raise ModelMismatch(f"this device {mismatch}, so it answers no requests: restart it "
                                    f"{model_flag_for(route.model)} (every member of a home holds the same "
                                    f"model) or send requests to another member")
            if route is None or not route.stages:
                changed = self._route_changed
                try:  # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancel (a hang-up)
                    async with asyncio.timeout(left):
                        await changed.wait()
                except TimeoutError:
                    pass
                continue
            try:
                await self.wait_ready(route, timeout_s=left)
                return route
            except (_Interrupted, TimeoutError):
                continue

    # -- the request loop ------------------------------------------------------------
    async def generate(self, request_id: RequestId, prompt_ids: list[int], max_tokens: int,
                       sampling: SamplingSpec, eos_ids=(), cuts: Cuts = None,
                       chunks: int | None = None) -> AsyncIterator[int]:
        """Yield sampled token ids (EOS included, as the last one) for one request."""
        async for step in self.steps(request_id, prompt_ids, max_tokens, sampling, eos_ids, cuts, chunks):
            yield step.token

    async def steps(self, request_id: RequestId, prompt_ids: list[int], max_tokens: int,
                    sampling: SamplingSpec, eos_ids=(), cuts: Cuts = None,
                    chunks: int | None = None, return_topk: int = 0,
                    wait_s: float | None = None, speculation: SpeculationSession | None = None,
                    typical: bool = False, context_limit: int | None = None,
                    keep: SharedPrefix | None = None,
                    fork: SharedPrefix | None = None) -> AsyncIterator[TokenStep]:
        """Like :meth:`generate`, with each step's top-k probabilities when ``return_topk`` > 0.

        Only the k ids and probabilities travel back from the last stage — never full logits.
        ``cuts``: the prompt's cut points, or a function (length, route) -> cut points,
        asked again whenever the request is replayed on a new route.
        ``speculation``: decode in verify rounds drafted by this session (its context is the
        prompt); its stats say how it went. ``context_limit`` bounds a round's KV positions.
        ``sampling`` is the request's one spec; its shaping (penalties, a grammar)
        excludes speculation.
        ``keep``: leave the sequence in the stages' caches when the request ends — or
        when the caller stops iterating after a step — and describe it there (for
        children to fork from; free it with :meth:`release`). Plain decoding only.
        ``fork``: this request continues ``fork``'s sequence: ``prompt_ids`` come after
        its positions, which are read in place, never re-computed. Neither can be
        replayed on another plan: a device leaving fails such a request clearly.
        """
        if speculation is not None and sampling.shaped:
            raise PipelineError("speculation cannot be combined with structured output or penalties")
        if request_id in self._requests:
            raise PipelineError(f"request id {request_id!r} is already running")
        bad = out_of_vocab(prompt_ids, self.vocab_size)
        if bad:
            raise BadTokens(bad)
        if not sampling.greedy and sampling.params.seed is None:
            # We own the random stream: a replay must continue it, so it needs a known seed.
            sampling = sampling.with_seed(secrets.randbits(63))
        self._requests.add(request_id)
        generated: list[int] = []
        first_wait = self.resume_timeout_s if wait_s is None else wait_s
        try:
            route = await self.serving_route(first_wait)
            while True:
                try:
                    async for step in self._attempt(request_id, route, prompt_ids, generated, max_tokens,
                                                    sampling, eos_ids, cuts, chunks, return_topk,
                                                    speculation, typical, context_limit,
                                                    self._shaping(prompt_ids, sampling),
                                                    keep=keep, fork=fork):
                        generated.append(step.token)
                        yield step
                    return
                except _Interrupted as exc:
                    if keep is not None or fork is not None:
                        raise PipelineError(f"a request sharing its prefix was interrupted ({exc}); retry it") \
                            from None
                    self.resumes += 1
                    self._ready_version = 0
                    log.info("request_replaying", request_id=request_id, generated=len(generated),
                             reason=str(exc), device=exc.device, plan_version=route.plan_version)
                    try:
                        new = await self.serving_route(self.resume_timeout_s)
                    except NoRoute:
                        raise PipelineError(self._gone_message(route, exc)) from None
                    route = new
        finally:
            self._requests.discard(request_id)

    @staticmethod
    def _shaping(prompt_ids: list[int], sampling: SamplingSpec) -> dict:
        """Fields of a last prompt chunk that make the last stage build a grammar / penalty
        state for the sequence (every other message carries the spec unshaped)."""
        if not sampling.shaped:
            return {}
        out: dict = {"sampling": sampling}
        if sampling.penalties.active:
            n = sampling.penalties.repeat_last_n
            out["prompt_tail"] = list(prompt_ids if n < 0 else prompt_ids[len(prompt_ids) - n:] if n else [])
        return out

    def _gone_message(self, route: Route, exc: _Interrupted) -> str:
        now = self.route
        left = [s.node_id for s in route.stages if now is None or now.index_of(s.node_id) is None]
        who = exc.device or (left[0] if left else None)
        return (f"{'device ' + who if who else 'a device'} of plan {route.plan_version} "
                f"({exc}) and no plan could serve within {self.resume_timeout_s:g}s; retry the request")

    async def _attempt(self, request_id: RequestId, route: Route, prompt_ids: list[int], generated: list[int],
                       max_tokens: int, sampling: SamplingSpec, eos_ids, cuts: Cuts, chunks: int | None,
                       return_topk: int, speculation: SpeculationSession | None = None, typical: bool = False,
                       context_limit: int | None = None, shaping: dict | None = None,
                       keep: SharedPrefix | None = None, fork: SharedPrefix | None = None
                       ) -> AsyncIterator[TokenStep]:
        """One pass on one route: (re-)prefill prompt + generated tokens, then decode."""
        seq = self.keys.next()
        flight = _Flight(request_id, route, seq, asyncio.Queue())
        self._flights[seq] = flight
        first = route.stages[0].node_id
        base = 0  # positions before ours: a forked parent's, read in place
        kept = False
        capacity = len(prompt_ids) + max_tokens
        if speculation is not None:
            capacity += MAX_CANDIDATES + 1
        if context_limit:
            capacity = min(capacity, context_limit)
        fields = dict(request_id=request_id, plan_version=route.plan_version, seq_id=seq,
                      reply_to=self.reply_to, capacity=capacity, sampling=sampling.unshaped(),
                      return_topk=int(return_topk))
        medusa_paths = self.medusa_paths if speculation is not None and speculation.uses_medusa else 0
        try:
            if fork is not None:
                if fork.seq is None or fork.route is None or fork.route.plan_version != route.plan_version:
                    raise PipelineError("the shared prefix is gone (the mesh re-planned); retry the request")
                base = fork.length
                await self._send(first, ForkSequence(route.plan_version, seq, fork.seq, base))
            ids = list(prompt_ids) + generated
            cut_points = cuts(len(ids), route) if callable(cuts) else cuts  # fixed cuts stay valid on a replay
            bounds = chunk_bounds(len(ids), chunks, cut_points)
            for j, (a, b) in enumerate(bounds):
                last = j == len(bounds) - 1
                shape = {**shaping, "history": list(generated)} if shaping and last else {}
                await self._send(first, StageForward(
                    position_offset=base + a, chunk_index=j, token_ids=torch.tensor(ids[a:b], dtype=torch.long),
                    is_last_chunk=last, sample_step=len(generated),
                    medusa_paths=medusa_paths if last else 0, **{**fields, **shape}))
            pos = base + len(ids)
            if speculation is not None:
                async for step in self._speculate(flight, speculation, ids, generated, max_tokens, eos_ids,
                                                  capacity, typical, fields, base):
                    yield step
                return
            work = len(ids)  # the first token waits for the whole prompt's prefill
            while True:
                step, finished = await self._next_step(flight, work)
                work = 1
                token = step.token
                if keep is not None:
                    # Should the caller stop here (or the request end), the stages hold ``pos``
                    # positions (this token is not fed): that is the prefix it keeps.
                    keep.route, keep.seq, keep.length = route, seq, pos
                    kept = True
                yield step  # the caller appends it to ``generated`` before resuming us
                if token in eos_ids or len(generated) >= max_tokens:
                    return
                if finished:  # the grammar is complete: nothing may follow but the end
                    if eos_ids:
                        yield TokenStep(min(eos_ids))
                    return
                kept = False  # feeding another token: what was kept moves on
                await self._send(first, StageForward(
                    position_offset=pos, chunk_index=0, token_ids=torch.tensor([token], dtype=torch.long),
                    is_last_chunk=True, sample_step=len(generated), **fields))
                pos += 1
        finally:
            self._flights.pop(seq, None)
            if not kept:
                if keep is not None:
                    keep.seq = None
                await self._free_surely(route, seq)

    def drafter(self, request_id: RequestId, capacity: int, sampling: SamplingParams, cuts: Cuts = None,
                wait_s: float | None = None) -> "MeshDrafter":
        """Draft through the mesh for a cloud verifier (see :class:`MeshDrafter`); close it when done."""
        if request_id in self._requests:
            raise PipelineError(f"request id {request_id!r} is already running")
        if not sampling.greedy and sampling.seed is None:
            sampling = sampling.with_seed(secrets.randbits(63))
        self._requests.add(request_id)
        return MeshDrafter(self, request_id, capacity, sampling, cuts,
                           self.resume_timeout_s if wait_s is None else wait_s)

    async def release(self, prefix: SharedPrefix) -> None:
        """Free a kept prefix on every stage (its children's own positions are theirs to free)."""
        if prefix.seq is not None and prefix.route is not None:
            seq, prefix.seq = prefix.seq, None
            await self._free_surely(prefix.route, seq)

    async def _speculate(self, flight: _Flight, session: SpeculationSession, ids: list[int],
                         generated: list[int], max_tokens: int, eos_ids, capacity: int, typical: bool,
                         fields: dict, base: int = 0) -> AsyncIterator[TokenStep]:
        """Decode in verify rounds: each sends the root and the drafted tree through every stage at once.

        The previous round's accepted path rides in the next round's header, so every stage
        rolls back its rejected nodes right before it runs the next round.
        """
        first = flight.route.stages[0].node_id
        session.resync(ids)  # a replay re-prefilled exactly prompt + generated
        res = await self._next_result(flight, len(ids))
        commit: tuple[int, list[int]] | None = None
        toks = [int(t) for t in res.token_ids.tolist()]
        session.extend(toks)
        loop = asyncio.get_running_loop()
        while True:
            proposal = self._proposal_of(res, session)
            for t in toks:
                yield TokenStep(t)
                if t in eos_ids or len(generated) >= max_tokens:
                    return
            n = base + len(session.context) - 1  # positions every stage holds (after the pending commit)
            if session.model_drafter is not None:  # a draft model computes: off the event loop
                tree = await loop.run_in_executor(None, session.next_tree, proposal)
            else:
                tree = session.next_tree(proposal)
            tree = tree.truncated(max(0, min(max_tokens - len(generated) - 1, capacity + base - n - 1)))
            t0 = time.monotonic()
            await self._send(first, StageForward(
                position_offset=n, chunk_index=0, token_ids=torch.tensor(tree.tokens, dtype=torch.long),
                is_last_chunk=True, sample_step=len(generated), verify=True,
                tree_parents=None if tree.is_chain else list(tree.parents),
                commit_start=commit[0] if commit else -1, commit_keep=commit[1] if commit else None,
                medusa_paths=self.medusa_paths if session.wants_medusa else 0, typical=typical, **fields))
            ahead = (loop.run_in_executor(None, session.draft_ahead, tree)
                     if session.model_drafter is not None else None)
            try:
                res = await self._next_result(flight)
            finally:
                if ahead is not None:  # never leave the drafter busy with a round we abandon
                    await asyncio.shield(ahead)
            self.round_cost.observe(tree.size, time.monotonic() - t0)
            if res.path is None or not res.path or res.path[0] != 0:
                raise PipelineError("the last stage answered a verify round without an accepted path")
            verdict = Verdict(tuple(res.path), int(res.token_ids[-1]))
            toks = session.commit(tree, verdict)
            if tree.num_candidates:
                self.spec_totals["rounds"] += 1
                self.spec_totals["drafted"] += tree.num_candidates
                self.spec_totals["accepted"] += verdict.accepted
            commit = (n, list(res.path))

    @staticmethod
    def _proposal_of(res: TokenResult, session: SpeculationSession) -> MedusaProposal | None:
        if res.proposals is not None:
            values = res.proposal_values or [0.5 ** len(p) for p in res.proposals]
            return MedusaProposal([list(p) for p in res.proposals], list(values))
        if res.note and session.uses_medusa:  # the heads could not be loaded: go on with what is left
            session.drop_medusa(res.note)
            log.warning("speculation_fallback", reason=res.note, drafter=session.drafter)
        return None

    async def _next_step(self, flight: _Flight, work_tokens: int = 1) -> tuple[TokenStep, bool]:
        item = await self._next_result(flight, work_tokens)
        return TokenStep(int(item.token_ids[0]),
                         item.topk_ids.tolist() if item.topk_ids is not None else None,
                         item.topk_probs.tolist() if item.topk_probs is not None else None), item.finished

    async def _next_result(self, flight: _Flight, work_tokens: int = 1) -> TokenResult:
        """The next result of ``flight``, which was just sent ``work_tokens`` positions to compute.

        The wait is a backstop (a device that leaves is noticed by membership and
        re-planning first), but it must outlast honest work: a 3,600-token prompt
        takes over a minute on a slow device, and a replay after a timeout would
        start it again, for ever. So it grows with the positions in flight.
        """
        wait_s = self.token_timeout_s + max(0, work_tokens - 1) * PREFILL_BUDGET_S_PER_TOKEN
        try:  # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a client's cancel
            async with asyncio.timeout(wait_s):
                item = await flight.queue.get()
        except TimeoutError:
            raise _Interrupted(f"no token from the last stage within {wait_s:g}s") from None
        match item:
            case TokenResult():
                if item.token_ids is None or item.token_ids.ndim != 1 or item.token_ids.numel() == 0:
                    raise PipelineError("the last stage sent a result without tokens")
                return item
            case _Replanned():
                raise _Interrupted(f"the mesh re-planned (plan {item.old} -> {item.new or 'pending'})")
            case _Interrupted():
                raise item
            case ErrorReply() if item.code == "cache_full":
                raise PipelineBusy(f"the mesh is busy: {item.message}; retry shortly")
            case ErrorReply() if item.code == "model_mismatch":
                raise ModelMismatch(f"stage {item.message}")
            case ErrorReply() if item.code in RESUMABLE_CODES:
                # the failed node: said by the stage, or (a 0.2 stage) the "node: text" it reports
                raise _Interrupted(f"stage failed ({item.code}): {item.message}",
                                   item.node or item.message.split(":", 1)[0])
            case ErrorReply():
                raise PipelineError(f"stage failed ({item.code}): {item.message}")
            case Exception():
                raise item
        raise PipelineError(f"unexpected item in a request's queue: {type(item).__name__}")

    async def _free_surely(self, route: Route, seq: SeqKey) -> None:
        """Free even when the caller is being cancelled (a client hanging up is cancelled
        by the HTTP server, sometimes more than once): the free runs as its own task."""
        task = asyncio.get_running_loop().create_task(self._free(route, seq))
        self._freeing.add(task)
        task.add_done_callback(self._freeing.discard)
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            if not task.done():
                log.debug("free_continues_after_cancel", seq=seq)
            raise

    async def _free(self, route: Route, seq: SeqKey) -> None:
        """Release the sequence's cache on every stage (directly: the chain may be broken)."""
        async def one(node_id):
            try:
                peer = await self.links.to(node_id)
                await asyncio.wait_for(peer.send(FreeSequence(route.plan_version, seq),
                                                 timeout=self.send_timeout_s), 2.0)
            except (TransportError, TimeoutError, KeyError) as exc:
                log.info("free_unreachable", node=node_id, seq=seq, error=str(exc))
        await asyncio.gather(*(one(s.node_id) for s in route.stages))


class MeshDrafter:
    """The home's model drafting through the pipeline, one fed step at a time, for a cloud verifier.

    ``feed(tokens, at)`` rolls every stage back to ``at`` positions (riding in the
    message's header, like a verify round's rollback), appends ``tokens`` and returns
    the last stage's proposal for the next token with its distribution on the
    sampler's support and the final layer's attention on the last γ positions. The
    drafter remembers what its cache holds, so when a device leaves it re-prefills
    that on the next plan and carries on: the answer is not failed for it.
    """

    def __init__(self, coord: PipelineCoordinator, request_id: RequestId, capacity: int, sampling: SamplingParams,
                 cuts: Cuts, wait_s: float):
        self.coord = coord
        self.request_id = request_id
        self.capacity = capacity
        self.sampling = sampling
        self.cuts = cuts
        self.wait_s = wait_s
        self.held: list[int] = []  # the tokens in the stages' caches, in order
        self.steps = 0
        self._flight: _Flight | None = None

    async def _open(self) -> _Flight:
        c = self.coord
        route = await c.serving_route(self.wait_s)
        seq = c.keys.next()
        flight = _Flight(self.request_id, route, seq, asyncio.Queue())
        c._flights[seq] = flight
        self._flight = flight
        return flight

    def _fields(self, flight: _Flight) -> dict:
        return dict(request_id=self.request_id, plan_version=flight.route.plan_version, seq_id=flight.seq,
                    reply_to=self.coord.reply_to, capacity=self.capacity, sampling=SamplingSpec(self.sampling),
                    return_topk=SUPPORT_MAX + 1, attention_tail=GAMMA)

    async def feed(self, tokens, at: int) -> DraftStep:
        tokens = [int(t) for t in tokens]
        bad = out_of_vocab(tokens, self.coord.vocab_size)  # checked before any stage sees them
        if bad:
            raise BadTokens(bad)
        if not 0 <= at <= len(self.held):
            raise PipelineError(f"cannot feed at {at}: the drafter holds {len(self.held)} positions")
        for _ in range(3):  # a device leaving: re-prefill what we hold on the next plan and go on
            flight = self._flight or await self._open()
            try:
                return await self._feed(flight, tokens, at)
            except _Interrupted as exc:
                log.info("drafter_replaying", request_id=self.request_id, held=len(self.held), reason=str(exc))
                await self._drop()
                self.coord.resumes += 1
                tokens, at = self.held[:at] + tokens, 0
                self.held = []
        raise PipelineError("the mesh kept re-planning while drafting; retry the request")

    async def _feed(self, flight: _Flight, tokens: list[int], at: int) -> DraftStep:
        first = flight.route.stages[0].node_id
        fields = self._fields(flight)
        rollback = at < len(self.held)
        bounds = chunk_bounds(len(tokens), None, (self.cuts(len(tokens), flight.route) if callable(self.cuts)
                                                  else self.cuts) if at == 0 and len(tokens) > 1 else None)
        for j, (a, b) in enumerate(bounds):
            commit = dict(commit_start=at, commit_keep=[]) if rollback and j == 0 else {}
            await self.coord._send(first, StageForward(
                position_offset=at + a, chunk_index=j, token_ids=torch.tensor(tokens[a:b], dtype=torch.long),
                is_last_chunk=j == len(bounds) - 1, sample_step=self.steps, **commit, **fields))
        self.held = self.held[:at] + tokens
        res = await self.coord._next_result(flight, len(tokens))
        self.steps += 1
        ids = res.topk_ids.tolist() if res.topk_ids is not None else [int(res.token_ids[0])]
        probs = res.topk_probs.tolist() if res.topk_probs is not None else [1.0]
        return draft_step(int(res.token_ids[0]), ids, probs, res.attention)

    async def _drop(self) -> None:
        flight, self._flight = self._flight, None
        if flight is not None:
            self.coord._flights.pop(flight.seq, None)
            await self.coord._free_surely(flight.route, flight.seq)

    async def close(self) -> None:
        try:
            await self._drop()
        finally:
            self.coord._requests.discard(self.request_id)
