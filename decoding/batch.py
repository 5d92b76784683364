"""What a batched forward is asked for, and how each sequence's rows are laid out in it.

Any decoder architecture takes the same request (:class:`BatchItem`, one per
sequence) and plans its rows the same way (:class:`RowPlan`: positions, mask,
where they go in the KV cache); only the block that runs over them differs
(``decoding.models``). The scheduler and the cloud verifier build items; they
never ask which architecture runs them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from decoding.masks import chunk_mask, tree_depths, with_prefix
from decoding.quant.packed import DENSE_FROM_ROWS

#: Positions a packed stage computes as one block (see RowPlan.of); the dense regime's row count.
EXACT_BLOCK = DENSE_FROM_ROWS


@dataclass(frozen=True)
class BatchItem:
    """One sequence's share of a batched forward (the arguments of a stage's ``forward``)."""

    seq_id: object
    x: torch.Tensor
    tree_mask: torch.Tensor | None = None
    all_logits: bool = True
    head: bool = True
    return_normed: bool = False
    logit_rows: int = 0  # with all_logits: only the last this many rows (0: all)
    attention_tail: int = 0  # see the stage's forward_batch ``probes``
    exit_threshold: float = 0.0  # a decode step may leave at an exit layer with this top-2 margin (0: never)
    lazy_head: bool = False  # the head's rows are computed when read (decoding.head_rows), not in the pass
    # only the row's best token is read (a greedy step nothing else looks at): a tensor group may gather each
    # member's best instead of whole rows (decoding.tensor_group.best_rows)
    best_only: bool = False

    @property
    def may_exit(self) -> bool:
        """A plain one-token decode step that asked for early exits (never a prompt, a tree or a probe)."""
        return (self.exit_threshold > 0 and self.head and not self.all_logits and not self.return_normed
                and self.tree_mask is None and self.attention_tail == 0 and self.x.shape[0] == 1)

    @property
    def tokens(self) -> int:
        return int(self.x.shape[0])

    def on(self, device: torch.device) -> "BatchItem":
        """This item with its tensors on ``device`` (the one host-to-device copy of a message)."""
        mask = self.tree_mask
        if self.x.device == device and (mask is None or mask.device == device):
            return self
        return dataclasses.replace(self, x=self.x.to(device),
                                   tree_mask=None if mask is None else mask.to(device))


@dataclass
class RowPlan:
    n: int
    positions: torch.Tensor
    mask: torch.Tensor | None
    causal: bool
    offset: int = 0
    probe_tail: int = 0
    probe_index: int = 0
    past: int = 0
    exact: bool = False  # a packed stage: each row computed the same way whatever came with it
    whole: torch.Tensor | None = None  # exact, bool [n]: rows of whole EXACT_BLOCK position blocks

    @classmethod
    def of(cls, it: BatchItem, past: int, device: torch.device, exact: bool = False) -> "RowPlan":
        """Positions and mask of ``it``'s rows, built on the stage's ``device`` (a tree mask is already there).

        ``exact`` (packed stages): a row's result must not depend on how the
        sequence was cut into messages, nor on what was batched with it. Rows that
        fill a whole block of EXACT_BLOCK positions ``[64 k, 64 k + 64)`` take the
        dense path together (a prompt, however it is cut at block boundaries); every
        other row (decode steps, verify rounds, a prompt's last partial block, tree
        nodes) is computed alone, the way one decode step is.
        """
        n = it.x.shape[0]
        if it.tree_mask is not None:
            return cls(n, past + tree_depths(it.tree_mask), with_prefix(it.tree_mask, past), False, past=past,
                       exact=exact, whole=torch.zeros(n, dtype=torch.bool) if exact else None)
        positions = torch.arange(past, past + n, device=device)
        if exact:
            first = -(-past // EXACT_BLOCK) * EXACT_BLOCK  # the first block boundary at or after past
            last = (past + n) // EXACT_BLOCK * EXACT_BLOCK  # the last one at or before the end
            pos = torch.arange(past, past + n)
            return cls(n, positions, None, False, past=past, exact=True, whole=(pos >= first) & (pos < last))
        causal = n > 1 and past == 0  # let SDPA use its fused causal path
        return cls(n, positions, None if causal else chunk_mask(past, n, device), causal)
