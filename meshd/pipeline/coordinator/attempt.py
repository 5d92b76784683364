"""One attempt of a request: a fresh sequence on one route, prefilled, then decoded.

A request outlives its sequences: when one is lost the coordinator's loop
(:mod:`.service`) replays the request as a new attempt. An attempt schedules the
prefill — prompt + tokens generated so far, started on what the stages' prefix
caches hold or on a forked parent's positions, cut into chunks sent back to back
into the first stage — then feeds each sampled token back (or runs verify rounds,
:mod:`.verify_rounds`), and when it ends frees its sequence on every stage, leaves
it in their prefix caches, or keeps it for children to fork from.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

import torch

from decoding.pipeline_local import chunk_bounds
from meshd.pipeline.coordinator.cuts import decoded_runs
from meshd.pipeline.coordinator.failures import PipelineError
from meshd.pipeline.coordinator.slot import RequestSlot, SlotState, TokenStep
from meshd.pipeline.coordinator.verify_rounds import verify_rounds
from meshd.pipeline.route import Route
from transport.stage_messages import ForkSequence, StageForward


async def attempt(coord, slot: RequestSlot, route: Route) -> AsyncIterator[TokenStep]:
    """One pass of ``slot``'s request on ``route``: (re-)prefill prompt + generated tokens, then decode.

    ``coord`` is the :class:`~meshd.pipeline.coordinator.service.PipelineCoordinator` (its public
    send / next_result / flights / prefixes). The prompt starts on what every stage already holds
    of it (``reuse`` positions, see :class:`~meshd.pipeline.coordinator.prefix_reuse.PrefixReuse`);
    only the rest is prefilled. A request that ends well leaves its sequence in the stages' prefix
    caches for the next one."""
    request, speculation, keep, fork = slot.request, slot.request.speculation, slot.request.keep, \
        slot.request.fork
    flight = slot.flight = coord.open_flight(slot.request_id, route)
    slot.state = SlotState.RUNNING
    seq, first = flight.seq, route.stages[0].node_id
    base = 0  # positions before ours: a forked parent's, read in place
    kept = completed = caches = False
    fields = dict(request_id=slot.request_id, plan_version=route.plan_version, seq_id=seq,
                  reply_to=coord.reply_to, capacity=slot.capacity(), sampling=slot.sampling.unshaped(),
                  return_topk=int(request.return_topk),
                  exit_threshold=float(request.exit_threshold) if coord.table.exits_on(route) else 0.0)
    medusa_paths = coord.medusa_paths if speculation is not None and speculation.uses_medusa else 0
    ids = slot.context
    try:
        if fork is not None:
            if fork.seq is None or fork.route is None or fork.route.key != route.key:
                raise PipelineError("the shared prefix is gone (the mesh re-planned); retry the request")
            base = fork.length
            await coord.send(first, ForkSequence(route.plan_version, seq, fork.seq, base))
            reuse = 0
        else:
            # of the prompt only: a replay's generated tokens were decode steps, never a cached prompt's rows
            reuse, caches = await coord.prefixes.start(
                slot.request_id, route, seq, ids[:len(request.prompt_ids)], slot.capacity(), coord.send,
                coord.reply_to, allowed=slot.reuse)
            caches = caches and keep is None
        prefill = ids[reuse:]
        bounds = prefill_bounds(request, route, base + reuse, base + len(request.prompt_ids), base + len(ids))
        for j, (a, b) in enumerate(bounds):
            last = j == len(bounds) - 1
            shape = slot.shaping() if last else {}
            await coord.send(first, StageForward(
                position_offset=base + reuse + a, chunk_index=j,
                token_ids=torch.tensor(prefill[a:b], dtype=torch.long), is_last_chunk=last,
                sample_step=len(slot.generated), medusa_paths=medusa_paths if last else 0,
                **{**fields, **shape}))
        pos = base + len(ids)
        if speculation is not None:
            first_step = True
            async for step in verify_rounds(coord, slot, speculation, fields, base):
                if first_step:
                    coord.prefixes.prefilled(slot.request_id)
                    step, first_step = dataclasses.replace(step, cached=reuse), False
                completed = True  # a caller that stops here ends it well (stages keep verified positions)
                yield step
                completed = False
            completed = True
            return
        work = len(prefill)  # the first token waits for the whole prompt's prefill
        while True:
            result = await coord.next_result(flight, work)
            step, finished = TokenStep.of(result), result.finished
            if work == len(prefill):
                coord.prefixes.prefilled(slot.request_id)
                step = dataclasses.replace(step, cached=reuse)
            work = 1
            token = step.token
            if keep is not None:
                # Should the caller stop here (or the request end), the stages hold ``pos``
                # positions (this token is not fed): that is the prefix it keeps.
                keep.route, keep.seq, keep.length = route, seq, pos
                kept = True
            completed = True  # a caller that stops here ends the request well
            yield step  # the caller appends it to ``slot.generated`` before resuming us
            if slot.ends_with(token):
                return
            if finished:  # the grammar is complete: nothing may follow but the end
                for end in slot.grammar_end():
                    yield end
                return
            kept = completed = False  # feeding another token: what was kept moves on
            await coord.send(first, StageForward(
                position_offset=pos, chunk_index=0, token_ids=torch.tensor([token], dtype=torch.long),
                is_last_chunk=True, sample_step=len(slot.generated), **fields))
            pos += 1
    finally:
        coord.prefixes.prefilled(slot.request_id)
        slot.flight = None
        if kept:
            coord.flights.forget(flight)
        else:
            if keep is not None:
                keep.seq = None
            await coord.flights.end(flight, cache=caches and completed)


def prefill_bounds(request, route: Route, start: int, prompt_end: int, end: int) -> list[tuple[int, int]]:
    """The chunks, relative to ``start``, of an attempt's prefill of positions ``[start, end)``: the prompt's
    rest cut as the request cuts it (fixed cuts stay valid on a replay), then the tokens generated before
    a replay cut so that each row is computed as the decode step that made it was (:func:`decoded_runs`):
    the replayed answer goes on exactly as one device's would have, in an exact mode too."""
    head = prompt_end - start
    cuts = request.cuts
    bounds = chunk_bounds(head, request.chunks, cuts(head, route) if callable(cuts) else cuts)
    return bounds + [(a - start, b - start) for a, b in decoded_runs(prompt_end, end)]
