"""The stage protocol: the work a pipeline stage is sent and what its last stage answers.

A coordinator sends ``StageForward`` chunks down a route; the last stage answers with
a ``TokenResult``. Around them: cutting a sequence's cache back (``Truncate``), freeing
or keeping it as a cached prefix (``FreeSequence``, ``CacheSequence``), forking one
(``ForkSequence``) and reusing a cached prefix (``PrefixProbe``/``PrefixMatch``,
``ReusePrefix``). Every one carries ``plan_version``, so a stage refuses work computed
against a stale partition instead of mixing layers. The request's sampling travels as
one :class:`~decoding.sampling.SamplingSpec`, flattened into 0.2's header fields
(``SAMPLING_WIRE``) so mixed homes work.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from decoding.penalties import Penalties
from decoding.sampling import SamplingParams, SamplingSpec
from partition.ids import PlanVersion, RequestId, SeqKey
from transport.registry import WirePart, activation, flattened, later, message

__all__ = ["SAMPLING_WIRE", "StageForward", "TokenResult", "Truncate", "FreeSequence", "ForkSequence",
           "PrefixProbe", "PrefixMatch", "ReusePrefix", "CacheSequence", "StageProgress"]


def _sampling_to_wire(s: SamplingSpec) -> dict[str, Any]:
    p = s.params
    return {"temperature": p.temperature, "top_k": p.top_k, "top_p": p.top_p, "seed": p.seed,
            "constraint": s.constraint, "penalties": s.penalties.to_dict() if s.penalties.active else None}


def _sampling_from_wire(d: dict[str, Any]) -> SamplingSpec:
    params = SamplingParams(d["temperature"], d["top_k"], d["top_p"], d["seed"])
    return SamplingSpec(params, Penalties.from_dict(d["penalties"]) if d["penalties"] else Penalties(),
                        d["constraint"])


#: A :class:`decoding.sampling.SamplingSpec` as StageForward has carried it since 0.2: flat
#: fields, the penalties as a dict (None when inactive). Members on 0.2 read and send exactly these.
SAMPLING_WIRE = WirePart(
    {"temperature": float, "top_k": int, "top_p": float, "seed": int | None,
     "constraint": dict | None, "penalties": dict | None},
    _sampling_to_wire, _sampling_from_wire)


@message
@dataclass(frozen=True)
class StageForward:
    """One chunk of work for the next pipeline stage.

    ``hidden`` carries activations ([tokens, hidden] float32, may travel as
    float16/bfloat16); the first stage gets ``token_ids`` instead. The final
    stage sends its ``TokenResult`` to ``reply_to``.

    ``seq_id`` is the home-wide sequence key (coordinator node id + its own
    counter), never a bare per-coordinator number: two daemons coordinating at
    once must never touch each other's caches. ``sampling`` is the request's one
    :class:`~decoding.sampling.SamplingSpec` (flat fields on the wire, see
    ``SAMPLING_WIRE``); its shaping (penalties, grammar) rides only on a
    sequence's last prompt chunk, with ``prompt_tail`` and ``history``: the last
    stage builds the sequence's selector from that one and keeps it.
    ``sample_step`` is how many tokens this request has already sampled, so a
    request replayed on a new plan continues the same seeded random stream.

    Speculative decoding adds a *verify round*: ``token_ids`` (which then
    travel to every stage) are the root — the last committed token — and the
    drafted candidates, ``tree_parents`` their token tree (parent index per
    node, -1 for the root; absent = a chain). Every stage writes their KV at
    [position_offset, position_offset + m); the last stage decides acceptance.
    The previous round's outcome rides in the header of the next:
    ``commit_start``/``commit_keep`` tell each stage which of the nodes it wrote
    at ``commit_start`` to keep (in order) before it runs this one, so the
    rollback reaches every stage before its next forward without any extra
    message. ``medusa_paths`` asks the last stage for that many Medusa tree
    paths from the last accepted token; ``typical`` opts into Medusa's lossy
    typical acceptance.
    """

    request_id: RequestId
    plan_version: PlanVersion
    seq_id: SeqKey
    position_offset: int
    chunk_index: int = 0
    hidden: torch.Tensor | None = activation()
    token_ids: torch.Tensor | None = None
    tree_mask: torch.Tensor | None = None
    reply_to: str = ""
    is_last_chunk: bool = True
    capacity: int = 0  # KV positions the whole request may need (prompt + max tokens)
    sampling: SamplingSpec = flattened(SAMPLING_WIRE, default_factory=SamplingSpec)
    sample_step: int = 0
    return_topk: int = 0
    verify: bool = False
    tree_parents: list[int] | None = None
    commit_start: int = -1
    commit_keep: list[int] | None = None
    medusa_paths: int = 0
    typical: bool = False
    # With a shaped ``sampling`` (a sequence's last prompt chunk): the prompt's tail the
    # penalties look back into, and the tokens generated so far (a replay rebuilds that state).
    prompt_tail: list[int] | None = None
    history: list[int] | None = None
    # Edge drafting for a cloud verifier: the last stage also reports the final layer's
    # head-averaged attention of this step's row on the sequence's last ``attention_tail``
    # positions (TokenResult.attention), from which the home judges a chunk's importance.
    attention_tail: int = 0
    # Early exits (Synera): a decode step's token may leave the model at an exit layer whose top-2
    # margin clears this threshold (0: off, the model's full depth always).
    exit_threshold: float = later(0.0)


@message
@dataclass(frozen=True)
class TokenResult:
    """The last stage's answer: the sampled token, or for a verify round every token it committed
    (accepted candidates, then its own next token), the accepted node ``path`` (root first) and,
    when asked, the Medusa ``proposals`` for the next round (one token sequence per tree path);
    ``note`` says why proposals are missing (e.g. the heads could not be loaded)."""

    request_id: RequestId
    plan_version: PlanVersion
    seq_id: SeqKey
    token_ids: torch.Tensor
    topk_ids: torch.Tensor | None = None
    topk_probs: torch.Tensor | None = None
    logprobs: list[float] | None = None
    chunk_index: int = 0
    path: list[int] | None = None
    proposals: list[list[int]] | None = None
    proposal_values: list[float] | None = None  # each proposal's estimated chance of acceptance
    note: str = ""
    finished: bool = False  # the grammar is complete: the answer ends after these tokens
    attention: list[float] | None = None  # see StageForward.attention_tail
    exit_layer: int = later(0)  # the token left the model after this many layers (0: it went through all)


@message
@dataclass(frozen=True)
class Truncate:
    """Cut a sequence's KV cache back to ``new_length`` (rejected drafts)."""

    plan_version: PlanVersion
    seq_id: SeqKey
    new_length: int


@message
@dataclass(frozen=True)
class FreeSequence:
    """Release a sequence's KV cache; the stage also remembers the key (a tombstone)
    so prompt chunks still queued upstream cannot re-create it after the free."""

    plan_version: PlanVersion
    seq_id: SeqKey


@message
@dataclass(frozen=True)
class ForkSequence:
    """Start ``seq_id`` sharing the first ``prefix_length`` KV entries of ``parent_id``."""

    plan_version: PlanVersion
    seq_id: SeqKey
    parent_id: SeqKey
    prefix_length: int


@message
@dataclass(frozen=True)
class PrefixProbe:
    """How many leading ``token_ids`` does this stage hold the KV of (a finished or running request's)?
    Answered with ``PrefixMatch`` at once (it overtakes queued work, like a free)."""

    plan_version: PlanVersion
    token_ids: torch.Tensor


@message
@dataclass(frozen=True)
class PrefixMatch:
    plan_version: PlanVersion
    length: int


@message
@dataclass(frozen=True)
class ReusePrefix:
    """Start ``seq_id`` on the KV this stage holds for ``prefix_ids`` (forked, not copied), then pass it
    on; a stage that no longer holds all of it answers ``prefix_miss`` and the request is prefilled in
    full. Travels down the chain ahead of the sequence's first chunk, as a fork does."""

    request_id: RequestId
    plan_version: PlanVersion
    seq_id: SeqKey
    prefix_ids: torch.Tensor
    capacity: int = 0  # KV positions the whole request may need (its prefix included)
    reply_to: str = ""


@message
@dataclass(frozen=True)
class CacheSequence:
    """The request of ``seq_id`` ended: keep what the sequence holds as a cached prefix (the stage
    keeps only verified positions, within its cache's share of the KV budget) instead of freeing it.
    Tombstones the key like ``FreeSequence``."""

    plan_version: PlanVersion
    seq_id: SeqKey


@message
@dataclass(frozen=True)
class StageProgress:
    """A stage is computing, or holds queued behind what it computes, work of ``seq_ids``: sent to
    their coordinator every few seconds while a pass runs, so a coordinator waits on progress rather
    than on a speed it assumed (a slow device is not a dead one; a stuck one stops sending).

    ``done``: rows x layers this stage has computed since it started, a count that grows with every
    layer of every pass; a stage sends only when it grew since its last report."""

    node_id: str
    seq_ids: list[str]
    done: int
