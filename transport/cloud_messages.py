"""The cloud verifier's link: a home's drafted chunks out, the verifier's verdicts back.

A home's uplink may be a few Mbit/s with 100 ms of latency: these travel in the
compact positional form (``message(compact=True)``), a greedy round in ~40 bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from partition.ids import CloudSession
from transport.registry import message

__all__ = ["CloudVerify", "CloudVerdict", "CloudClose", "CloudMembers", "CloudHello", "CloudPreview"]

# A home's uplink may be a few Mbit/s with 100 ms of latency: these travel in the
# compact positional form (``message(compact=True)``), a greedy round in ~40 bytes.


@message(compact=True)
@dataclass(frozen=True)
class CloudVerify:
    """Verify a home's drafted chunk on the verifier's bigger model.

    ``session`` is the home's number for one answer (the verifier keys it by the
    home's public key as well, so homes never see each other's). ``start``: the
    positions the home believes the verifier holds for it. ``tokens`` (uint32
    little-endian): the committed tokens from ``start`` on that the verifier has not
    seen — at least the root, the last committed token — then the ``drafts``.
    ``q`` (sampled drafts only): per draft, the drafter's distribution on the
    sampler's support as (uint32 id, float32 prob) pairs; absent for greedy requests,
    and for drafts sent as plain candidates (the verifier then samples its own token
    and accepts a draft that matches it — lossless too, for any drafter).
    ``open`` starts (or restarts after an eviction) the session: its sampling as
    ``SamplingParams.to_dict()`` (temperature, top_k, top_p, seed), ``draws`` already
    spent and ``capacity`` positions.
    ``previews`` (> 0: only to a verifier whose :class:`CloudHello` offered them): stream a
    :class:`CloudPreview` for each exit whose confidence reaches this many percent (an
    integer: one byte on the uplink). A home that predates previews never sends the field,
    so it never receives one.
    """

    session: CloudSession
    start: int
    tokens: bytes
    drafts: int
    q: list[bytes] | None = None
    open: dict | None = None
    previews: int = 0


@message(compact=True)
@dataclass(frozen=True)
class CloudVerdict:
    """The verifier's answer: ``accepted`` drafts, then its own ``token`` (not yet in its cache);
    ``draws`` is how many uniform draws the session's random stream has spent (a resent
    session continues it)."""

    session: CloudSession
    accepted: int
    token: int
    draws: int = 0


@message(compact=True)
@dataclass(frozen=True)
class CloudClose:
    """The answer is done (or abandoned): free the session's cache now."""

    session: CloudSession


@message(compact=True)
@dataclass(frozen=True)
class CloudMembers:
    """An admitted home member vouches for its home's other members' public keys (z85).

    A device that joins the home after it paired with the verifier was not in the
    pairing's key list; any member the verifier already admits sends the home's
    current keys, and the verifier admits them under the same home (bounded per
    home). The reply is an ``Ack`` whose detail counts the keys admitted."""

    keys: list[str] = field(default_factory=list)


@message(compact=True)
@dataclass(frozen=True)
class CloudPreview:
    """An early verdict on a request still being verified: what exit ``layer``'s distribution says.

    Pushed one-way (no reply) before the request's :class:`CloudVerdict`, on the same
    connection. ``at`` is the request's end (its ``start`` plus its tokens), so a home
    tells it from a preview of an earlier request. ``confidence``: the least sure of the
    rows the exit's verdict read (each row's max probability). Only a hint: the home
    may draft ahead from it, but only the final verdict commits a token.
    """

    session: CloudSession
    at: int
    accepted: int
    token: int
    confidence: float
    layer: int


@message(compact=True)
@dataclass(frozen=True)
class CloudHello:
    """A home's first word to a verifier, and the verifier's answer: what this verifier can do.

    The home sends it empty; the verifier answers with the layers after which it can preview
    its verdicts (``previews_at``, empty: none). A verifier that predates the message answers
    with an error, which the home reads as "no previews"."""

    previews_at: list[int] = field(default_factory=list)
