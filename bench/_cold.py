"""Cold or warm, and meant: a timed section says whether its prompt was cached, and is checked.

Since the stages keep finished prompts (the prefix cache), a benchmark that runs several methods
over the same prompt on long-lived stages measures a cache hit for every method after the first —
and calls it a prefill. So every benchmark that times prefill or TTFT wraps each timed section in
:meth:`CacheGuard.cold` (or :meth:`CacheGuard.warm` where warm requests are the subject): the
stages' own ``reused_tokens`` counters are read before and after, and a cold section during which
any stage reused a cached position fails the run with :class:`CacheHit` instead of printing a
figure.

Two ways to keep a section cold, and each benchmark says which it chose:
- the prefix cache off at the coordinator (``ProcessMesh(prefix_cache=False)``): nothing is reused;
- prompts no stage has seen (:func:`unseen`): the real path with the cache on (probes, keeps),
  each timed prompt made new by replacing its *first* token, so its length — and with it the
  planner's cut points — stay exactly as they were (a nonce *inserted* at the start would shift them).
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

__all__ = ["CacheGuard", "CacheHit", "Section", "unseen", "COLD_OFF", "COLD_UNSEEN"]

COLD_OFF = "cold: prefix cache off at the coordinator (every prompt prefilled in full; stage counters checked)"
COLD_UNSEEN = ("cold: prefix cache on, every timed prompt unseen by the stages (its first token replaced, "
               "length and cuts unchanged; stage counters checked)")


class CacheHit(RuntimeError):
    """A section measured as cold reused cached positions: its figure would be a cache hit."""


@dataclass
class Section:
    """One timed section's prefix-cache record: positions the stages reused while it ran."""

    what: str
    cold: bool
    reused_tokens: int = 0


class CacheGuard:
    """Reads a mesh's reuse counter (all stages added) around each timed section."""

    def __init__(self, reused_tokens: Callable[[], Awaitable[int]]):
        self._read = reused_tokens
        self.sections: list[Section] = []

    @contextlib.asynccontextmanager
    async def cold(self, what: str):
        """A section whose prompts must be computed in full: any reused position raises CacheHit."""
        section = await self._enter(what, cold=True)
        yield section
        await self._leave(section)
        if section.reused_tokens:
            raise CacheHit(f"{what}: measured as cold, but the stages reused {section.reused_tokens} cached "
                           f"prompt positions while it ran — the figure would be a prefix-cache hit, not a "
                           f"prefill; make its prompts unseen or turn the prefix cache off")

    @contextlib.asynccontextmanager
    async def warm(self, what: str):
        """A section about warm requests: what it reused is recorded (and reported), never refused."""
        section = await self._enter(what, cold=False)
        yield section
        await self._leave(section)

    async def _enter(self, what: str, cold: bool) -> Section:
        section = Section(what, cold, -(await self._read()))
        self.sections.append(section)
        return section

    async def _leave(self, section: Section) -> None:
        section.reused_tokens += await self._read()

    def summary(self) -> dict:
        """For a benchmark's JSON: how many sections ran cold and warm, and what the warm ones reused."""
        cold = [s for s in self.sections if s.cold]
        warm = [s for s in self.sections if not s.cold]
        return {"cold_sections": len(cold), "cold_reused_tokens": sum(s.reused_tokens for s in cold),
                "warm_sections": len(warm), "warm_reused_tokens": sum(s.reused_tokens for s in warm)}


def unseen(ids: Sequence[int], serial: int, vocab_size: int, base: int = 1000) -> list[int]:
    """``ids`` with its first token replaced by id ``base + serial``: a prompt of the same length that
    shares no prefix with any prompt of another serial (nor with ``ids`` itself, whose first token is a
    special one in every chat prompt). Ids from ``base`` up are ordinary text tokens in our vocabularies."""
    first = base + serial
    if not 0 <= first < vocab_size:
        raise ValueError(f"serial {serial} is past the vocabulary ({vocab_size} ids from {base})")
    return [first, *list(ids)[1:]]
