"""Independent drafting with a separate, smaller model of the same family.

The drafter keeps its own KV cache of the request's committed tokens and
proposes a greedy chain each round; after verification it rolls back to what
was committed. Its tokens must mean what the target's mean, so a pair whose
tokenizers differ is refused up front with a clear error (a mismatched pair
would not change the output — verification guarantees that — but it would
silently waste every round).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence

import torch

from decoding.errors import DrafterError
from decoding.loader.tokenizer import vocabulary_fingerprint
from decoding.pipeline_local import LocalPipeline


def tokenizer_fingerprint(tokenizer) -> str:
    """Equal iff the token ids mean the same (``decoding.loader.tokenizer.vocabulary_fingerprint``);
    a cached tokenizer keeps its own."""
    fp = getattr(tokenizer, "fingerprint", None)
    return fp if isinstance(fp, str) else vocabulary_fingerprint(tokenizer)


def check_same_tokenizer(target_tokenizer, draft_tokenizer, target_name: str = "target",
                         draft_name: str = "draft") -> None:
    if tokenizer_fingerprint(target_tokenizer) != tokenizer_fingerprint(draft_tokenizer):
        raise DrafterError(
            f"the draft model {draft_name} does not share the tokenizer of {target_name}: "
            "speculative drafting needs the same model family and vocabulary")


class ModelDrafter:
    """A draft model on this device: greedy chains of candidates from its own KV cache."""

    name = "draft_model"

    def __init__(self, pipeline: LocalPipeline, seq_id: str = "draft", capacity: int = 4096,
                 lock: threading.Lock | None = None):
        """``lock``: held around every use of ``pipeline`` (requests may share one loaded draft model)."""
        self.pipe = pipeline
        self.seq = seq_id
        self.capacity = min(capacity, pipeline.config.max_position)
        self._lock = lock if lock is not None else contextlib.nullcontext()
        self._tokens: list[int] = []  # tokens whose KV is in the draft cache
        self._started = False
        # Drafted ahead while a verify round was in flight: (assumed context, its chain).
        self._ahead: tuple[tuple[int, ...], list[int]] | None = None
        self.ahead_hits = 0
        self.ahead_misses = 0

    @classmethod
    def from_source(cls, source, target_tokenizer=None, **kw) -> "ModelDrafter":
        if target_tokenizer is not None:
            check_same_tokenizer(target_tokenizer, source.tokenizer, draft_name=str(getattr(source, "path", "")))
        return cls(LocalPipeline.from_source(source, 1), **kw)

    def _sync(self, context: Sequence[int]) -> None:
        """Make the draft cache hold exactly ``context`` minus its last token (the root)."""
        want = list(context[:-1])
        if not self._started:
            self.pipe.create(self.seq, self.capacity)
            self._started = True
        common = 0
        for a, b in zip(self._tokens, want):
            if a != b:
                break
            common += 1
        if common < len(self._tokens):
            self.pipe.truncate(self.seq, common)
            self._tokens = self._tokens[:common]
        if len(want) > common:
            self.pipe.prefill(self.seq, want[common:])
            self._tokens = want

    @torch.inference_mode()
    def propose(self, context: Sequence[int], length: int) -> list[int]:
        """A greedy chain of ``length`` tokens continuing ``context`` (whose last token is the root)."""
        if length <= 0 or not context:
            return []
        with self._lock:
            if self._ahead is not None:
                key, chain = self._ahead
                self._ahead = None
                if key == tuple(context) and len(chain) >= length:
                    self.ahead_hits += 1
                    return chain[:length]
                self.ahead_misses += 1
            return self._propose(context, min(length, self.capacity - len(context)))

    def draft_ahead(self, context: Sequence[int], candidates: Sequence[int], length: int) -> None:
        """While ``candidates`` are being verified, draft the round after them, assuming they are
        all accepted and the target's next token is the one this model predicts after them.
        Used only if that is exactly what gets committed (SpecEdge's proactive drafting)."""
        with self._lock:
            ctx = list(context) + list(candidates)
            room = self.capacity - len(ctx) - 1
            if room <= 1:
                return
            chain = self._propose(ctx, min(length + 1, room))
            if chain:
                assumed = tuple(ctx + chain[:1])
                self._ahead = (assumed, chain[1:])

    def _propose(self, context: Sequence[int], length: int) -> list[int]:
        self._sync(context)
        out: list[int] = []
        tok = int(context[-1])
        for _ in range(length):
            logits = self.pipe.forward(self.seq, torch.tensor([tok], dtype=torch.long, device="cpu"))
            self._tokens.append(tok)
            tok = int(torch.argmax(logits[-1]))
            out.append(tok)
        return out

    def close(self) -> None:
        with self._lock:
            if self._started:
                self.pipe.free(self.seq)
                self._started = False
