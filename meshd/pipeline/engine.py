"""The mesh's inference engine: the client API's requests, run through the pipeline.

The daemon that received a request coordinates it, on the coordinator of the
daemon's serving role (``meshd.pipeline.serving``). Errors are mapped to the API's
vocabulary: no plan within the wait → 503 with Retry-After, a full cache → 503
busy, prompt over the context → 413, a plan for another model than this device
holds → 409 ``model_mismatch``, token ids outside the vocabulary → 400, a request that could not be replayed after a
device left → a clear error naming the device.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

from decoding.errors import DrafterError
from decoding.offload.policy import GAMMA
from decoding.speculative.session import SpeculationSession
from meshd.engine.base import Engine, GenerationRequest, Report, TokenStream, model_id_of
from meshd.engine.modes import Ask, Mode, Resolution, resolve
from meshd.engine.options import Capabilities
from meshd.engine.errors import BadEngineRequest, BadTokenIds, EngineBusy, GenerationFailed, NoPlan, WrongModel
from meshd.log import get_logger
from meshd.pipeline.coordinator.cuts import default_cuts
from meshd.pipeline.coordinator.failures import BadTokens, ModelMismatch, NoRoute, PipelineBusy, PipelineError
from meshd.pipeline.coordinator.service import PipelineCoordinator
from meshd.pipeline.coordinator.slot import StepsRequest
from meshd.pipeline.outline.decoder import OutlineDecoder, OutlineStats
from meshd.pipeline.outline.gate import OutlineDecision, decide as decide_outline
from meshd.pipeline.outline.router import shipped as outline_router
from meshd.pipeline.route import Route
from meshd.pipeline.totals import DecodingTotals, ExitCount

log = get_logger("meshd.pipeline.engine")

DEFAULT_WAIT_S = 45.0  # how long a request waits for a plan (start-up, re-plan, device left)


class PipelineEngine(Engine):
    def __init__(self, source, coordinator: PipelineCoordinator,
                 cuts_for: Callable[[int, Route], list[int]] | None = None, wait_s: float = DEFAULT_WAIT_S,
                 draft_model: Callable[[], object] | None = None, cloud=None, exit_threshold: float = 0.0):
        """``draft_model()``: a ModelDrafter for this request (a draft model loaded on this device),
        or raises DrafterError; None when no draft model is configured. ``cloud``: a
        :class:`meshd.cloud.home.CloudHome` when this device is paired with a cloud verifier.
        ``exit_threshold``: early exits for requests that do not say (0: off, the default)."""
        self.source = source
        self.exit_threshold = float(exit_threshold or 0.0)
        self.cloud = cloud
        self.draft_model = draft_model
        self.tokenizer = source.tokenizer
        self.model_id = model_id_of(source)
        self.vocab_size = source.config.vocab_size  # bounds every prompt's ids (Engine.check_prompt)
        self.context_length = source.config.max_position
        self.coordinator = coordinator
        self.cuts_for = cuts_for or (lambda n, route: default_cuts(n, len(route.stages)))
        self.wait_s = wait_s
        self.totals = DecodingTotals()  # meshd status: what every request here speculated and outlined
        outline_router()  # read the router's weights now, not on the first request (a quarter second)

    @property
    def in_flight(self) -> int:
        return self.coordinator.in_flight

    @property
    def capabilities(self) -> Capabilities:
        """All of them; grammars where the model has a tokenizer.json (the grammar library reads its
        vocabulary there). A cloud budget is refused later when the device is not paired."""
        return Capabilities(constraints=getattr(self.tokenizer, "path", None) is not None, penalties=True,
                            outline=True, cloud=True, exits=True)

    def modes_for(self, req: GenerationRequest) -> Resolution:
        """Which decoding modes this answer combines: what it asks, as far as this engine has it now (a
        paired verifier, a serving route whose last stage checks exits), through ``meshd.engine.modes``.
        Raises :class:`BadEngineRequest` for what was asked explicitly and cannot be had."""
        o = req.options
        threshold, explicit = self._exit_threshold(req)
        exits = Ask.OFF if threshold <= 0.0 else Ask.ON if explicit else Ask.AUTO
        available = self.coordinator.exits_available() if exits is not Ask.OFF else None
        if exits is Ask.AUTO and available is False:  # the serving routes' last stages check none
            exits = Ask.OFF
        modes = resolve({
            Mode.SHAPED: Ask.ON if o.sampling.shaped else Ask.OFF,
            Mode.TOOLS: Ask.ON if o.tools_offered else Ask.OFF,
            Mode.SPECULATIVE: Ask(o.speculative.mode),
            Mode.OUTLINE: Ask(o.outline),
            Mode.CLOUD: self._cloud_ask(req),
            Mode.EXITS: exits,
        })
        if Mode.EXITS in modes.runs and available is False:
            raise BadEngineRequest("early exits are not available in this home: the last stage has no exit "
                                   "heads for this model ('meshd status' says why); send exit_threshold 0")
        if Mode.CLOUD in modes.runs and self.cloud is None:
            raise BadEngineRequest("this device is not paired with a cloud verifier "
                                   "(run 'meshd cloud pair ADDRESS TOKEN')")
        return modes

    def _exit_threshold(self, req: GenerationRequest) -> tuple[float, bool]:
        """(the early-exit threshold this answer would decode with, whether the request set it)."""
        asked = req.options.exit_threshold
        return float(asked if asked is not None else self.exit_threshold), asked is not None

    def _cloud_ask(self, req: GenerationRequest) -> Ask:
        """A paired cloud verifier checks this answer's hard chunks: "auto" at the daemon's budget (when
        paired), a number sets the budget (asked for: refused when not paired), "off" never; a budget
        of 0 checks nothing."""
        cloud = req.options.cloud
        if isinstance(cloud, float):
            return Ask.ON if cloud > 0.0 else Ask.OFF
        if cloud == "off" or self.cloud is None or self.cloud.budget <= 0.0:
            return Ask.OFF
        return Ask.AUTO

    def exits_for(self, req: GenerationRequest) -> float:
        """The early-exit threshold this answer decodes with (0: none). Exits are lossy: the modes
        table has them give way to (or refused with) what needs the full model's distribution."""
        return self._exit_threshold(req)[0] if Mode.EXITS in self.modes_for(req).runs else 0.0

    def speculation_for(self, req: GenerationRequest, context: list[int] | None = None
                        ) -> SpeculationSession:
        """The drafting session of an answer that speculates (``auto``: Medusa heads + prompt lookup;
        the adaptive controller sends no candidates where they do not pay)."""
        spec = req.options.speculative
        if spec.typical and req.options.sampling.shaped:
            raise BadEngineRequest("speculative.typical cannot be combined with a grammar or penalties: typical "
                                   "acceptance does not keep their distribution; leave typical out")
        drafter = spec.drafter or "auto"
        model_drafter = None
        if drafter == "draft_model":
            if self.draft_model is None:
                raise BadEngineRequest("speculative drafter \"draft_model\" needs a draft model on this "
                                       "device (set draft_model in the daemon's config)")
            try:
                model_drafter = self.draft_model()
            except DrafterError as exc:
                raise BadEngineRequest(str(exc)) from exc
        return SpeculationSession(drafter, list(req.prompt_ids if context is None else context),
                                  cost=self.coordinator.round_cost,
                                  fixed=spec.max_candidates, model_drafter=model_drafter)

    async def _draft_under_grammar(self, session: SpeculationSession, req: GenerationRequest) -> None:
        """Give ``session`` its own copy of the request's grammar, so it drafts what the grammar forces
        and cuts drafts it refuses. Built off the event loop: the grammar engine's first look at a
        vocabulary takes a second on a device that does not sample (later ones, milliseconds)."""
        from decoding.constrained import constraint_for

        try:
            grammar = await asyncio.get_running_loop().run_in_executor(
                None, constraint_for, req.options.sampling.constraint, self.tokenizer, self.vocab_size)
        except Exception as exc:  # noqa: BLE001 - optional: the last stage still masks every row it verifies
            log.warning("grammar_drafting_unavailable", request_id=req.request_id,
                        error=f"{type(exc).__name__}: {exc}")
            return
        session.follow_grammar(grammar, self.tokenizer.eos_ids)

    def outline_for(self, req: GenerationRequest, modes: Resolution) -> OutlineDecision:
        """Whether to answer in outline mode, decided before any token (``meshd.pipeline.outline.gate``);
        a declined "auto" is counted by its reason."""
        o = req.options
        decision = decide_outline(o.outline, req.messages, req.max_tokens, outline_router(),
                                  gave_way_to=modes.gave_way.get(Mode.OUTLINE))
        if not decision.use and decision.reason != "off":
            self.totals.outline.decline(decision.reason)
            log.debug("outline_declined", request_id=req.request_id, reason=decision.reason,
                      detail=decision.detail)
        return decision

    def token_ids(self, req: GenerationRequest) -> TokenStream:
        return TokenStream(lambda report: self._ids(req, report))

    async def _ids(self, req: GenerationRequest, report: Report) -> AsyncIterator[int]:
        # aclosing: a caller that stops early closes the inner generator now, so its bookkeeping
        # (speculation stats for usage, the outline's shared prefix) is done before usage is read
        modes = self.modes_for(req)
        speculate = Mode.SPECULATIVE in modes.runs
        if Mode.EXITS in modes.runs:  # a plain answer whose confident tokens may leave the model early
            inner = self._plain_ids(req, report, exit_threshold=self._exit_threshold(req)[0])
        elif Mode.CLOUD in modes.runs:
            inner = self._cloud_ids(req, report)
        else:
            decision = self.outline_for(req, modes)
            inner = (self._outline_ids(req, decision, report, speculate) if decision.use
                     else self._plain_ids(req, report, speculate))
        try:
            async with contextlib.aclosing(inner) as ids:
                async for t in ids:
                    yield t
        except NoRoute as exc:
            raise NoPlan(str(exc), retry_after_s=5.0) from exc
        except PipelineBusy as exc:
            raise EngineBusy(str(exc), retry_after_s=exc.retry_after_s) from exc
        except ModelMismatch as exc:
            raise WrongModel(str(exc)) from exc
        except BadTokens as exc:
            raise BadTokenIds(str(exc)) from exc
        except PipelineError as exc:
            raise GenerationFailed(str(exc)) from exc

    async def _cloud_ids(self, req: GenerationRequest, report: Report) -> AsyncIterator[int]:
        cloud = self.cloud  # the home may unpair or re-pair meanwhile: this answer keeps its verifier's link
        # unshaped: a cloud-verified answer has no penalties or grammar
        sampling, draft_sampling = cloud.samplings(req.options.sampling.params)
        capacity = min(len(req.prompt_ids) + req.max_tokens + 3 * GAMMA + 2, self.context_length)
        drafter = self.coordinator.drafter(req.request_id, capacity, draft_sampling, cuts=self.cuts_for,
                                           wait_s=self.wait_s)
        budget = req.options.cloud if isinstance(req.options.cloud, float) else None
        decoder = cloud.decoder(drafter, sampling, self.eos_ids, budget)
        n = 0
        try:
            async for t in decoder.run(list(req.prompt_ids), req.max_tokens):
                n += 1
                yield t
        finally:
            cloud.record(decoder.stats, n)
            report(cloud=decoder.stats.to_dict())
            await drafter.close()

    async def _outline_ids(self, req: GenerationRequest, decision: OutlineDecision,
                           report: Report, speculate: bool) -> AsyncIterator[int]:
        totals = self.totals.outline
        totals.attempt()
        stats = OutlineStats()
        sessions: list[SpeculationSession] = []  # the points' branches: counted when the answer ends

        def speculation(ids: list[int]) -> SpeculationSession:
            session = self.speculation_for(req, ids)
            sessions.append(session)
            return session

        decoder = OutlineDecoder(self.coordinator, self.tokenizer, self.eos_ids, self.wait_s,
                                 speculation=speculation if speculate else None)
        log.info("outline_attempt", request_id=req.request_id, mode=req.options.outline, reason=decision.reason,
                 detail=decision.detail, max_tokens=req.max_tokens)
        stream = await decoder.run(req.request_id, req.messages, req.max_tokens, req.options.sampling, stats,
                                   cuts=self.cuts_for)
        report(outline=stats.to_dict())
        if stream is None:  # no usable outline: the plain answer it is (the outline's time is lost)
            totals.fall_back(stats.fallback_reason)
            log.warning("outline_fallback", request_id=req.request_id, reason=stats.fallback_reason,
                        detail=stats.fallback, outline_tokens=stats.outline_tokens)
            stream = self._plain_ids(req, report, speculate)
        else:
            totals.use(stats.points)
        try:
            async with contextlib.aclosing(stream) as ids:
                async for t in ids:
                    yield t
        finally:
            for session in sessions:
                self.totals.speculative.add(session.stats())

    async def _plain_ids(self, req: GenerationRequest, report: Report, speculate: bool = False,
                         exit_threshold: float = 0.0) -> AsyncIterator[int]:
        session = self.speculation_for(req) if speculate else None
        if session is not None and req.options.sampling.constraint is not None:
            await self._draft_under_grammar(session, req)
        reported = False  # a replayed request reports what its first attempt reused
        exits = ExitCount(exit_threshold) if exit_threshold > 0 else None
        try:
            async for step in self.coordinator.steps(StepsRequest(
                    req.request_id, list(req.prompt_ids), req.max_tokens, req.options.sampling, self.eos_ids,
                    cuts=self.cuts_for, wait_s=self.wait_s, speculation=session,
                    typical=req.options.speculative.typical,
                    context_limit=self.context_length, exit_threshold=exit_threshold)):
                if step.cached is not None and not reported:
                    report(cached_tokens=step.cached)
                    reported = True
                if exits is not None:
                    exits.add(step.exit_layer)
                yield step.token
        finally:
            if exits is not None:
                self.totals.exits.add(exits)
                report(exits=exits.to_dict())
            if session is not None:
                self.totals.speculative.add(session.stats())
                report(speculative=session.stats())
                if session.model_drafter is not None:
                    session.model_drafter.close()
