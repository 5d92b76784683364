"""The coordinator's side of the stages' prefix caches: how much of a prompt a request reuses.

Every stage keeps finished requests' KV keyed on exact token ids
(:mod:`meshd.pipeline.stage.prefix_cache`), but each evicts on its own, so the
coordinator *asks* before a request starts: a ``PrefixProbe`` to every stage of
the route at once, and the request reuses the shortest answer (what every
stage holds), at most all but the prompt's last token (its logits must be
computed). It then sends ``ReusePrefix`` down the chain ahead of the first
chunk; a stage that evicted the prefix meanwhile answers ``prefix_miss``, and
the request is prefilled in full on a fresh sequence — never a silent mismatch.

Two requests that share a long prefix and arrive together (two people asking
at once, Home Assistant's parallel agents) would both compute it. So a request
whose prompt shares at least ``MIN_SHARED`` more tokens than the stages hold
with one that started prefilling here before it waits for that prefill
(bounded), then asks again and forks from it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import torch

from meshd.log import get_logger
from meshd.pipeline.links import Links
from meshd.pipeline.route import Route
from partition.ids import RequestId
from transport.errors import TransportError
from transport.stage_messages import PrefixMatch, PrefixProbe, ReusePrefix

log = get_logger("meshd.coordinator")

__all__ = ["MIN_REUSE", "MIN_SHARED", "RANKING_WAIT_S", "PrefixReuse", "ReuseTotals", "common_prefix"]

MIN_REUSE = 16  # shorter shared prefixes are recomputed (a fork costs a segment in every attention)
MIN_SHARED = 64  # a prefilling request this close to ours is worth waiting for
RANKING_WAIT_S = 2.0  # how long choosing among routes waits for a stage's probe answer (a guess at most)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if list(a[:n]) == list(b[:n]):
        return n
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass
class ReuseTotals:
    """What reuse did for this coordinator's requests (``meshd status``, ``/metrics``)."""

    requests: int = 0  # requests that asked the stages
    hits: int = 0  # ... and reused some prefix
    prompt_tokens: int = 0  # prompt positions of those requests
    reused_tokens: int = 0  # positions not computed again
    misses: int = 0  # a stage had evicted the prefix: prefilled in full instead
    waits: int = 0  # requests that waited for a sibling's prefill to share it

    @property
    def hit_rate(self) -> float:
        return self.hits / self.requests if self.requests else 0.0

    def to_dict(self) -> dict:
        return {**self.__dict__, "hit_rate": round(self.hit_rate, 4)}


class PrefixReuse:
    def __init__(self, links: Links, enabled: bool = True, silent_s: float = 30.0):
        """``silent_s``: how long a stage may leave a probe unanswered before it counts as holding nothing
        (the coordinator's wait on a silent stage). A probe is answered between a stage's operations,
        not after its pass, so a short wait would only be a guess at the machine's load: a busy machine
        (or a slow CPU) would lose the reuse of a cached prompt, and the caching of the request."""
        self.links = links
        self.enabled = enabled
        self.silent_s = silent_s
        self.totals = ReuseTotals()
        self._prefilling: dict[RequestId, tuple[list[int], asyncio.Event]] = {}

    async def start(self, request_id: RequestId, route: Route, seq, ids: list[int], capacity: int,
                    send: Callable[[str, object], Awaitable[None]], reply_to: str,
                    allowed: bool = True) -> tuple[int, bool]:
        """Where a request's sequence ``seq`` starts: (how many leading ``ids`` it takes from the stages'
        caches, whether every stage keeps prefixes). Asked of every stage once siblings prefilling the
        same prefix are done, then announced down the chain (``send`` to the first
        stage) ahead of the first chunk. ``allowed`` False (a stage missed before): nothing reused."""
        if not self.enabled:
            return 0, False
        self.prefilling(request_id, ids)  # a request arriving after us may wait for our prefill
        reuse, speaks = await self.reusable(route, ids)
        if await self.after_siblings(request_id, ids, reuse):
            reuse, speaks = await self.reusable(route, ids, count=False)
        if not reuse or not allowed:
            return 0, speaks
        await send(route.stages[0].node_id, ReusePrefix(
            request_id, route.plan_version, seq, torch.tensor(ids[:reuse], dtype=torch.long), capacity, reply_to))
        self.reused(reuse)
        return reuse, speaks

    async def reusable(self, route: Route, ids: Sequence[int], count: bool = True,
                       wait_s: float | None = None) -> tuple[int, bool]:
        """(positions of ``ids`` every stage of ``route`` holds — 0 below MIN_REUSE —, whether every stage
        keeps prefixes at all). A stage that does not answer counts as holding nothing. ``count``: a
        request's first question (the second, after waiting for a sibling, is not another request).
        ``wait_s``: a shorter wait for an answer than a silent stage gets (ranking routes is a guess;
        a route through a device that just left must not hold the request that avoids it)."""
        wait_s = self.silent_s if wait_s is None else wait_s
        if not self.enabled or len(ids) <= MIN_REUSE:
            return 0, self.enabled
        # the last token is computed whatever is held (its logits are the answer's first)
        probe = PrefixProbe(route.plan_version, torch.tensor(list(ids[:-1]), dtype=torch.long))

        async def ask(node_id) -> int | None:
            try:
                peer = await self.links.to(node_id)
                reply = await peer.request(probe, timeout=wait_s)
            except TimeoutError:  # a stage that knows probes but said nothing: it keeps prefixes, holds none now
                log.info("prefix_probe_unanswered", node=node_id, waited_s=wait_s)
                return 0
            except (TransportError, KeyError) as exc:  # a 0.2 member: "unknown_type"
                log.debug("prefix_probe_failed", node=node_id, error=str(exc))
                return None
            return reply.length if isinstance(reply, PrefixMatch) and reply.plan_version == route.plan_version \
                else 0

        answers = await asyncio.gather(*(ask(s.node_id) for s in route.stages))
        speaks = all(a is not None for a in answers)
        n = min((a or 0) for a in answers)
        n = min(n, len(ids) - 1)
        if count:
            self.totals.requests += 1
            self.totals.prompt_tokens += len(ids)
        if n < MIN_REUSE:
            return 0, speaks
        return n, speaks

    def reused(self, n: int) -> None:
        """A request's prompt started ``n`` positions in (``n`` > 0)."""
        self.totals.hits += 1
        self.totals.reused_tokens += n

    def missed(self) -> None:
        self.totals.misses += 1

    # -- siblings prefilling at once ---------------------------------------------------------------
    async def after_siblings(self, request_id: RequestId, ids: Sequence[int], held: int) -> bool:
        """Wait for requests that announced their prefill before ours and share at least ``MIN_SHARED``
        more of ``ids`` than the stages hold (``held``). True: we waited (ask again). Only earlier ones:
        two requests arriving together never wait for each other. No clock bounds the wait: each
        sibling's attempt ends (its event set) once prefilled, failed or hung up, and its own wait on
        the stages follows their progress — a fixed bound here would start a second prefill of the
        same prompt beside a slow first one, on the same cores."""
        events = []
        for rid, (other, ev) in self._prefilling.items():
            if rid == request_id:
                break
            if common_prefix(other, ids) >= held + MIN_SHARED:
                events.append(ev)
        if not events:
            return False
        self.totals.waits += 1
        await asyncio.gather(*(ev.wait() for ev in events))
        return True

    def prefilling(self, request_id: RequestId, ids: Sequence[int]) -> asyncio.Event:
        """Announce a prefill of ``ids``; set the returned event once its prompt is computed (or it ends).
        A request announcing again (a replay) releases whoever waited on its earlier announcement."""
        ev = asyncio.Event()
        old = self._prefilling.pop(request_id, None)
        if old is not None:
            old[1].set()
        self._prefilling[request_id] = (list(ids), ev)
        return ev

    def prefilled(self, request_id: RequestId) -> None:
        entry = self._prefilling.pop(request_id, None)
        if entry is not None:
            entry[1].set()
