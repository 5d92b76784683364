"""Outline-based parallel decoding: one answer as several point requests that fill the pipeline.

A plain answer decodes one token at a time through every stage, so on a mesh
all but one device wait. Outline mode asks the model for a short outline of
its answer first, then expands every point at once: each point is a child
sequence forked from the shared cache of [question + outline] (read in place
on every stage, never recomputed), the children run concurrently and the
stages batch their steps. The answer is the expansions in point order.

It is lossy — the points are written without seeing each other — so it is
for answers that are a list of independent points, never for code, maths or
step-by-step reasoning, nor for short answers (``meshd.pipeline.outline.gate``
decides before anything is generated, asking ``meshd.pipeline.outline.router``
under ``outline: "auto"``).

Streaming keeps the order a reader expects: point 1 streams as it is written;
each later point follows as soon as the one before it is complete (it has
usually finished meanwhile). A point that fails fails the request — no gaps.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from decoding.sampling import SamplingSpec
from meshd.pipeline.coordinator.failures import PipelineError
from meshd.pipeline.coordinator.service import PipelineCoordinator
from meshd.pipeline.coordinator.slot import SharedPrefix, StepsRequest
from partition.ids import RequestId


MIN_POINTS = 3  # fewer points than this: a plain answer (nothing to parallelise)
DEFAULT_POINTS = 5  # the most points the decoder asks for (each one a child in the pipeline)
TITLE_TOKENS = 16  # a point's title is a few words
MIN_POINT_TOKENS = 16  # fewer tokens than this per point: fewer points
MAX_POINT_TOKENS = 96  # "two or three sentences"; the paragraph usually ends first
POINT_TITLE_WORDS = 10

OUTLINE_ASK = ("{question}\n\nDo not answer yet. Write only an outline of the answer: 3 to 8 numbered "
               "points, a few words each, one per line.")
POINT_ASK = "Write point {i} only, \"{title}\", in two or three sentences."
OUTLINE_START = "1."  # the assistant's outline starts here: the model lists rather than answers


_TITLE_END = re.compile(r"[:\n]|[.!?](?:\s|$)| - ")


def _title_end(text: str) -> int | None:
    """Where a title being written ends (its first clause), once the text shows it."""
    m = _TITLE_END.search(text.lstrip())
    if m is None:
        return None if len(text.split()) <= POINT_TITLE_WORDS else len(text.rstrip())
    return m.start() + (len(text) - len(text.lstrip()))


def _clean_title(text: str) -> str:
    return " ".join(text.split()[:POINT_TITLE_WORDS]).strip(" *-\"'.,;")


def point_header(i: int, title: str) -> str:
    return f"{i}. {title}:"


@dataclass
class OutlineStats:
    """How one outline request went (the engine adds it up for status)."""

    points: int = 0
    outline_tokens: int = 0
    point_tokens: list[int] = field(default_factory=list)
    fallback: str | None = None  # why the outline was dropped for a plain answer, for people
    fallback_reason: str | None = None  # the same as a code: "few_points" or "budget" (counted)

    def to_dict(self) -> dict:
        """What a response's usage reports: the points written, or why it fell back."""
        if self.fallback is not None:
            return {"used": False, "fallback": self.fallback_reason, "detail": self.fallback,
                    "outline_tokens": self.outline_tokens}
        return {"used": True, "points": self.points, "outline_tokens": self.outline_tokens}


class OutlineDecoder:
    """Runs one request in outline mode on a pipeline coordinator; yields the answer's token ids."""

    def __init__(self, coordinator: PipelineCoordinator, tokenizer, eos_ids, wait_s: float | None = None,
                 speculation=None):
        """``speculation(context_ids)``: a SpeculationSession for a point's child (None: plain decoding)."""
        self.speculation = speculation
        self.max_points = DEFAULT_POINTS
        self.coord = coordinator
        self.tok = tokenizer
        self.eos_ids = tuple(eos_ids)
        self.wait_s = wait_s

    def outline_prompt(self, messages: list[dict]) -> tuple[list[dict], list[int]]:
        """The conversation with its last user turn asking for an outline, and its token ids."""
        last = messages[-1]
        asked = [*messages[:-1], {**last, "content": OUTLINE_ASK.format(question=last["content"])}]
        return asked, self.tok.apply_chat(asked) + self.tok.encode(OUTLINE_START)

    def point_suffix(self, asked: list[dict], outline_text: str, i: int, title: str) -> list[int]:
        """Tokens a point's child appends after the shared [question + outline] positions.

        Rendered from the chat template so the child sees a well-formed
        conversation: the outline turn closed, a user turn naming the point,
        and the assistant's answer begun with the point's header.
        """
        before = self.tok.render_chat(asked, add_generation_prompt=True) + outline_text
        whole = self.tok.render_chat([*asked, {"role": "assistant", "content": outline_text},
                                      {"role": "user", "content": POINT_ASK.format(i=i, title=title)}],
                                     add_generation_prompt=True)
        if not whole.startswith(before):
            raise PipelineError("the chat template does not extend a conversation in place; "
                                "outline mode cannot share the outline's cache with this model")
        return self.tok.encode(whole[len(before):] + point_header(i, title), add_bos=False)

    async def run(self, request_id: RequestId, messages: list[dict], max_tokens: int, sampling: SamplingSpec,
                  stats: OutlineStats, cuts=None) -> AsyncIterator[int] | None:
        """Write the outline; returns the answer's token stream, or None (``stats.fallback`` says why).

        The outline is written title by title: the model writes a point's few
        words; at the end of its first clause the decoder cuts it off and
        numbers the next point itself (a fork of the sequence so far, so
        nothing is recomputed). A small model would otherwise explain every
        point right there, one slow token after another — exactly the work
        the parallel expansions are for.
        """
        asked, prompt = self.outline_prompt(messages)
        segments: list[SharedPrefix] = []
        titles: list[str] = []
        held = OUTLINE_START  # the outline the stages hold after the prompt, as text
        held_at: list[tuple[str, str]] = []  # per segment: (held text, the title's unfed head)
        try:
            feed = prompt
            while len(titles) < self.max_points:
                seg = SharedPrefix(f"{request_id}/outline{len(segments) + 1}")
                title, fed, head, toks, ended = await self._title(
                    feed, seg, segments[-1] if segments else None, cuts if not segments else None)
                stats.outline_tokens += toks
                segments.append(seg)
                if seg.seq is None:
                    raise PipelineError("the outline's sequence was lost")
                held += fed
                held_at.append((held, head))
                if not title or title.lower() in {t.lower() for t in titles}:
                    break
                titles.append(title)
                if ended:
                    break
                nxt = f"{head}\n{len(titles) + 1}."
                feed = self.tok.encode(nxt, add_bos=False)
                held += nxt
        except BaseException:
            await self._release(segments)
            raise
        n, budget = self._fit(titles, max_tokens)
        if len(titles) < MIN_POINTS or n < MIN_POINTS:
            few = len(titles) < MIN_POINTS
            stats.fallback_reason = "few_points" if few else "budget"
            stats.fallback = (f"the model wrote {len(titles)} usable outline points" if few
                              else f"{max_tokens} tokens leave too little room for {MIN_POINTS} points")
            await self._release(segments)
            return None
        titles = titles[:n]
        stats.points = n
        # Children fork from the segment that wrote the last kept title; its head (cut off with
        # the token that ended it) is theirs to feed.
        held_text, head = held_at[n - 1]
        pending = self.tok.encode(head, add_bos=False) if head else []
        suffixes = [pending + self.point_suffix(asked, held_text + head, i, t) for i, t in enumerate(titles, 1)]
        return self._expand(request_id, segments, segments[n - 1], titles, suffixes, budget, sampling, stats)

    async def _title(self, feed: list[int], keep: SharedPrefix, parent: SharedPrefix | None,
                     cuts) -> tuple[str, str, str, int, bool]:
        """One point's title: (title, text the stages now hold for it, its unfed head, tokens sampled, ended).

        The token that ends the title is never fed (the caller stops there);
        the part of it before the delimiter — its head — goes with the next feed.
        """
        text, toks, last = "", 0, ""
        steps = self.coord.steps(StepsRequest(keep.request_id, feed, TITLE_TOKENS, SamplingSpec(), self.eos_ids,
                                              cuts=cuts, wait_s=self.wait_s, keep=keep, fork=parent))
        async with contextlib.aclosing(steps):
            async for step in steps:
                toks += 1
                if step.token in self.eos_ids:
                    return _clean_title(text), text, "", toks, True
                piece = self.tok.decode([step.token])
                cut = _title_end(text + piece)
                if cut is not None:
                    head = (text + piece)[len(text):max(cut, len(text))]
                    return _clean_title(text + head), text, head, toks, False
                text += piece
                last = piece
        # the budget ran out: the last token was sampled but not fed
        return _clean_title(text), text[: len(text) - len(last)], last, toks, False

    def _fit(self, titles: list[str], max_tokens: int) -> tuple[int, int]:
        """(points, tokens per point) so the answer fits the request's budget whole: headers plus every
        paragraph. With too little room the last points go; fewer than MIN_POINTS means no outline."""
        n = len(titles)
        while n >= MIN_POINTS:
            headers = sum(len(self._header_ids(k, titles[k])) for k in range(n))
            budget = min(MAX_POINT_TOKENS, (max_tokens - headers) // n)
            if budget >= MIN_POINT_TOKENS:
                return n, budget
            n -= 1
        return n, 0

    def _header_ids(self, k: int, title: str) -> list[int]:
        """What the answer shows before point k's paragraph (0-based): a line break, then "k. title:"."""
        return self.tok.encode(("\n" if k else "") + point_header(k + 1, title), add_bos=False)

    async def _release(self, segments: list[SharedPrefix]) -> None:
        for seg in reversed(segments):
            await self.coord.release(seg)

    async def _expand(self, request_id: RequestId, segments: list[SharedPrefix], prefix: SharedPrefix,
                      titles: list[str], suffixes: list[list[int]], budget: int, sampling: SamplingSpec,
                      stats: OutlineStats) -> AsyncIterator[int]:
        queues = [asyncio.Queue() for _ in suffixes]
        done = object()
        stats.point_tokens = [0] * len(suffixes)

        async def child(k: int) -> None:
            q = queues[k]
            try:
                for t in self._header_ids(k, titles[k]):
                    q.put_nowait(t)
                text = ""
                seed = sampling.params.seed
                point_sampling = sampling if sampling.greedy or seed is None else sampling.with_seed(seed + k)
                session = self.speculation(suffixes[k]) if self.speculation is not None else None
                steps = self.coord.steps(StepsRequest(RequestId(f"{request_id}/p{k + 1}"), suffixes[k], budget,
                                                      point_sampling, self.eos_ids, wait_s=self.wait_s, fork=prefix,
                                                      speculation=session))
                async with contextlib.aclosing(steps):
                    async for step in steps:
                        if step.token in self.eos_ids:
                            break
                        piece = self.tok.decode([step.token])
                        if not text.strip() and not piece.strip():
                            continue  # blank lines before the paragraph: not part of it
                        text += piece
                        ends = "\n" in text.strip()  # one paragraph per point: the next line is another point
                        if not ends or piece.split("\n", 1)[0].strip():  # its last words may ride on the break
                            q.put_nowait(step.token)
                            stats.point_tokens[k] += 1
                        if ends:
                            break
                q.put_nowait(done)
            except Exception as exc:  # noqa: BLE001 - every reader must hear of it: no silent gaps
                for other in queues:
                    other.put_nowait(PipelineError(f"point {k + 1} of the outline failed: {exc}"))

        tasks = [asyncio.create_task(child(k), name=f"outline-point-{k + 1}") for k in range(len(suffixes))]
        try:
            for q in queues:
                while True:
                    item = await q.get()
                    if item is done:
                        break
                    if isinstance(item, Exception):
                        raise item
                    yield item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._release(segments)
