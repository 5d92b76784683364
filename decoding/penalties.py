"""Repetition penalties: OpenAI's presence/frequency and llama.cpp/Ollama's repeat penalty.

Applied to the logits before sampling (and before a structured-output mask):

* ``presence`` (OpenAI, additive): ``-presence`` for every token already
  generated at least once;
* ``frequency`` (OpenAI, additive): ``-frequency * count`` per generated token;
* ``repeat`` (llama.cpp / Ollama, multiplicative): over the last
  ``repeat_last_n`` tokens of prompt + answer, positive logits are divided by
  ``repeat`` and negative ones multiplied by it.

OpenAI's penalties count only the generated tokens (as vLLM does); the repeat
penalty looks back into the prompt, as llama.cpp does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch


@dataclass(frozen=True)
class Penalties:
    presence: float = 0.0
    frequency: float = 0.0
    repeat: float = 1.0
    repeat_last_n: int = 64

    @property
    def active(self) -> bool:
        return self.presence != 0.0 or self.frequency != 0.0 or self.repeat != 1.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Penalties:
        """The penalties a peer sent; anything but known numeric fields is a ``ValueError``
        (a hostile message must fail at the door, not in the middle of a forward)."""
        kinds = {f.name: f.type for f in fields(cls)}
        unknown = set(d) - set(kinds)
        if unknown:
            raise ValueError(f"unknown penalty field(s) {', '.join(sorted(map(str, unknown)))}")
        out: dict[str, Any] = {}
        for name, value in d.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                    (kinds[name] == "int" and not isinstance(value, int)):
                raise ValueError(f"penalty {name!r} must be a number, got {type(value).__name__}")
            out[name] = int(value) if kinds[name] == "int" else float(value)
        return cls(**out)

    def apply(self, logits: torch.Tensor, prompt_ids: Sequence[int],
              generated_ids: Sequence[int]) -> torch.Tensor:
        """Penalised copy of ``logits`` ``[vocab]`` (the input is not modified)."""
        if not self.active:
            return logits
        out = logits.float().clone()
        vocab = out.shape[-1]
        if generated_ids and (self.presence or self.frequency):
            ids = torch.tensor([t for t in generated_ids if 0 <= t < vocab], dtype=torch.long, device=out.device)
            counts = torch.bincount(ids, minlength=vocab).to(out.dtype)
            out -= self.frequency * counts + self.presence * (counts > 0).to(out.dtype)
        if self.repeat != 1.0 and self.repeat_last_n != 0:
            window = [*prompt_ids, *generated_ids]
            if self.repeat_last_n > 0:
                window = window[-self.repeat_last_n:]
            seen = torch.tensor(sorted({t for t in window if 0 <= t < vocab}), dtype=torch.long, device=out.device)
            if len(seen):
                vals = out[seen]
                out[seen] = torch.where(vals > 0, vals / self.repeat, vals * self.repeat)
        return out
