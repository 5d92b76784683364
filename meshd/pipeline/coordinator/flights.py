"""The coordinator's sequences in flight: where each one's results go, and freeing them surely.

A flight is one sequence of a request on one route. Results and errors from the
last stage are routed to its queue by sequence key (or, for an error, by
request id); events that end a flight's sequence (a re-plan, a stage's restart,
shutdown) are put in the same queue, so the request's loop meets them in order.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from meshd.log import get_logger
from meshd.pipeline.links import Links
from meshd.pipeline.route import Route
from meshd.pipeline.seqkey import SeqKey, SeqKeys
from meshd.pipeline.coordinator.failures import Interrupted, PipelineError, reply_error
from meshd.pipeline.coordinator.slot import Flight
from partition.ids import RequestId
from transport.errors import TransportError
from transport.messages import ErrorReply
from transport.stage_messages import CacheSequence, FreeSequence, StageProgress, TokenResult

log = get_logger("meshd.coordinator")


#: Only for routes with a stage from a release that does not report its progress
#: (``Cap.PROGRESS``): how long a token of prompt may take there before the stage counts as
#: stuck. Stages that report progress are waited on for as long as they advance.
LEGACY_PREFILL_S_PER_TOKEN = 0.05


@dataclass(frozen=True)
class Replanned:
    """The mesh re-planned under a flight (``new`` None: no plan yet)."""

    old: int
    new: int | None


class FlightTable:
    def __init__(self, keys: SeqKeys, links: Links, send_timeout_s: float):
        self.keys = keys
        self.links = links
        self.send_timeout_s = send_timeout_s
        self._flights: dict[SeqKey, Flight] = {}
        self._freeing: set[asyncio.Task] = set()
        self.progress_heard = 0  # StageProgress messages received (a flight's wait followed them)

    def open(self, request_id: RequestId, route: Route) -> Flight:
        flight = Flight(request_id, route, self.keys.next())
        self._flights[flight.seq] = flight
        return flight

    def forget(self, flight: Flight) -> None:
        """Stop routing results to ``flight`` (its sequence stays on the stages)."""
        self._flights.pop(flight.seq, None)

    async def end(self, flight: Flight, cache: bool = False) -> None:
        """Stop routing results to ``flight`` and free its sequence on every stage (``cache``: every
        stage keeps what it holds as a cached prefix instead)."""
        self.forget(flight)
        await self.free(flight.route, flight.seq, cache)

    def deliver(self, msg: TokenResult | ErrorReply) -> bool:
        """Put a last stage's result (or a stage's error) in its flight's queue; False: none awaits it."""
        flight = self._flights.get(msg.seq_id) if isinstance(msg, TokenResult) or msg.seq_id else None
        if flight is None and isinstance(msg, ErrorReply) and not msg.seq_id:
            # (an error naming a sequence that has ended — a request's earlier attempt, before a re-plan —
            # is late: it must not fail the attempt that replaced it)
            flight = next((f for f in self._flights.values() if f.request_id == msg.request_id), None)
        if flight is None:
            return False
        flight.queue.put_nowait(msg)
        return True

    def progressed(self, msg: StageProgress) -> None:
        """A stage advances on these sequences: their flights' waits start again from now (only a stage
        of the flight's own route speaks for it)."""
        now = asyncio.get_running_loop().time()
        self.progress_heard += 1
        for seq in msg.seq_ids:
            flight = self._flights.get(seq)
            if flight is not None and flight.route.index_of(msg.node_id) is not None:
                flight.progress_at = now

    async def next_result(self, flight: Flight, wait_s: float) -> TokenResult:
        """The next result in ``flight``'s queue; anything else there ends the flight's sequence.

        ``wait_s`` counts from now or from the last word of progress on the flight, whichever is
        later: a stage that keeps advancing is waited for, one that falls silent is not."""
        loop = asyncio.get_running_loop()
        since = loop.time()
        while True:
            try:  # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a client's cancel
                async with asyncio.timeout_at(max(since, flight.progress_at) + wait_s):
                    item = await flight.queue.get()
                break
            except TimeoutError:
                if flight.progress_at + wait_s <= loop.time():
                    raise Interrupted(f"no token and no progress from the stages within {wait_s:g}s") from None
        match item:
            case TokenResult():
                if item.token_ids is None or item.token_ids.ndim != 1 or item.token_ids.numel() == 0:
                    raise PipelineError("the last stage sent a result without tokens")
                return item
            case Replanned():
                raise Interrupted(f"the mesh re-planned (plan {item.old} -> {item.new or 'pending'})")
            case ErrorReply():
                raise reply_error(item)
            case Exception():
                raise item
        raise PipelineError(f"unexpected item in a request's queue: {type(item).__name__}")

    def tell(self, which: Callable[[Flight], bool], event: Callable[[Flight], object]) -> None:
        """Put ``event(flight)`` in the queue of every flight ``which`` selects."""
        for f in list(self._flights.values()):
            if which(f):
                f.queue.put_nowait(event(f))

    async def free(self, route: Route, seq: SeqKey, cache: bool = False) -> None:
        """Free even when the caller is being cancelled (a client hanging up is cancelled
        by the HTTP server, sometimes more than once): the free runs as its own task."""
        task = asyncio.get_running_loop().create_task(self._free(route, seq, cache))
        self._freeing.add(task)
        task.add_done_callback(self._freeing.discard)
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            if not task.done():
                log.debug("free_continues_after_cancel", seq=seq)
            raise

    async def _free(self, route: Route, seq: SeqKey, cache: bool = False) -> None:
        """Release the sequence's cache on every stage (directly: the chain may be broken)."""
        msg = CacheSequence(route.plan_version, seq) if cache else FreeSequence(route.plan_version, seq)

        async def one(node_id):
            try:
                peer = await self.links.to(node_id)
                await asyncio.wait_for(peer.send(msg,
                                                 timeout=self.send_timeout_s), 2.0)
            except (TransportError, TimeoutError, KeyError) as exc:
                log.info("free_unreachable", node=node_id, seq=seq, error=str(exc))
        await asyncio.gather(*(one(s.node_id) for s in route.stages))
