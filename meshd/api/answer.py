"""One generation as the API serves it, in either dialect.

:func:`tracked` runs the engine stream with the metrics and the one
``request_done`` log line; :class:`Answer` walks its events into the text a
client is sent, with the calls of offered tools held back and parsed at the
end. A thinking model's reasoning is split off first (:mod:`meshd.api.reasoning`),
so a call is looked for only in the spoken part. The dialects differ only in
how they frame each piece.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from aiohttp import web

from meshd.api import tools as tl
from meshd.api.common import METRICS, log
from meshd.api.metrics import ApiMetrics
from meshd.api.reasoning import ReasoningSplitter, Split
from meshd.engine.base import Engine, GenerationRequest, TokenEvent


class Run:
    """Per-request bookkeeping for metrics and the final log line."""

    def __init__(self, metrics: ApiMetrics, prompt_tokens: int, api: str, endpoint: str):
        self.metrics = metrics
        self.prompt_tokens = prompt_tokens
        self.api, self.endpoint = api, endpoint
        self.started = metrics.started()
        self.first_token_at: float | None = None
        self.tokens = 0
        self.cached_tokens: int | None = None  # of the prompt, taken from the stages' prefix caches
        self.finish: str | None = None
        self.ok = True
        self._ended = None

    def saw(self, ev: TokenEvent) -> None:
        if ev.token_id is not None:
            if self.first_token_at is None:
                self.first_token_at = self.metrics.clock()
                self.metrics.first_token()
            self.tokens += 1
        if ev.finish_reason is not None:
            self.finish = ev.finish_reason
            if ev.usage is not None:
                self.tokens = ev.usage.completion_tokens
                self.cached_tokens = ev.usage.stats.cached_tokens

    def end(self, ok: bool, outcome: str | None = None):
        if self._ended is None:
            self._ended = self.metrics.finished(
                self.started, self.first_token_at, self.prompt_tokens, self.tokens, ok=ok,
                api=self.api, endpoint=self.endpoint,
                outcome=outcome or ("ok" if ok else "error"))
        return self._ended

    def hung_up(self) -> None:
        """The client closed the connection mid-answer; ``tracked`` closes the engine stream."""
        self.ok = False
        log.info("request_cancelled", reason="client disconnected", completion_tokens=self.tokens)


@contextlib.asynccontextmanager
async def tracked(request: web.Request, engine: Engine, gen: GenerationRequest, api: str,
                  endpoint: str):
    """Run ``gen`` on ``engine``: yields (events, run); metrics and the log line on the way out."""
    import structlog

    run = Run(request.app[METRICS], len(gen.prompt_ids), api, endpoint)
    with structlog.contextvars.bound_contextvars(request_id=gen.request_id):
        try:
            async with contextlib.aclosing(engine.stream(gen)) as events:
                yield events, run
        except asyncio.CancelledError:
            run.end(ok=False, outcome="cancelled")
            log.info("request_cancelled", reason="client disconnected", completion_tokens=run.tokens)
            raise
        except BaseException:
            run.end(ok=False)
            raise
        rec = run.end(ok=run.ok)
        log.info("request_done", api=api, endpoint=endpoint, stream=gen.options.stream, ok=run.ok,
                 finish_reason=run.finish, prompt_tokens=len(gen.prompt_ids),
                 completion_tokens=run.tokens, cached_tokens=run.cached_tokens,
                 ttft_s=None if rec.ttft_s is None else round(rec.ttft_s, 4),
                 decode_s=round(rec.decode_s, 4))


class Answer:
    """The text of one answer, piece by piece, as a client is sent it.

    The engine's events pass through the reasoning splitter (when the model
    thinks) and then the tool-call filter: text that may be the start of a
    call of an offered tool is held back, and the calls are parsed when the
    final event arrives. After :meth:`pieces` is exhausted, ``final`` is the
    final event (None if the engine ended without one), ``calls`` the parsed
    calls and ``token_ids`` every generated token id.
    """

    def __init__(self, first: TokenEvent, events: AsyncIterator[TokenEvent], run: Run, offered: list[str],
                 reasoning: ReasoningSplitter | None = None):
        self._first = first
        self._events = events
        self._run = run
        self._filter = tl.ToolStreamFilter(offered)
        self._reasoning = reasoning
        self.final: TokenEvent | None = None
        self.calls: list[tl.ToolCall] = []
        self.token_ids: list[int] = []

    @classmethod
    async def begin(cls, events: AsyncIterator[TokenEvent], run: Run, offered: list[str],
                    reasoning: ReasoningSplitter | None = None) -> Answer:
        """Wait for the first event before any header is sent, so that errors raised up front
        (no plan, prompt too long for the plan) keep their HTTP status."""
        first = await anext(events)
        run.saw(first)
        return cls(first, events, run, offered, reasoning)

    def _split(self, text: str, last: bool) -> Split:
        """Reasoning and the spoken text of ``text``; the spoken part has been through the call filter."""
        split = Split(content=text) if self._reasoning is None else self._reasoning.feed(text)
        if last and self._reasoning is not None:
            split += self._reasoning.finish()
        spoken = self._filter.feed(split.content)
        if last:
            tail, self.calls = self._filter.finish()
            spoken += tail
        return Split(split.reasoning, spoken)

    async def pieces(self) -> AsyncIterator[Split]:
        """Each non-empty piece (reasoning and spoken text), as soon as it is safe to send."""
        ev: TokenEvent | None = self._first
        while ev is not None:
            if ev.token_id is not None:
                self.token_ids.append(ev.token_id)
            last = ev.finish_reason is not None
            piece = self._split(ev.text, last)
            if last:
                self.final = ev
                if piece:
                    yield piece
                return
            if piece:
                yield piece
            ev = await anext(self._events, None)
            if ev is not None:
                self._run.saw(ev)
