"""From a position's logits to the next token: penalties, then the grammar mask, then the sampler.

One object per generated sequence, wherever its last stage runs (the local
engine, or the last stage of the mesh). It remembers what it generated, which
repetition penalties and the grammar depend on; a sequence replayed on a new
last stage is rebuilt from the prompt's tail and the tokens already generated
(``history``), so the grammar, the penalties and the random stream continue
exactly where they were.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from decoding.penalties import Penalties
from decoding.sampling import Sampler, SamplingParams, SamplingSpec


class TokenSelector:
    def __init__(self, sampling: SamplingParams, *, penalties: Penalties | None = None, constraint=None,
                 prompt_tail: Sequence[int] = (), eos_ids: Sequence[int] = (), history: Sequence[int] = (),
                 skip: int | None = None):
        """``skip``: random draws already spent (default: one per token of ``history``)."""
        self.sampler = Sampler(sampling, skip=len(history) if skip is None else skip)
        self.penalties = penalties if penalties is not None and penalties.active else None
        self.constraint = constraint
        self.prompt_tail = list(prompt_tail)
        self.eos_ids = frozenset(eos_ids)
        self.generated: list[int] = []
        self._mask: torch.Tensor | None = None  # the grammar's mask at the current position, once computed
        for t in history:
            self._accept(int(t))

    @classmethod
    def for_spec(cls, spec: SamplingSpec, *, tokenizer=None, vocab_size: int = 0, prompt_tail: Sequence[int] = (),
                 history: Sequence[int] = (), skip: int | None = None) -> TokenSelector:
        """The selector ``spec`` asks for. Its grammar, if any, is compiled here against
        ``tokenizer`` (its ``tokenizer.json`` ``path`` and ``eos_ids``): only the place that
        samples holds one."""
        constraint, eos = None, ()
        if spec.constraint is not None:
            from decoding.constrained import constraint_for

            eos = tuple(tokenizer.eos_ids)
            constraint = constraint_for(spec.constraint, tokenizer, vocab_size)
        return cls(spec.params, penalties=spec.penalties, constraint=constraint, prompt_tail=prompt_tail,
                   eos_ids=eos, history=history, skip=skip)

    @property
    def plain(self) -> bool:
        """No penalties and no grammar: the distribution is the model's (speculation may verify it)."""
        return self.penalties is None and self.constraint is None

    @property
    def finished(self) -> bool:
        """The grammar is complete: nothing may follow but the end of the answer."""
        return self.constraint is not None and self.constraint.is_finished()

    def allowed(self) -> torch.Tensor | None:
        """The grammar's mask for the next token (None: no grammar), computed once per position: a lazy
        LM head reads it to multiply only these tokens, and the draw reads it again."""
        if self.constraint is None:
            return None
        if self._mask is None:
            self._mask = self.constraint.allowed_mask()
        return self._mask

    def adjust(self, logits: torch.Tensor) -> torch.Tensor:
        if self.penalties is not None:
            logits = self.penalties.apply(logits, self.prompt_tail, self.generated)
        if self.constraint is not None:
            logits = logits.masked_fill(~self.allowed().to(logits.device), float("-inf"))
        return logits

    def __call__(self, logits: torch.Tensor) -> int:
        tok = self.sampler(self.adjust(logits))
        self._accept(tok)
        return tok

    def _accept(self, tok: int) -> None:
        self.generated.append(tok)
        self._mask = None
        if self.constraint is not None and tok not in self.eos_ids:
            self.constraint.advance(tok)
