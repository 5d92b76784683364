"""A pass's LM-head rows, computed when read and only over the tokens the reader may choose.

The last stage's head is the largest product of a step (a 152k-token vocabulary: 15-20 % of a
Qwen decode step on a CPU) and two of its uses need far less than all of it: a verify round
reads the rows of the path it accepts and the token after it, not the rejected candidates'; and
under a grammar a position often allows a few hundred tokens (a tool call's keys, separators,
tool names), whose logits are all a masked draw looks at. :class:`HeadRows` holds the final-normed
hidden rows and multiplies a row when it is read, over ``allowed`` tokens when given (the others
are ``-inf``, as the mask would make them). In the ``gguf`` mode a head row's value depends only on
its own blocks and the activations, so a selected product gives exactly the bits the full one
would: nothing downstream can tell the difference.
"""

from __future__ import annotations

import torch

#: Multiply only the allowed tokens when they are fewer than this share of the vocabulary.
SELECT_BELOW = 0.25


class HeadRows:
    def __init__(self, normed: torch.Tensor, head, vocab_size: int):
        """``normed``: final-normed hidden rows [n, hidden]; ``head``: a :class:`~decoding.quant.blocks.BlockLinear`."""
        self.normed = normed
        self._head = head
        self._vocab = int(vocab_size)
        self._rows: dict[int, torch.Tensor] = {}  # full rows computed so far
        self.products = 0  # rows multiplied (tests and benchmarks count them)
        self.selected = 0  # of those, over a grammar's allowed tokens only

    def __len__(self) -> int:
        return int(self.normed.shape[0])

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.row(int(i))

    def row(self, i: int, allowed: torch.Tensor | None = None) -> torch.Tensor:
        """float32 [vocab]: row ``i``'s logits; with ``allowed`` (bool [vocab]) and few of them, only
        those are computed and every other token is ``-inf``. A row read whole is computed with every
        other row not read yet, in one product (a walk that reads several pays one pass over the head,
        as the eager path does; one that stops at the first pays the rows it did not need)."""
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"head row {i} of {n}")
        i = i + n if i < 0 else i
        if i in self._rows:
            return self._rows[i]
        if allowed is not None:
            ids = allowed.nonzero().flatten()
            if 0 < ids.numel() < SELECT_BELOW * self._vocab:
                self.products += 1
                self.selected += 1
                out = torch.full((self._vocab,), float("-inf"))
                out[ids] = self._head.only(ids)(self.normed[i:i + 1])[0].float()
                return out
        todo = [j for j in range(n) if j not in self._rows]
        self.products += len(todo)
        for j, out in zip(todo, self._head(self.normed[todo]).float()):
            self._rows[j] = out
        return self._rows[i]
