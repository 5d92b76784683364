"""The mesh's inference engine: the client API's requests, run through the pipeline.

The daemon that received a request coordinates it, on the coordinator of the
daemon's serving role (``meshd.pipeline.serving``). Errors are mapped to the API's
vocabulary: no plan within the wait → 503 with Retry-After, a full cache → 503
busy, prompt over the context → 413, a plan for another model than this device
holds → 409 ``model_mismatch``, token ids outside the vocabulary → 400, a request that could not be replayed after a
device left → a clear error naming the device.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable

from decoding.errors import DrafterError
from decoding.offload.policy import GAMMA
from decoding.speculative.session import SpeculationSession
from meshd.engine.errors import BadEngineRequest, BadTokenIds, EngineBusy, GenerationFailed, NoPlan, WrongModel
from meshd.engine.base import Engine, GenerationRequest, Report, TokenStream, model_id_of
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

    supports_penalties = True

    @property
    def supports_constraints(self) -> bool:
        """The grammar library reads the vocabulary from the model's tokenizer.json."""
        return getattr(self.tokenizer, "path", None) is not None

    def speculation_for(self, req: GenerationRequest, context: list[int] | None = None
                        ) -> SpeculationSession | None:
        """The drafting session a request asked for (``auto``: Medusa heads + prompt lookup;
        the adaptive controller sends no candidates where they do not pay)."""
        spec = req.speculative
        if not spec.enabled:
            return None
        if req.sampling.shaped:
            if spec.mode == "on":
                raise BadEngineRequest("speculative decoding cannot be combined with structured output or "
                                       "repetition penalties; use speculative \"auto\" or \"off\"")
            return None  # auto: the grammar / penalties shape every token, plain decoding it is
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

    supports_outline = True

    def outline_for(self, req: GenerationRequest) -> OutlineDecision:
        """Whether to answer in outline mode, decided before any token (``meshd.pipeline.outline.gate``);
        a declined "auto" is counted by its reason."""
        decision = decide_outline(req.outline, req.messages, req.max_tokens, outline_router(),
                                  constrained=req.sampling.constraint is not None,
                                  penalties=req.sampling.penalties.active,
                                  tools=req.tools_offered)
        if not decision.use and decision.reason != "off":
            self.totals.outline.decline(decision.reason)
            log.debug("outline_declined", request_id=req.request_id, reason=decision.reason,
                      detail=decision.detail)
        return decision

    def token_ids(self, req: GenerationRequest) -> TokenStream:
        return TokenStream(lambda report: self._ids(req, report))

    supports_exits = True

    def exits_for(self, req: GenerationRequest) -> float:
        """The early-exit threshold this answer decodes with (0: none).

        Exits are lossy and change what the model says, so they never mix silently
        with what needs the full model's distribution: a verify round, a grammar or
        penalties, an outline's expansions, a cloud verifier. Asked for explicitly
        with one of those, the request is refused; coming from the daemon's default,
        exits step aside for them."""
        explicit = req.exit_threshold is not None
        threshold = float(req.exit_threshold if explicit else self.exit_threshold)
        if threshold <= 0.0:
            return 0.0
        clash = ("structured output or repetition penalties" if req.sampling.shaped else
                 "speculative decoding \"on\"" if req.speculative.mode == "on" else
                 "outline \"on\"" if req.outline == "on" else
                 "a cloud budget" if isinstance(req.cloud, float) else "")
        if clash:
            if explicit:
                raise BadEngineRequest(f"early exits (exit_threshold) cannot be combined with {clash}: they "
                                       f"change the model's distribution; send exit_threshold 0 or drop {clash}")
            return 0.0
        if not explicit and self.cloud_for(req):  # a paired verifier's answer is the big model's
            return 0.0
        if self.coordinator.exits_available() is False:  # the serving routes' last stages check none
            if explicit:
                raise BadEngineRequest("early exits are not available in this home: the last stage has no exit "
                                       "heads for this model ('meshd status' says why); send exit_threshold 0")
            return 0.0
        return threshold

    async def _ids(self, req: GenerationRequest, report: Report) -> AsyncIterator[int]:
        # aclosing: a caller that stops early closes the inner generator now, so its bookkeeping
        # (speculation stats for usage, the outline's shared prefix) is done before usage is read
        exit_threshold = self.exits_for(req)
        if exit_threshold > 0:  # a plain answer whose confident tokens may leave the model early
            inner = self._plain_ids(req, report, exit_threshold)
        elif self.cloud_for(req):
            inner = self._cloud_ids(req, report)
        else:
            decision = self.outline_for(req)
            inner = self._outline_ids(req, decision, report) if decision.use else self._plain_ids(req, report)
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

    supports_cloud = True  # the request's "cloud" field is honoured (or refused when not paired)

    def cloud_for(self, req: GenerationRequest) -> bool:
        """Whether a paired cloud verifier checks this answer's hard chunks (``cloud``: "auto" uses it
        when paired at the daemon's budget; a number sets the budget; "off" never)."""
        if req.cloud == "off":
            return False
        if self.cloud is None:
            if req.cloud not in ("auto", None):
                raise BadEngineRequest("this device is not paired with a cloud verifier "
                                       "(run 'meshd cloud pair ADDRESS TOKEN')")
            return False
        if req.sampling.shaped:
            if req.cloud not in ("auto", None):
                raise BadEngineRequest("cloud verification cannot be combined with structured output or "
                                       "repetition penalties")
            return False
        budget = self.cloud.budget if not isinstance(req.cloud, float) else req.cloud
        return budget > 0.0

    async def _cloud_ids(self, req: GenerationRequest, report: Report) -> AsyncIterator[int]:
        cloud = self.cloud  # the home may unpair or re-pair meanwhile: this answer keeps its verifier's link
        # unshaped: a cloud-verified answer has no penalties or grammar
        sampling, draft_sampling = cloud.samplings(req.sampling.params)
        capacity = min(len(req.prompt_ids) + req.max_tokens + 3 * GAMMA + 2, self.context_length)
        drafter = self.coordinator.drafter(req.request_id, capacity, draft_sampling, cuts=self.cuts_for,
                                           wait_s=self.wait_s)
        budget = req.cloud if isinstance(req.cloud, float) else None
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
                           report: Report) -> AsyncIterator[int]:
        totals = self.totals.outline
        totals.attempt()
        stats = OutlineStats()
        sessions: list[SpeculationSession] = []  # the points' branches: counted when the answer ends

        def speculation(ids: list[int]) -> SpeculationSession | None:
            session = self.speculation_for(req, ids)
            if session is not None:
                sessions.append(session)
            return session

        decoder = OutlineDecoder(self.coordinator, self.tokenizer, self.eos_ids, self.wait_s,
                                 speculation=speculation if req.speculative.enabled else None)
        log.info("outline_attempt", request_id=req.request_id, mode=req.outline, reason=decision.reason,
                 detail=decision.detail, max_tokens=req.max_tokens)
        stream = await decoder.run(req.request_id, req.messages, req.max_tokens, req.sampling, stats,
                                   cuts=self.cuts_for)
        report(outline=stats.to_dict())
        if stream is None:  # no usable outline: the plain answer it is (the outline's time is lost)
            totals.fall_back(stats.fallback_reason)
            log.warning("outline_fallback", request_id=req.request_id, reason=stats.fallback_reason,
                        detail=stats.fallback, outline_tokens=stats.outline_tokens)
            stream = self._plain_ids(req, report)
        else:
            totals.use(stats.points)
        try:
            async with contextlib.aclosing(stream) as ids:
                async for t in ids:
                    yield t
        finally:
            for session in sessions:
                self.totals.speculative.add(session.stats())

    async def _plain_ids(self, req: GenerationRequest, report: Report,
                         exit_threshold: float = 0.0) -> AsyncIterator[int]:
        session = self.speculation_for(req) if exit_threshold <= 0 else None
        reported = False  # a replayed request reports what its first attempt reused
        exits = ExitCount(exit_threshold) if exit_threshold > 0 else None
        try:
            async for step in self.coordinator.steps(StepsRequest(
                    req.request_id, list(req.prompt_ids), req.max_tokens, req.sampling, self.eos_ids,
                    cuts=self.cuts_for, wait_s=self.wait_s, speculation=session, typical=req.speculative.typical,
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
