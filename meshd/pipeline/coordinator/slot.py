"""One request as the coordinator holds it: what was asked, and where it stands.

A request outlives the sequences that carry it: when a device leaves, the
coordinator replays it on a fresh sequence (perhaps on a new plan) from the
prompt and the tokens generated so far. So what was asked
(:class:`StepsRequest`, frozen) is kept apart from the state that moves
(:class:`RequestSlot`: generated tokens, the current :class:`Flight`, the
phase). The next features (a cross-request prefix cache) hang their per-request
state here, not on argument lists.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from decoding.sampling import SamplingSpec
from decoding.speculative.params import MAX_CANDIDATES
from decoding.speculative.session import SpeculationSession
from meshd.engine.base import Budget
from meshd.pipeline.route import Route
from meshd.pipeline.seqkey import SeqKey
from partition.ids import RequestId
from transport.stage_messages import TokenResult

__all__ = ["Cuts", "Flight", "RequestSlot", "SharedPrefix", "SlotState", "StepsRequest", "TokenStep"]

Cuts = list[int] | Callable[[int, Route], list[int]] | None


@dataclass(frozen=True)
class TokenStep:
    token: int
    topk_ids: list[int] | None = None
    topk_probs: list[float] | None = None
    cached: int | None = None  # on an attempt's first step: prompt positions it reused from the stages' caches
    exit_layer: int = 0  # the token left the model after this many layers (0: it went through all of them)

    @classmethod
    def of(cls, result: TokenResult) -> TokenStep:
        """The step a last stage's plain (not verify) result carries."""
        return cls(int(result.token_ids[0]),
                   result.topk_ids.tolist() if result.topk_ids is not None else None,
                   result.topk_probs.tolist() if result.topk_probs is not None else None,
                   exit_layer=int(result.exit_layer))


@dataclass
class SharedPrefix:
    """A sequence kept in every stage's cache after its request ended, for children to fork from.

    Outline decoding writes the outline once and expands every point from it:
    each child reads these ``length`` positions in place on every stage. The
    owner frees it (:meth:`PipelineCoordinator.release`) when the last child is done.
    """

    request_id: RequestId
    route: Route | None = None
    seq: SeqKey | None = None
    length: int = 0


@dataclass(frozen=True)
class StepsRequest:
    """One generation as a coordinator client asks for it (see :meth:`PipelineCoordinator.steps`).

    ``cuts``: the prompt's cut points, or a function (length, route) -> cut points,
    asked again whenever the request is replayed on a new route. ``return_topk`` > 0:
    each step carries its top-k probabilities (only k ids and probabilities travel
    back, never logits). ``speculation``: decode in verify rounds drafted by this
    session. ``context_limit`` bounds a round's KV positions. ``keep``: leave the
    sequence in the stages' caches when the request ends (or the caller stops after
    a step), described there for children to fork from; plain decoding only.
    ``fork``: this request continues ``fork``'s sequence, read in place. Neither
    ``keep`` nor ``fork`` can be replayed on another plan. ``exit_threshold`` > 0: a
    decode step's token may leave the model early (Synera; lossy, see ``decoding.exits``).
    """

    request_id: RequestId
    prompt_ids: Sequence[int]
    max_tokens: int
    sampling: SamplingSpec = field(default_factory=SamplingSpec)
    eos_ids: Sequence[int] = ()
    cuts: Cuts = None
    chunks: int | None = None
    return_topk: int = 0
    wait_s: float | None = None
    speculation: SpeculationSession | None = None
    typical: bool = False
    context_limit: int | None = None
    keep: SharedPrefix | None = None
    fork: SharedPrefix | None = None
    exit_threshold: float = 0.0


@dataclass
class Flight:
    """One sequence of a request on one route: results for ``seq`` arrive on ``queue``; ``progress_at``
    is when a stage last said it advances on it (``loop.time()``; 0: never)."""

    request_id: RequestId
    route: Route
    seq: SeqKey
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    progress_at: float = 0.0


class SlotState(enum.Enum):
    WAITING = "waiting"  # for a route whose stages all serve its plan
    RUNNING = "running"  # a flight is prefilling or decoding
    REPLAYING = "replaying"  # its sequence was lost: waiting to re-prefill on the next route
    DONE = "done"


@dataclass
class RequestSlot:
    """A request's state in the coordinator, from admission until its last sequence is freed.

    ``sampling`` is the request's spec with a seed fixed at admission (the coordinator
    owns the random stream, so a replay continues it); ``generated`` is what a replay
    re-prefills after the prompt.
    """

    request: StepsRequest
    sampling: SamplingSpec
    generated: list[int] = field(default_factory=list)
    state: SlotState = SlotState.WAITING
    flight: Flight | None = None
    replays: int = 0
    reuse: bool = True  # may still start on the stages' cached prefix (False after a stage missed it)
    avoid: str | None = None  # a device that just failed this request: its replay takes another route if any

    @property
    def request_id(self) -> RequestId:
        return self.request.request_id

    @property
    def context(self) -> list[int]:
        """What the stages must hold before the next token: prompt, then every generated token."""
        return list(self.request.prompt_ids) + self.generated

    def ends_with(self, token: int) -> bool:
        """Whether ``token`` (just generated, and appended) is the request's last (:class:`Budget`)."""
        return Budget(self.request.max_tokens, self.request.eos_ids).finish(token, len(self.generated)) is not None

    def grammar_end(self) -> list[TokenStep]:
        """The steps after a token that completed the grammar: nothing may follow but the end (an EOS
        when the request has one)."""
        eos = self.request.eos_ids
        return [TokenStep(min(eos))] if eos else []

    def capacity(self) -> int:
        """KV positions a sequence of this request may need on every stage."""
        r = self.request
        n = len(r.prompt_ids) + r.max_tokens + (MAX_CANDIDATES + 1 if r.speculation is not None else 0)
        return min(n, r.context_limit) if r.context_limit else n

    def shaping(self) -> dict:
        """Fields of a last prompt chunk that make the last stage build a grammar / penalty
        state for the sequence (every other message carries the spec unshaped)."""
        sampling, prompt_ids = self.sampling, self.request.prompt_ids
        if not sampling.shaped:
            return {}
        out: dict = {"sampling": sampling, "history": list(self.generated)}
        if sampling.penalties.active:
            n = sampling.penalties.repeat_last_n
            out["prompt_tail"] = list(prompt_ids if n < 0 else prompt_ids[len(prompt_ids) - n:] if n else [])
        return out
