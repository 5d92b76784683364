"""A verification request as it arrives from a home: decoded, checked, refused with a reason.

Everything here runs on the event loop before a request is queued, so a
malformed request costs its sender a clear ``bad_request`` and never reaches
a batched pass (where one job's problem would be everyone's).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from decoding.offload.loop import SUPPORT_MAX
from decoding.sampling import BadSamplingParams, SamplingParams
from decoding.speculative.verify import dense_draft_probs
from meshd.errors import MeshdError
from transport.cloud_messages import CloudVerify

MAX_DRAFTS = 16
DEFAULT_CAPACITY = 1024


class VerifierRefusal(MeshdError):
    """A request the verifier answers with an error: ``code`` is busy, evicted, bad_request, ..."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


Support = list[tuple[list[int], list[float]]]  # per draft: (token ids, their probabilities)


@dataclass(frozen=True)
class SessionOpen:
    """What a request that opens a session asks for: its sampling, draws already made, positions."""

    params: SamplingParams
    draws: int
    capacity: int


def checked(msg: CloudVerify, vocab: int, max_position: int) -> tuple[list[int], Support | None]:
    """The request's tokens, and its drafts' distributions (None when the home sent none)."""
    tokens = _unpack_tokens(msg.tokens)
    if not 1 <= msg.drafts <= MAX_DRAFTS or len(tokens) < msg.drafts + 1:
        raise VerifierRefusal("bad_request", f"drafts must be 1..{MAX_DRAFTS} and come after at least "
                                             "one committed token")
    if any(t >= vocab for t in tokens):
        raise VerifierRefusal("bad_request", f"token ids must be below the vocabulary size {vocab}")
    if not 0 <= msg.previews <= 100:
        raise VerifierRefusal("bad_request", "previews must be a confidence in percent, 0 (none) to 100")
    if msg.start < 0 or msg.start + len(tokens) > max_position:
        raise VerifierRefusal("bad_request", f"positions [{msg.start}, {msg.start + len(tokens)}) do not fit "
                                             f"the model's context of {max_position}")
    support = None
    if msg.q is not None:
        if len(msg.q) != msg.drafts:
            raise VerifierRefusal("bad_request", f"q has {len(msg.q)} rows for {msg.drafts} drafts")
        try:
            support = [_unpack_support(row) for row in msg.q]
            dense_draft_probs(support, vocab)  # checked here, on the event loop, not in the pass
        except (ValueError, struct.error) as exc:
            raise VerifierRefusal("bad_request", f"bad draft distribution: {exc}") from None
    return tokens, support


def session_open(msg: CloudVerify, max_position: int) -> SessionOpen:
    """The session ``msg.open`` asks for; its capacity fits the model and at least this request."""
    spec = msg.open or {}
    unknown = set(spec) - {*SamplingParams().to_dict(), "draws", "capacity"}
    if unknown:
        raise VerifierRefusal("bad_request", f"open: unknown field(s) {sorted(unknown)}")
    if msg.start != 0:
        raise VerifierRefusal("bad_request", "a session opens at position 0")
    try:
        params = SamplingParams.from_dict(spec)
        draws = int(spec.get("draws", 0))
        cap = int(spec.get("capacity", DEFAULT_CAPACITY))
    except (TypeError, ValueError, BadSamplingParams) as exc:
        raise VerifierRefusal("bad_request", f"open: {exc}") from None
    if not 0 <= draws <= 1 << 24:
        raise VerifierRefusal("bad_request", "open: draws out of range")
    tokens = len(msg.tokens) // 4
    cap = max(min(cap, max_position), tokens + MAX_DRAFTS + 1)
    return SessionOpen(params, draws, cap)


def _unpack_tokens(raw: bytes) -> list[int]:
    if len(raw) % 4:
        raise VerifierRefusal("bad_request", "tokens must be uint32 little-endian (length a multiple of 4)")
    return list(struct.unpack(f"<{len(raw) // 4}I", raw))


def _unpack_support(raw: bytes) -> tuple[list[int], list[float]]:
    if len(raw) % 8 or not raw or len(raw) // 8 > SUPPORT_MAX:
        raise VerifierRefusal("bad_request", f"a draft's distribution is 1..{SUPPORT_MAX} (uint32 id, float32 p) pairs")
    vals = struct.unpack("<" + "If" * (len(raw) // 8), raw)
    return list(vals[0::2]), list(vals[1::2])
