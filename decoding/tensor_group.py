"""The two things a tensor-parallel member needs from its group, and an in-process group to test them by.

Why a seam here: ``decoding`` computes the member's share of a layer and must not know how the partial
sums travel (``transport.group_link`` carries them between devices over CurveZMQ). Whatever carries them
keeps one rule that makes a group deterministic and its members agree bit for bit: every member adds the
partials in rank order, so each holds the same sum, whatever order they arrived in.
"""

from __future__ import annotations

import threading
from typing import Protocol

import numpy as np


class GroupLost(RuntimeError):
    """A member of the group left (or its link failed) mid-step: the step cannot finish on this group."""


class PartialSums(Protocol):
    rank: int
    size: int

    def sum_(self, x: np.ndarray) -> None:
        """``x`` (float32, contiguous) becomes the sum over the members' ``x``, added in rank order."""

    def gather(self, x: np.ndarray) -> np.ndarray:
        """On the first member (which samples), the members' ``x`` [rows, own columns] side by side in rank
        order: [rows, all columns]; the others get their own ``x`` back (nobody reads it)."""

    def gather_parts(self, x: np.ndarray) -> list[np.ndarray] | None:
        """On the first member, every member's ``x`` in rank order, each as it came (widths may differ);
        None on the others."""

    def native_sum(self) -> tuple[object, int] | None:
        """For one kernel call: (a ``decoding.quant.native.REDUCE_FN`` that sums in C, its ctx address), or
        None (sum through :meth:`sum_`). A caller that gets one calls :meth:`native_done` after the call."""

    def native_done(self, failed: bool) -> None:
        """The kernel call that used :meth:`native_sum` returned: its exchanges count as this member's;
        ``failed``: raise :class:`GroupLost` with the reason."""


def add_in_rank_order(parts: list[np.ndarray], out: np.ndarray) -> None:
    """``out`` = parts[0] + parts[1] + ... left to right: the one order every member and the reference use."""
    np.copyto(out, parts[0])
    for p in parts[1:]:
        np.add(out, p, out=out)


class ThreadGroup:
    """``size`` members in one process, one thread each: the in-process reference a group over links must
    equal token for token (same sums in the same order)."""

    def __init__(self, size: int, timeout_s: float = 600.0):
        self.size = size
        self._barrier = threading.Barrier(size, timeout=timeout_s)
        self._slots: list[np.ndarray | None] = [None] * size

    def member(self, rank: int) -> "_ThreadMember":
        return _ThreadMember(self, rank)

    def abort(self) -> None:
        """A member failed: the others' waits end with :class:`GroupLost` instead of hanging."""
        self._barrier.abort()

    def exchange(self, rank: int, x: np.ndarray) -> list[np.ndarray]:
        """Every member's ``x`` (copied), once all have handed theirs in."""
        try:
            self._slots[rank] = x.copy()
            self._barrier.wait()
            parts = list(self._slots)
            self._barrier.wait()  # nobody overwrites a slot before everyone has read them all
        except threading.BrokenBarrierError as exc:
            raise GroupLost("a member of the in-process group failed") from exc
        return parts


class _ThreadMember:
    def __init__(self, group: ThreadGroup, rank: int):
        self._group, self.rank, self.size = group, rank, group.size

    def sum_(self, x: np.ndarray) -> None:
        add_in_rank_order(self._group.exchange(self.rank, x), x)

    def gather(self, x: np.ndarray) -> np.ndarray:
        parts = self.gather_parts(x)
        return np.concatenate(parts, axis=-1) if self.rank == 0 else x

    def gather_parts(self, x: np.ndarray) -> list[np.ndarray] | None:
        parts = self._group.exchange(self.rank, x)
        return parts if self.rank == 0 else None

    def native_sum(self) -> None:
        return None  # threads of one process: the callback is the reference path

    def native_done(self, failed: bool) -> None:
        raise AssertionError("an in-process group never hands out a native sum")


def best_rows(parts: list[np.ndarray], vocab: int) -> "torch.Tensor":
    """Whole rows from each member's (best logit, its token, the member's vocabulary width) in rank order:
    the best token of all with its logit, -inf elsewhere. The members' rows lie side by side in rank order,
    so keeping the first of equal maxima picks the lowest token, as argmax does. A member that sent its
    whole share instead (a meshd before best-only gathers) is read the same way."""
    import torch  # (the links import this module; only a sampling member gets here)

    rows = parts[0].shape[0]
    best = np.full(rows, -np.inf, dtype=np.float32)
    token = np.zeros(rows, dtype=np.int64)
    start = 0
    for part in parts:
        if part.shape[-1] == 3:
            value, index, width = part[:, 0], part[:, 1].astype(np.int64), int(part[0, 2])
        else:
            value, index, width = part.max(axis=-1), part.argmax(axis=-1) + start, part.shape[-1]
        better = value > best
        best, token = np.where(better, value, best), np.where(better, index, token)
        start += width
    out = torch.full((rows, vocab), float("-inf"))
    out[torch.arange(rows), torch.from_numpy(token)] = torch.from_numpy(best)
    return out
