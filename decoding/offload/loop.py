"""The home's decoding loop with a cloud verifier: draft, decide, offload, keep drafting.

The home's model (the SLM) drafts one token at a time through ``Drafter.feed``.
Every γ drafted tokens form a chunk; :class:`~decoding.offload.policy.OffloadPolicy`
decides whether the cloud's bigger model (the LLM) verifies it. A chunk kept
local is committed as drafted. An offloaded chunk goes up with the committed
tokens the verifier has not seen yet; it answers with how many drafts it
accepted and its own next token, computed by exact rejection sampling (or
argmax for greedy requests), so what it commits follows the LLM's distribution.

Never stall (SpecEdge's proactive drafting): while a verification is in flight
the SLM keeps drafting along its own most likely path. When the verdict comes
back and the LLM's token is the one the SLM had drafted at that position, the
drafts after it are already computed and stay; otherwise the SLM's cache rolls
back to the verified prefix and drafting restarts from the LLM's token.

The verifier can be slow, full or gone: a verification that does not come
back in time, or is refused, commits the chunk as drafted — generation goes on
locally and no token is lost or duplicated. A session the verifier evicted is
resent from the start with the next offloaded chunk. ``start`` in each request
is the prefix the verifier *confirmed*, so a verdict that came too late, or a
request that never arrived, can never leave the two sides disagreeing: the
verifier rolls its cache back to ``start`` before it runs.

Nothing here does I/O itself: the drafter (an in-process pipeline or the mesh)
and the verifier link are passed in, so tests run the same loop against
in-process fakes, a real verifier on loopback, or a killed one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from decoding.exits.previews import Preview
from decoding.offload.policy import GAMMA, OffloadPolicy, chunk_confidence, chunk_importance
from decoding.sampling import SamplingParams
from partition.ids import CloudSession

SUPPORT_MAX = 64  # largest sampler support sent as a sparse distribution (else drafts go as candidates)
AHEAD = 2 * GAMMA  # tokens drafted past an in-flight chunk, at most
ALIGN_WORTH = 0.15  # aligned-verdict rate above which drafting ahead pays (saves ~γ steps, costs ~½ a step)


@dataclass(frozen=True)
class DraftStep:
    """What the drafter says after the tokens it was just fed.

    ``token`` is its proposal for the next position (not fed yet) and ``ids``/``probs``
    the distribution it was drawn from, on the sampler's support (top entries, best
    first); ``exact``: that support is complete (every other token has probability 0).
    ``attention``: the last fed token's row of final-layer attention on the sequence's
    last γ positions (None if the drafter cannot tell).
    """

    token: int
    ids: tuple[int, ...]
    probs: tuple[float, ...]
    exact: bool = False
    attention: tuple[float, ...] | None = None


def draft_step(token: int, ids: Sequence[int], probs: Sequence[float],
               attention: Sequence[float] | None = None) -> DraftStep:
    """A DraftStep from the drafter's top SUPPORT_MAX + 1 entries (best first): exact when
    fewer came back or the last one has probability 0 (the support fits)."""
    ids, probs = list(ids), [float(p) for p in probs]
    exact = len(probs) <= SUPPORT_MAX or probs[SUPPORT_MAX] <= 0.0
    keep = [i for i, p in enumerate(probs[:SUPPORT_MAX]) if p > 0.0] if exact else range(min(len(ids), SUPPORT_MAX))
    return DraftStep(int(token), tuple(int(ids[i]) for i in keep), tuple(probs[i] for i in keep), exact,
                     None if attention is None else tuple(float(a) for a in attention))


class Drafter(Protocol):
    async def feed(self, tokens: Sequence[int], at: int) -> DraftStep:
        """Roll the cache back to ``at`` positions, append ``tokens``, propose the next token."""
        ...


@dataclass(frozen=True)
class VerifyRequest:
    session: CloudSession
    start: int  # positions the verifier confirmed holding
    tokens: tuple[int, ...]  # uncached committed tokens (the root last), then the drafts
    drafts: int
    q: tuple[tuple[tuple[int, ...], tuple[float, ...]], ...] | None = None  # per draft: (ids, probs)
    open: dict | None = None
    previews: float = 0.0  # > 0: send early verdicts at least this confident (a verifier that offers them)


@dataclass(frozen=True)
class PreviewSettings:
    """Pre-drafting from a verifier's early verdicts (the early-exit edge–cloud paper's client).

    ``threshold``: the least confidence of a preview the home drafts from (the verifier
    sends none below it). ``max_predrafts``: pre-drafts started per round, at most — the
    home has one drafter, so each new one abandons the last one's drafting (what it drafted
    is kept)."""

    threshold: float = 0.6
    max_predrafts: int = 2

    def __post_init__(self):
        if not 0.0 < self.threshold <= 1.0 or self.max_predrafts < 1:
            raise ValueError("previews need a threshold in (0, 1] and at least one pre-draft per round")


@dataclass(frozen=True)
class VerifyResult:
    accepted: int
    token: int
    draws: int = 0


class VerifierUnavailable(Exception):
    """No verdict this time (timed out, busy, disconnected): the chunk is committed as drafted."""


class VerifierEvicted(Exception):
    """The verifier dropped this session's cache: resend it from the start."""


class Verifier(Protocol):
    @property
    def available(self) -> bool: ...

    def offers_previews(self) -> bool:
        """Whether this verifier is known to send previews (a request asking for them is then answered so)."""
        ...

    async def verify(self, request: VerifyRequest, timeout_s: float | None = None,
                     on_preview: Callable[[Preview], None] | None = None) -> VerifyResult: ...

    async def close_session(self, session: CloudSession) -> None: ...


@dataclass
class OffloadStats:
    chunks: int = 0
    offloaded: int = 0
    verified: int = 0  # offloaded chunks that got a verdict
    drafted: int = 0  # drafts sent for verification (in verified chunks)
    accepted: int = 0
    corrected: int = 0  # verdicts whose token replaced a draft
    aligned: int = 0  # verdicts whose token the drafter had already drafted (its drafts after it kept)
    local_fallbacks: int = 0  # offloaded chunks committed as drafted (no verdict in time / refused)
    resent: int = 0  # sessions resent after an eviction
    ahead_drafted: int = 0  # tokens drafted while a verification was in flight
    stall_s: float = 0.0  # time spent waiting for a verdict with nothing left to draft
    wait_s: float = 0.0  # time from sending a chunk to its verdict
    opening_wait_s: float = 0.0  # ... of the rounds that opened a session (they carry the prompt)
    openings: int = 0
    llm_tokens: int = 0  # tokens the verifier computed for us (cloud cost)
    previews: int = 0  # early verdicts received
    predrafts: int = 0  # pre-drafts started from them (a branch off the drafted path)
    predraft_rounds: int = 0  # rounds with at least one pre-draft
    predraft_hits: int = 0  # rounds whose verdict was a pre-draft's: its drafts went out at once
    predraft_tokens: int = 0  # drafts a hit had ready
    predraft_saved_s: float = 0.0  # drafting time those ready drafts would have cost (measured per step)
    preview_rounds: int = 0  # rounds in which a preview came before the verdict
    preview_lead_s: float = 0.0  # per such round: first preview to verdict, summed
    draft_steps: int = 0  # one-token drafting steps, and their time (what a round's drafting costs)
    draft_s: float = 0.0
    local_only_reason: str | None = None

    def to_dict(self) -> dict:
        d = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in self.__dict__.items()}
        d["accepted_per_chunk"] = round(self.accepted / self.verified, 3) if self.verified else 0.0
        d["predraft_hit_rate"] = round(self.predraft_hits / self.predraft_rounds, 3) if self.predraft_rounds else 0.0
        return d


@dataclass
class _Draft:
    token: int
    step: DraftStep  # the step that proposed it (its distribution)
    attention: tuple[float, ...] | None = None  # its own row (from feeding it)


@dataclass
class _PreDraft:
    """Drafts after a preview's verdict: the chunk's first ``accepted`` drafts, then ``token``, then ``drafts``."""

    accepted: int
    token: int
    drafts: list[_Draft] = field(default_factory=list)
    next: DraftStep | None = None  # the drafter's proposal after the last of them

    @property
    def path(self) -> list[int]:
        return [self.token] + [d.token for d in self.drafts]


@dataclass
class OffloadDecoder:
    """One answer's loop. ``session`` must be unique among the home's live answers."""

    drafter: Drafter
    verifier: Verifier | None
    policy: OffloadPolicy
    session: CloudSession
    sampling: SamplingParams = field(default_factory=SamplingParams)
    eos_ids: frozenset[int] = frozenset()
    gamma: int = GAMMA
    ahead: int = AHEAD
    seed: int | None = None
    previews: PreviewSettings | None = None  # pre-draft from early verdicts (a verifier offering them)
    stats: OffloadStats = field(default_factory=OffloadStats)

    def __post_init__(self):
        self._rng = random.Random(self.seed)
        self._aligned_rate = 0.5  # EWMA: verdicts whose token the drafts ahead had already taken
        self._rounds = 0
        # None: the drafter holds the context and the drafted buffer; else the tokens after the context it
        # holds (a pre-draft's branch), which the next feed must account for
        self._held: list[int] | None = None
        self._step_s = 0.0  # EWMA of one drafting step (what a ready pre-draft saved)

    def _worth_drafting_ahead(self) -> bool:
        """Drafting ahead pays when verdicts often align with it (each aligned verdict saves the next
        chunk's drafting); when they seldom do it only delays the verdict by the step in progress.
        Every eighth round drafts ahead regardless, to notice when the text turns predictable."""
        return self._aligned_rate >= ALIGN_WORTH or self._rounds % 8 == 0

    async def run(self, prompt: Sequence[int], max_tokens: int) -> AsyncIterator[int]:
        """Yield the answer's tokens as they are committed (EOS last, if the model ends)."""
        self._ctx = list(prompt)
        self._max = max_tokens
        self._buf: list[_Draft] = []
        self._generated = 0
        self._cloud_has = 0
        self._opened = False
        self._draws = 0
        self._next = await self.drafter.feed(self._ctx, 0)
        try:
            while self._generated < max_tokens:
                want = min(self.gamma, max_tokens - self._generated)
                while len(self._buf) < want and not self._ends(self._buf):
                    await self._extend()
                chunk = self._buf[:want]
                cut = next((i + 1 for i, d in enumerate(chunk) if d.token in self.eos_ids), len(chunk))
                chunk = chunk[:cut]
                self.stats.chunks += 1
                if not self._offload(chunk, max_tokens):
                    for tok in self._commit(len(chunk), ()):
                        yield tok
                else:
                    async for tok in self._verify(chunk):
                        yield tok
                if self._done(max_tokens):
                    return
        finally:
            if self._opened and self.verifier is not None:
                try:
                    await self.verifier.close_session(self.session)
                except Exception:  # noqa: BLE001 - closing is a courtesy; the verifier's LRU reclaims it
                    pass

    # -- steps ----------------------------------------------------------------------
    def _ends(self, buf: list[_Draft]) -> bool:
        return bool(buf) and buf[-1].token in self.eos_ids

    def _done(self, max_tokens: int) -> bool:
        return self._generated >= max_tokens or (self._ctx and self._ctx[-1] in self.eos_ids
                                                 and self._generated > 0)

    async def _extend(self) -> None:
        """Feed the pending proposal: it joins the buffer of drafted, uncommitted tokens."""
        prop = self._next
        at = len(self._ctx) + len(self._buf)
        step = await self._timed_feed([prop.token], at)
        self._buf.append(_Draft(prop.token, prop, step.attention))
        self._next = step

    async def _timed_feed(self, tokens: list[int], at: int) -> DraftStep:
        t = time.monotonic()
        step = await self.drafter.feed(tokens, at)
        if len(tokens) == 1:
            dt = time.monotonic() - t
            self.stats.draft_steps += 1
            self.stats.draft_s += dt
            self._step_s = dt if self._step_s == 0.0 else self._step_s + 0.2 * (dt - self._step_s)
        return step

    async def _hold(self, path: list[int]) -> DraftStep:
        """Make the drafter hold the context then ``path``; feed only what differs from what it holds.
        Returns its proposal after ``path``.

        Why one token a feed unless the drafter says otherwise: with previews off its cache is built
        by one-token feeds, and a float matrix product over several rows need not give one row's
        bits; a draft that differed would change a chunk committed locally. A drafter whose rows
        never see each other's bits (``batch_invariant``, the gguf mode's block products) takes
        the whole difference in one feed."""
        held = [d.token for d in self._buf] if self._held is None else self._held
        same = 0
        while same < min(len(held), len(path) - 1) and held[same] == path[same]:
            same += 1
        if getattr(self.drafter, "batch_invariant", False):
            step = await self.drafter.feed(path[same:], len(self._ctx) + same)
        else:
            for i in range(same, len(path)):
                step = await self.drafter.feed(path[i:i + 1], len(self._ctx) + i)
        self._held = list(path)
        return step

    async def _back_on_buffer(self) -> None:
        """The drafter back on the drafted buffer, if a pre-draft moved it off."""
        if self._held is not None:
            self._next = await self._hold([d.token for d in self._buf])
            self._held = None

    def _offload(self, chunk: list[_Draft], max_tokens: int) -> bool:
        if self.verifier is None or not chunk:
            return False
        conf = chunk_confidence([d.step.probs[0] if d.step.probs else 1.0 for d in chunk])
        rows = [d.attention for d in chunk if d.attention is not None]
        imp = chunk_importance(rows, self.gamma) if len(rows) == len(chunk) else 0.0
        self._conf = conf
        if not self.verifier.available:
            self.stats.local_only_reason = "verifier unavailable"
            return False
        go = self.policy.decide(conf, imp, self._generated, max_tokens, self._rng)
        if go:
            self.stats.offloaded += 1
        return go

    def _commit(self, n: int, extra: Sequence[int]) -> list[int]:
        """Commit the first ``n`` buffered drafts and then ``extra``; return the tokens to emit."""
        toks = [d.token for d in self._buf[:n]] + list(extra)
        self._buf = self._buf[n:]
        out = []
        for t in toks:
            if self._generated >= self._max:
                break
            self._ctx.append(t)
            self._generated += 1
            out.append(t)
            if t in self.eos_ids:
                break
        return out

    def _wants_previews(self) -> bool:
        return self.previews is not None and self.verifier is not None and self.verifier.offers_previews()

    def _request(self, chunk: list[_Draft]) -> VerifyRequest:
        drafts = tuple(d.token for d in chunk)
        q = None
        if not self.sampling.greedy and all(d.step.exact and len(d.step.ids) <= SUPPORT_MAX for d in chunk):
            q = tuple((d.step.ids, d.step.probs) for d in chunk)
        opened = None
        if not self._opened:
            opened = {**self.sampling.to_dict(), "draws": self._draws,
                      "capacity": len(self._ctx) + (self._max - self._generated) + 2 * self.gamma + 2}
        return VerifyRequest(self.session, self._cloud_has, tuple(self._ctx[self._cloud_has:]) + drafts,
                             len(drafts), q, opened, self.previews.threshold if self._wants_previews() else 0.0)

    async def _verify(self, chunk: list[_Draft]) -> AsyncIterator[int]:
        assert self.verifier is not None
        req = self._request(chunk)
        t0 = time.monotonic()
        arrived: list[Preview] = []
        news = asyncio.Event()
        self._predrafts: list[_PreDraft] = []
        self._target: _PreDraft | None = None  # the pre-draft the drafter is extending (when _held is set)
        self._first_preview = 0.0

        def on_preview(p: Preview) -> None:
            self.stats.previews += 1
            arrived.append(p)
            news.set()
        task = asyncio.ensure_future(self.verifier.verify(req, on_preview=on_preview) if req.previews
                                     else self.verifier.verify(req))
        try:
            # Proactive drafting: the SLM works on while the LLM verifies; along a confident preview's
            # verdict once one comes (pre-drafting), else along its own most likely path.
            self._rounds += 1
            ahead = self.ahead if self._worth_drafting_ahead() else 0
            idle = 0.0
            while not task.done():
                if arrived:
                    news_now = arrived[:]
                    arrived.clear()  # (more may come while this one is followed)
                    await self._follow(news_now, chunk)
                    continue
                target = self._target if self._held is not None else None
                if target is not None and target.next is not None and len(target.drafts) < self.gamma:
                    await self._extend_predraft(target)
                    continue
                if target is None and len(self._buf) < len(chunk) + ahead and not self._ends(self._buf):
                    await self._extend()
                    self.stats.ahead_drafted += 1
                    continue
                t_idle = time.monotonic()  # nothing left to draft: wait for a verdict or a preview
                news.clear()
                waiter = asyncio.ensure_future(news.wait())
                try:
                    await asyncio.wait((task, waiter), return_when=asyncio.FIRST_COMPLETED)
                finally:
                    waiter.cancel()
                    idle += time.monotonic() - t_idle
            self.stats.stall_s += idle
            res = await task
        except VerifierEvicted:
            self._opened, self._cloud_has = False, 0
            self.stats.resent += 1
            req = dataclasses.replace(self._request(chunk), previews=0.0)  # (the resend's previews: no one to hear)
            res = await self._resend(req)
        except VerifierUnavailable as exc:
            self.stats.local_fallbacks += 1
            self.stats.local_only_reason = str(exc) or "verifier unavailable"
            res = None
        finally:
            if not task.done():
                task.cancel()
        self.stats.wait_s += time.monotonic() - t0
        if req.open is not None:
            self.stats.openings += 1
            self.stats.opening_wait_s += time.monotonic() - t0
        if self._first_preview:
            self.stats.preview_rounds += 1
            self.stats.preview_lead_s += time.monotonic() - self._first_preview
        if res is None:  # no verdict: the chunk stands as drafted
            await self._back_on_buffer()  # (a pre-draft may have moved the drafter off the chunk's path)
            for tok in self._commit(len(chunk), ()):
                yield tok
            return
        for tok in await self._apply(chunk, req, res):
            yield tok

    async def _follow(self, previews: list[Preview], chunk: list[_Draft]) -> None:
        """New early verdicts: draft along the last confident one (a deeper exit knows better than the one
        before it), unless the drafted path already agrees with it or the round's pre-drafts are spent."""
        self._first_preview = self._first_preview or time.monotonic()
        p = next((p for p in reversed(previews)
                  if p.confidence >= self.previews.threshold and 0 <= p.accepted <= len(chunk)), None)
        if p is None or (p.accepted and chunk[p.accepted - 1].token in self.eos_ids):
            return  # (nothing follows an accepted end)
        a, y = p.accepted, p.token
        if (self._buf[a].token == y) if len(self._buf) > a else self._next.token == y:
            await self._back_on_buffer()  # the drafted path is this verdict's: back onto it
            return
        pre = next((x for x in self._predrafts if (x.accepted, x.token) == (a, y)), None)
        if pre is not None and (pre is self._target and self._held is not None or y in self.eos_ids):
            return  # already drafting along it (or it ends there: nothing to draft)
        if pre is None:
            if len(self._predrafts) >= self.previews.max_predrafts:
                return
            self.stats.predraft_rounds += not self._predrafts
            self.stats.predrafts += 1
            pre = _PreDraft(a, y)
            self._predrafts.append(pre)
        if y in self.eos_ids:  # a verdict that ends the answer: ready as it is, and the drafter stays where it is
            return
        self._target = pre
        pre.next = await self._hold([d.token for d in self._buf[:a]] + pre.path)
        if pre.drafts and pre.drafts[-1].token in self.eos_ids:
            pre.next = None

    async def _extend_predraft(self, pre: _PreDraft) -> None:
        prop = pre.next
        at = len(self._ctx) + len(self._held)
        step = await self._timed_feed([prop.token], at)
        pre.drafts.append(_Draft(prop.token, prop, step.attention))
        self._held.append(prop.token)
        pre.next = None if prop.token in self.eos_ids else step

    async def _resend(self, req: VerifyRequest) -> VerifyResult | None:
        try:
            return await self.verifier.verify(req)
        except (VerifierEvicted, VerifierUnavailable) as exc:
            self.stats.local_fallbacks += 1
            self.stats.local_only_reason = str(exc) or "verifier unavailable"
            return None

    async def _apply(self, chunk: list[_Draft], req: VerifyRequest, res: VerifyResult) -> list[int]:
        a, y = res.accepted, res.token
        if not 0 <= a <= len(chunk):
            raise ValueError(f"the verifier accepted {a} of {len(chunk)} drafts")
        self._opened, self._draws = True, res.draws
        self.stats.verified += 1
        self.stats.drafted += len(chunk)
        self.stats.accepted += a
        self.stats.llm_tokens += len(req.tokens)
        self.policy.observe(self._conf, a, len(chunk))
        if chunk[a - 1].token in self.eos_ids if a else False:  # accepted up to the EOS: nothing follows
            self._cloud_has = len(self._ctx) + a
            return self._commit(a, ())
        self._cloud_has = len(self._ctx) + a  # the verifier holds the old context and the accepted drafts
        aligned = len(self._buf) > a and self._buf[a].token == y
        if len(self._buf) > len(chunk):  # drafts ahead existed: did they pay?
            self._aligned_rate += 0.25 * ((1.0 if aligned else 0.0) - self._aligned_rate)
        if aligned:  # the SLM drafted the LLM's token: its drafts after it stand
            self.stats.aligned += 1
            await self._back_on_buffer()  # (a pre-draft may have moved the drafter off them)
            return self._commit(a + 1, ())
        if a < len(chunk):
            self.stats.corrected += 1
        hit = next((p for p in self._predrafts if (p.accepted, p.token) == (a, y)), None)
        if hit is not None:  # a preview said so: its drafts are ready, the next chunk goes out at once
            return await self._take_predraft(hit)
        if y not in self.eos_ids:
            self._next = await self._hold([d.token for d in self._buf[:a]] + [y])
        out = self._commit(a, [y])
        self._buf, self._held = [], None
        return out

    async def _take_predraft(self, pre: _PreDraft) -> list[int]:
        self.stats.predraft_hits += 1
        self.stats.predraft_tokens += len(pre.drafts)
        # its drafts, and the feed of its token that proposed the first of them (done once pre.next is known)
        self.stats.predraft_saved_s += (len(pre.drafts) + (pre.next is not None or bool(pre.drafts))) * self._step_s
        path = [d.token for d in self._buf[:pre.accepted]] + pre.path
        if pre.token not in self.eos_ids and (self._held != path or pre.next is None):
            nxt = await self._hold(path)  # the drafter moved on to another pre-draft since (or stopped at an end)
            pre.next = pre.next or nxt
        out = self._commit(pre.accepted, [pre.token])
        self._buf, self._held = list(pre.drafts), None
        if pre.next is not None:
            self._next = pre.next
        return out
