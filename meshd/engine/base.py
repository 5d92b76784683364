"""The seam between the client API and whatever produces tokens.

The API layer only knows :class:`Engine`: a tokenizer, a context length, a
model id, and :meth:`Engine.stream`, which turns a :class:`GenerationRequest`
into :class:`TokenEvent` values. Engines (the whole model on this device, the
cross-daemon pipeline, a test fake) implement one small method,
:meth:`Engine.token_ids`, that yields raw token ids. Everything that must
behave identically whatever the engine — incremental detokenisation, stop
strings (never emitted), finish reasons, usage — lives here, once, in
:meth:`Engine.stream`; when a generation ends (EOS, ``max_tokens``) is one rule,
:class:`Budget`, which the token producers apply too (see there why).
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from decoding.detok import IncrementalDetokenizer
from decoding.speculative.params import SpeculativeStats
from meshd.engine.errors import BadTokenIds, PromptTooLong, out_of_vocab
from meshd.engine.options import Capabilities, RequestOptions
from meshd.log import get_logger
from partition.ids import RequestId

log = get_logger("meshd.engine.base")

# --------------------------------------------------------------------------- messages


@dataclass(frozen=True)
class GenerationStats:
    """How a generation went, beyond its tokens: what the engine tried, as usage reports it.

    ``speculative``: how speculation went (None: not attempted); ``outline``: how an
    outline attempt went (None: none was made; its ``used`` says whether the answer
    came from it); ``cloud``: how a cloud verifier was used (None: it was not);
    ``cached_tokens``: prompt tokens not computed again (a prefix cache held them).
    """

    speculative: SpeculativeStats | None = None
    outline: dict[str, Any] | None = None
    cloud: dict[str, Any] | None = None
    cached_tokens: int = 0  # prompt tokens a prefix cache served (the first attempt's, if it was replayed)
    exits: dict[str, Any] | None = None  # early exits: threshold, tokens that left early and where (None: off)



@dataclass(frozen=True)
class Usage:
    """A generation's token counts and how it went (:class:`GenerationStats`), as replies report them."""

    prompt_tokens: int
    completion_tokens: int
    stats: GenerationStats = field(default_factory=GenerationStats)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def to_dict(self) -> dict[str, Any]:
        s = self.stats
        d: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.total_tokens,
            # OpenAI's name for prompt tokens served from a cache (its SDK reads it here)
            "prompt_tokens_details": {"cached_tokens": s.cached_tokens},
        }
        if s.speculative is not None:
            d["speculative"] = s.speculative.to_dict()
        if s.cloud is not None:
            d["cloud"] = dict(s.cloud)
        if s.outline is not None:
            d["outline"] = dict(s.outline)
        if s.exits is not None:
            d["exits"] = dict(s.exits)
        return d


@dataclass(frozen=True)
class Budget:
    """When a generation ends: at an EOS token, or once ``max_tokens`` tokens are out.

    The one definition of the rule. Whoever produces tokens asks it after each one
    so it stops *computing* there (the coordinator for a mesh request, whoever its
    client is; the local engine's loop): a forward past the end would be wasted and
    overrun the KV capacity sized to it. :meth:`Engine.stream` asks it too, as the
    API's guard over any engine, and to name the finish reason.
    """

    max_tokens: int
    eos_ids: Sequence[int] = ()

    def finish(self, token: int, produced: int) -> str | None:
        """"stop" (``token`` is EOS), "length" (``produced`` tokens, this one included, spent the
        budget) or None (go on)."""
        if token in self.eos_ids:
            return "stop"
        return "length" if produced >= self.max_tokens else None


@dataclass(frozen=True)
class GenerationRequest:
    """One generation, already tokenised by the API layer.

    ``prompt_ids`` is authoritative; ``messages`` is kept for engines that want
    the conversation (e.g. to log it, or to forward it to a cloud helper).
    ``max_tokens`` is the resolved budget (the API clips it to the context).
    ``options`` is the request's one :class:`~meshd.engine.options.RequestOptions`
    (sampling, stop strings, decoding modes), as the API built it; the API sends
    only what the engine's :attr:`Engine.capabilities` cover.
    """

    request_id: RequestId
    prompt_ids: list[int]
    max_tokens: int
    messages: list[dict[str, Any]] | None = None
    options: RequestOptions = field(default_factory=RequestOptions)


Report = Callable[..., None]


def stats_of(ids: AsyncIterator[int]) -> GenerationStats:
    """What an engine's token ids said about how the generation went (nothing, for plain ids)."""
    return ids.stats if isinstance(ids, TokenStream) else GenerationStats()


class TokenStream:
    """An engine's token ids for one request and, once they ended or were closed, how it went.

    The statistics are the generation's output, so they travel back with its tokens:
    ``produce(report)`` makes the ids and calls ``report(speculative=…, outline=…,
    cloud=…)`` as it learns them (in ``finally`` blocks too: a client stopping early
    still gets its usage). The request is never written to.
    """

    def __init__(self, produce: Callable[[Report], AsyncIterator[int]]):
        self._stats = GenerationStats()
        self._source: AsyncIterator[int] | None = None
        self._ids = produce(self._report)

    @classmethod
    def relay(cls, source: AsyncIterator[int],
              through: Callable[[AsyncIterator[int]], AsyncIterator[int]]) -> TokenStream:
        """``source``'s ids passed ``through`` a wrapper (e.g. one that cuts them at shutdown),
        with ``source``'s statistics."""
        stream = cls(lambda report: through(source))
        stream._source = source
        return stream

    @property
    def stats(self) -> GenerationStats:
        return stats_of(self._source) if self._source is not None else self._stats

    def _report(self, **stats: Any) -> None:
        self._stats = replace(self._stats, **stats)

    def __aiter__(self) -> TokenStream:
        return self

    async def __anext__(self) -> int:
        return await self._ids.__anext__()

    async def aclose(self) -> None:
        await self._ids.aclose()


@dataclass(frozen=True)
class TokenEvent:
    """One step of a generation.

    Every generated token gives one event (``text`` may be empty while a
    multi-byte character or a possible stop string is held back). The last
    event has ``finish_reason`` ("stop" or "length"), ``usage``, no token id,
    and whatever text was still held back.
    """

    token_id: int | None
    text: str
    finish_reason: str | None = None
    usage: Usage | None = None


class Tokenizer(Protocol):
    eos_ids: Sequence[int]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def apply_chat(self, messages: list[dict[str, Any]]) -> list[int]: ...


# --------------------------------------------------------------------------- text helpers


class StopMatcher:
    """Cuts generated text at the first stop string, which is never emitted.

    Text that could be the start of a stop string is held back until the next
    delta proves it is not, so a client never sees half of a stop string.
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self._held = ""
        self.stopped = False

    def feed(self, delta: str) -> str:
        """Return the text that is now safe to emit; sets ``stopped`` on a match."""
        if self.stopped:
            return ""
        if not self.stops:
            return delta
        buf = self._held + delta
        cut = min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self._held = ""
            return buf[:cut]
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), hold, -1):
                if buf.endswith(s[:k]):
                    hold = k
                    break
        self._held = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold]

    def flush(self) -> str:
        held, self._held = self._held, ""
        return "" if self.stopped else held


# --------------------------------------------------------------------------- engine


class Engine(abc.ABC):
    """Produces tokens for the API. Subclasses implement :meth:`token_ids`."""

    model_id: str
    context_length: int
    tokenizer: Tokenizer
    capabilities: Capabilities = Capabilities()  # what it honours beyond plain sampling (the API checks)

    @abc.abstractmethod
    def token_ids(self, req: GenerationRequest) -> AsyncIterator[int]:
        """Yield generated token ids for ``req`` (at most ``req.max_tokens``).

        May raise :class:`EngineError` subclasses before the first id (no plan,
        prompt too long for the plan's cache) or later (a device left). When
        the consumer stops early the iterator is closed (``aclose``): the
        engine must then stop computing for this request. An engine with more
        to say than tokens (speculation, outline, cloud statistics) returns a
        :class:`TokenStream`, whose ``stats`` usage reports.
        """

    @property
    def eos_ids(self) -> frozenset[int]:
        return frozenset(self.tokenizer.eos_ids or ())

    def check_prompt(self, prompt_ids: Sequence[int]) -> None:
        """Raise :class:`BadTokenIds` for an id outside the vocabulary (whatever made it: a client's
        token array, a tokenizer that does not match the weights), :class:`PromptTooLong` if no
        token could be generated after it."""
        bad = out_of_vocab(prompt_ids, getattr(self, "vocab_size", None))
        if bad:
            raise BadTokenIds(bad)
        if len(prompt_ids) >= self.context_length:
            raise PromptTooLong(
                f"prompt is {len(prompt_ids)} tokens; the model's context is "
                f"{self.context_length} tokens and at least one must be left to answer"
            )

    async def stream(self, req: GenerationRequest) -> AsyncIterator[TokenEvent]:
        """Text events for ``req``: the one place stop strings are cut, finish reasons named and usage built."""
        self.check_prompt(req.prompt_ids)
        detok = IncrementalDetokenizer(self.tokenizer)
        stops = StopMatcher(req.options.stop)
        budget = Budget(req.max_tokens, self.eos_ids)
        produced = 0
        finish = "length"
        ids = self.token_ids(req)
        async with contextlib.aclosing(ids):
            async for tid in ids:
                ends = budget.finish(tid, produced + 1)
                if ends == "stop":  # EOS: never shown
                    finish = "stop"
                    break
                produced += 1
                text = stops.feed(detok.push(tid))
                if stops.stopped:
                    finish = "stop"
                    yield TokenEvent(tid, text)
                    break
                yield TokenEvent(tid, text)
                if ends == "length":
                    finish = "length"
                    break
            else:
                # The engine ended without EOS before the budget: treat as a
                # natural stop (e.g. the engine's own end-of-context).
                finish = "stop" if produced < req.max_tokens else "length"
        tail = "" if stops.stopped else stops.feed(detok.flush()) + stops.flush()
        yield TokenEvent(None, tail, finish, Usage(len(req.prompt_ids), produced, stats_of(ids)))


def model_id_of(source) -> str:
    """A readable model id for ``/v1/models``: the file (or directory) name without extension."""
    from pathlib import Path

    path = Path(getattr(source, "path", "") or "model")
    return path.stem if path.suffix == ".gguf" else path.name
