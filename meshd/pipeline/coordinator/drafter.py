"""The home's model drafting through the pipeline for a cloud verifier, one fed step at a time.

It is a client of the coordinator's public interface (open a flight, send,
wait for the next result, end the flight), like a request's own loop.
"""

from __future__ import annotations

import torch

from decoding.offload.loop import SUPPORT_MAX, DraftStep, draft_step
from decoding.offload.policy import GAMMA
from decoding.pipeline_local import chunk_bounds
from decoding.sampling import SamplingParams, SamplingSpec
from meshd.engine.errors import out_of_vocab
from meshd.log import get_logger
from meshd.pipeline.coordinator.failures import BadTokens, Interrupted, PipelineError, PrefixMiss
from meshd.pipeline.coordinator.slot import Cuts, Flight
from partition.ids import RequestId
from transport.stage_messages import StageForward

log = get_logger("meshd.coordinator")


class MeshDrafter:
    """``feed(tokens, at)`` rolls every stage back to ``at`` positions (riding in the
    message's header, like a verify round's rollback), appends ``tokens`` and returns
    the last stage's proposal for the next token with its distribution on the
    sampler's support and the final layer's attention on the last γ positions. The
    drafter remembers what its cache holds, so when a device leaves it re-prefills
    that on the next plan and carries on: the answer is not failed for it.
    """

    def __init__(self, coord, request_id: RequestId, capacity: int, sampling: SamplingParams,
                 cuts: Cuts, wait_s: float):
        """``coord``: the :class:`~meshd.pipeline.coordinator.service.PipelineCoordinator` that admitted it."""
        self.coord = coord
        self.request_id = request_id
        self.capacity = capacity
        self.sampling = sampling
        self.cuts = cuts
        self.wait_s = wait_s
        self.held: list[int] = []  # the tokens in the stages' caches, in order
        self.steps = 0
        self.flight: Flight | None = None
        self.reuse = True  # may start on the stages' cached prefix (False once a stage missed it)
        self.caches = False  # every stage of the flight keeps prefixes: leave ours in their caches
        self.settled = False  # the last feed's result came back: the stages hold exactly ``held``

    async def feed(self, tokens, at: int) -> DraftStep:
        tokens = [int(t) for t in tokens]
        bad = out_of_vocab(tokens, self.coord.vocab_size)  # checked before any stage sees them
        if bad:
            raise BadTokens(bad)
        if not 0 <= at <= len(self.held):
            raise PipelineError(f"cannot feed at {at}: the drafter holds {len(self.held)} positions")
        for _ in range(3):  # a device leaving: re-prefill what we hold on the next plan and go on
            if self.flight is None:
                self.flight = self.coord.open_flight(self.request_id, await self.coord.serving_route(self.wait_s))
            try:
                return await self._feed(self.flight, tokens, at)
            except PrefixMiss:
                self.reuse = False
                await self._drop()
                tokens, at = self.held[:at] + tokens, 0
                self.held = []
                continue
            except Interrupted as exc:
                log.info("drafter_replaying", request_id=self.request_id, held=len(self.held), reason=str(exc))
                await self._drop()
                self.coord.note_replay()
                tokens, at = self.held[:at] + tokens, 0
                self.held = []
        raise PipelineError("the mesh kept re-planning while drafting; retry the request")

    def _fields(self, flight: Flight) -> dict:
        return dict(request_id=self.request_id, plan_version=flight.route.plan_version, seq_id=flight.seq,
                    reply_to=self.coord.reply_to, capacity=self.capacity, sampling=SamplingSpec(self.sampling),
                    return_topk=SUPPORT_MAX + 1, attention_tail=GAMMA)

    async def _feed(self, flight: Flight, tokens: list[int], at: int) -> DraftStep:
        first = flight.route.stages[0].node_id
        fields = self._fields(flight)
        self.settled = False
        rollback = at < len(self.held)
        skip = 0  # leading tokens the stages' prefix caches already hold (a fresh sequence's prompt)
        try:  # however this ends (a hang-up, a send that fails), a request waiting for our prefill goes on
            if at == 0 and not self.held and len(tokens) > 1:
                skip, self.caches = await self.coord.prefixes.start(
                    self.request_id, flight.route, flight.seq, tokens, self.capacity, self.coord.send,
                    self.coord.reply_to, allowed=self.reuse)
            rest = tokens[skip:]
            bounds = chunk_bounds(len(rest), None, (self.cuts(len(rest), flight.route) if callable(self.cuts)
                                                    else self.cuts) if at == 0 and len(rest) > 1 else None)
            for j, (a, b) in enumerate(bounds):
                commit = dict(commit_start=at, commit_keep=[]) if rollback and j == 0 else {}
                await self.coord.send(first, StageForward(
                    position_offset=at + skip + a, chunk_index=j,
                    token_ids=torch.tensor(rest[a:b], dtype=torch.long),
                    is_last_chunk=j == len(bounds) - 1, sample_step=self.steps, **commit, **fields))
            self.held = self.held[:at] + tokens
            res = await self.coord.next_result(flight, len(rest))
        finally:
            self.coord.prefixes.prefilled(self.request_id)
        self.steps += 1
        self.settled = True
        ids = res.topk_ids.tolist() if res.topk_ids is not None else [int(res.token_ids[0])]
        probs = res.topk_probs.tolist() if res.topk_probs is not None else [1.0]
        return draft_step(int(res.token_ids[0]), ids, probs, res.attention)

    async def _drop(self, cache: bool = False) -> None:
        flight, self.flight = self.flight, None
        if flight is not None:
            await self.coord.end_flight(flight, cache and self.caches and self.settled)

    async def close(self) -> None:
        """The answer is done: what the stages hold of it (any fed tokens' KV is valid for those
        tokens) stays in their prefix caches for the next request, unless a feed was cut short."""
        try:
            await self._drop(cache=True)
        finally:
            self.coord.discharge(self.request_id)
