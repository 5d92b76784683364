"""Speculative decoding through the mesh: verify rounds drafted on the coordinator.

Each round sends the root and the drafted tree through every stage at once; the
last stage verifies and answers with the accepted path. The previous round's
accepted path rides in the next round's header, so every stage rolls back its
rejected nodes right before it runs the next round.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import torch

from decoding.speculative.session import MedusaProposal, SpeculationSession
from decoding.speculative.verify import Verdict
from meshd.log import get_logger
from meshd.pipeline.coordinator.failures import PipelineError
from meshd.pipeline.coordinator.slot import RequestSlot, TokenStep
from transport.stage_messages import StageForward, TokenResult

log = get_logger("meshd.coordinator")


async def verify_rounds(coord, slot: RequestSlot, session: SpeculationSession, fields: dict,
                        base: int = 0) -> AsyncIterator[TokenStep]:
    """Tokens of ``slot`` decoded in verify rounds; its prompt + generated tokens were just sent.

    ``coord`` is the :class:`~meshd.pipeline.coordinator.service.PipelineCoordinator` (its public
    send / next_result); ``base``: positions before ours (a forked parent's).
    """
    flight = slot.flight
    first = flight.route.stages[0].node_id
    ids = slot.context
    capacity = fields["capacity"]
    session.resync(ids)  # a replay re-prefilled exactly prompt + generated
    res = await coord.next_result(flight, len(ids))
    commit: tuple[int, list[int]] | None = None
    toks = [int(t) for t in res.token_ids.tolist()]
    session.extend(toks)
    loop = asyncio.get_running_loop()
    while True:
        proposal = proposal_of(res, session)
        for t in toks:
            yield TokenStep(t)  # the coordinator appends it to ``slot.generated`` before resuming us
            if slot.ends_with(t):
                return
        if res.finished:  # the grammar is complete: nothing may follow but the end
            for end in slot.grammar_end():
                yield end
            return
        n = base + len(session.context) - 1  # positions every stage holds (after the pending commit)
        if session.model_drafter is not None:  # a draft model computes: off the event loop
            tree = await loop.run_in_executor(None, session.next_tree, proposal)
        else:
            tree = session.next_tree(proposal)
        left = slot.request.max_tokens - len(slot.generated)
        tree = tree.truncated(max(0, min(left - 1, capacity + base - n - 1)))
        t0 = time.monotonic()
        await coord.send(first, StageForward(
            position_offset=n, chunk_index=0, token_ids=torch.tensor(tree.tokens, dtype=torch.long),
            is_last_chunk=True, sample_step=len(slot.generated), verify=True,
            tree_parents=None if tree.is_chain else list(tree.parents),
            commit_start=commit[0] if commit else -1, commit_keep=commit[1] if commit else None,
            medusa_paths=coord.medusa_paths if session.wants_medusa else 0, typical=slot.request.typical,
            **fields))
        ahead = (loop.run_in_executor(None, session.draft_ahead, tree)
                 if session.model_drafter is not None else None)
        try:
            res = await coord.next_result(flight)
        finally:
            if ahead is not None:  # never leave the drafter busy with a round we abandon
                await asyncio.shield(ahead)
        coord.round_cost.observe(tree.size, time.monotonic() - t0)
        if res.path is None or not res.path or res.path[0] != 0:
            raise PipelineError("the last stage answered a verify round without an accepted path")
        verdict = Verdict(tuple(res.path), int(res.token_ids[-1]))
        toks = session.commit(tree, verdict)
        commit = (n, list(res.path))


def proposal_of(res: TokenResult, session: SpeculationSession) -> MedusaProposal | None:
    """The Medusa heads' proposal riding in ``res`` (None: none, or the heads are gone)."""
    if res.proposals is not None:
        values = res.proposal_values or [0.5 ** len(p) for p in res.proposals]
        return MedusaProposal([list(p) for p in res.proposals], list(values))
    if res.note and session.uses_medusa:  # the heads could not be loaded: go on with what is left
        session.drop_medusa(res.note)
        log.warning("speculation_fallback", reason=res.note, drafter=session.drafter)
    return None
