"""The rows that left a forward early, and the layers they still owe the KV cache.

A decode row that exits after layer ``li`` has its token, but the layers after
``li`` have not written its keys and values: until they do, no later position
may attend to it. This is the same for every decoder family, so it lives here
and not in a family's folder (``decoding.models``): a family's forward asks
:meth:`ExitedRows.leave` after each exit layer which rows go, and later hands
:meth:`ExitedRows.fill` the one thing only it knows, how to run one of its
layers over an owed row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from decoding.batch import BatchItem, RowPlan
from decoding.exits.bound import BoundExits


@dataclass
class OwedRow:
    """An exited decode row: the layers from ``layer`` on still owe its keys and values."""

    item: BatchItem
    plan: RowPlan
    layer: int
    hidden: torch.Tensor  # [1, hidden]: the state it left with
    rows: tuple  # its slice of the per-row tensors the layers read besides the hidden states (None stays None)


#: Runs layer ``li`` of the family's stage over one owed row's hidden state; returns the next hidden state.
LayerStep = Callable[[int, torch.Tensor, OwedRow], torch.Tensor]


class ExitedRows:
    """One stage's owed rows, by sequence."""

    def __init__(self) -> None:
        self._owed: dict = {}  # seq_id -> OwedRow

    def __bool__(self) -> bool:
        return bool(self._owed)

    def leave(self, exits: BoundExits, li: int, h: torch.Tensor, rows: tuple, items: list, plans: list,
              exited: dict):
        """After layer ``li``: the decode rows whose exit clears their threshold leave the batch.

        ``rows``: per-row tensors beside ``h`` (RoPE's tables, a packed stage's dense-row
        mask; None entries stay None), filtered with it. Each leaving row's answer
        (an :class:`~decoding.exits.bound.ExitCheck`) goes into ``exited`` by sequence; its
        hidden state is owed here until :meth:`fill` runs the layers it skipped. Returns
        ``(h, rows, items, plans)`` of the rows that stay."""
        starts, at = [], 0
        for p in plans:
            starts.append(at)
            at += p.n
        asking = [k for k, it in enumerate(items) if it.may_exit]
        if not asking:
            return h, rows, items, plans
        picked = torch.tensor([starts[k] for k in asking], device=h.device)
        checks = exits.check(li, h.index_select(0, picked), [items[k].exit_threshold for k in asking])
        leaving = {k: c for k, c in zip(asking, checks) if c is not None}
        if not leaving:
            return h, rows, items, plans
        keep = torch.ones(h.shape[0], dtype=torch.bool, device=h.device)
        for k, check in leaving.items():
            r = starts[k]
            keep[r] = False
            it = items[k]
            exited[it.seq_id] = check
            self._owed[it.seq_id] = OwedRow(it, plans[k], li + 1, h[r:r + 1].clone(),
                                            tuple(None if t is None else t[r:r + 1] for t in rows))
        stay = [k for k in range(len(items)) if k not in leaving]
        return (h[keep], tuple(None if t is None else t[keep.to(t.device)] for t in rows),
                [items[k] for k in stay], [plans[k] for k in stay])

    @torch.inference_mode()
    def fill(self, kv, layers: int, step: LayerStep, seqs=None) -> list:
        """Run the layers exited rows skipped (all, or only ``seqs``'): their keys and values at their own
        position, from the hidden state they left with, up to the stage's ``layers``. Returns the sequences
        whose fill failed (their caches are not whole: the caller frees them, and their coordinators replay
        them).

        Why eagerly, right after the exiting pass answered, and not batched with the
        sequence's next token: the answer has already gone back, so this work overlaps
        the coordinator's and the earlier stages' work on the next token; and a packed
        stage computes a decode row alone anyway (``RowPlan.exact``), so batching it
        with the next token would save nothing. A sequence freed or cut back meanwhile
        owes nothing."""
        failed = []
        owed = self._owed  # a new plan may replace it from another thread meanwhile
        for seq in [s for s in list(owed) if seqs is None or s in seqs]:
            row = owed.pop(seq, None)
            if row is None or seq not in kv or kv.length(seq) <= row.plan.past:
                continue
            h = row.hidden
            try:
                for li in range(row.layer, layers):
                    h = step(li, h, row)
            except Exception:  # noqa: BLE001 - one sequence's cache is not whole; the others' are
                owed[seq] = row  # still owed: its next step fails again rather than read a partial cache
                failed.append(seq)
        return failed

    def drop(self) -> None:
        """A new cache (a new plan): nothing is owed to the old one (a fill running now keeps its own dict)."""
        self._owed = {}


def rejoin(h: torch.Tensor, items: list, plans: list, exited: dict) -> list:
    """Each item's output in the caller's order: the rows still running (``h``) around the exited ones' checks."""
    running = iter(h.split([p.n for p, it in zip(plans, items) if it.seq_id not in exited]))
    return [exited[it.seq_id] if it.seq_id in exited else next(running) for it in items]


__all__ = ["ExitedRows", "LayerStep", "OwedRow", "rejoin"]
