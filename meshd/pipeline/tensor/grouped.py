"""The first member's stage as the stage service sees it: an ordinary stage whose every cache operation and
every pass the other members of its group repeat.

Why a stand-in rather than changes through the stage service: the scheduler owns the KV cache and the worker
runs passes, each in its own thread, and neither should care that the layers are split. The cache here
applies each operation and queues it; the pass sends the queue, then the pass itself, to the other members
before computing its own share — all from the compute thread, the only one that uses the group's sockets,
so the members see the operations in the order the first member did them.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import deque

import msgpack
import numpy as np
import torch

from decoding.batch import BatchItem
from decoding.errors import CacheFull
from decoding.kv_cache import KVCache
from decoding.tensor_group import GroupLost

#: the cache operations the other members repeat (everything else only reads)
MIRRORED = ("create", "fork", "free", "truncate", "keep", "trim")
#: a member after the first keeps this many times the first member's token budget: the first member's
#: frees (a request hung up, an evicted prefix) reach the others only with its next pass, so their caches
#: may be fuller for a moment, and a member must never refuse a pass the first member admitted
FOLLOWER_BUDGET = 2


class MirroredKV:
    """A :class:`KVCache` whose changes are queued for the group's other members."""

    def __init__(self, kv: KVCache):
        self.local = kv
        # the others start from a new cache of the same budget (times FOLLOWER_BUDGET)
        self._pending: deque[tuple[str, tuple]] = deque([("reset", (kv.max_tokens,))])
        self._lock = threading.Lock()

    def __getattr__(self, name):  # reads (length, capacity, free_tokens, ...) are the local cache's
        return getattr(self.local, name)

    def __contains__(self, seq_id) -> bool:
        return seq_id in self.local

    def _mirrored(self, op: str, *args):
        with self._lock:  # applied and queued together: the queue's order is the cache's
            out = getattr(self.local, op)(*args)
            self._pending.append((op, args))
        return out

    def create(self, seq_id, capacity: int) -> None:
        return self._mirrored("create", seq_id, capacity)

    def fork(self, parent_id, child_id, prefix_len=None, capacity: int = 64) -> None:
        return self._mirrored("fork", parent_id, child_id, prefix_len, capacity)

    def free(self, seq_id) -> None:
        return self._mirrored("free", seq_id)

    def truncate(self, seq_id, new_length: int) -> None:
        return self._mirrored("truncate", seq_id, new_length)

    def keep(self, seq_id, start: int, keep: list[int]) -> None:
        return self._mirrored("keep", seq_id, start, list(keep))

    def trim(self, seq_id) -> int:
        return self._mirrored("trim", seq_id)

    def drain(self) -> list[tuple[str, tuple]]:
        """The operations not yet sent, oldest first."""
        with self._lock:
            out = list(self._pending)
            self._pending.clear()
        return out


def encode_ops(ops: list[tuple[str, tuple]]) -> list:
    return [[op, list(args)] for op, args in ops]


def apply_ops(stage, kv: KVCache | None, ops: list) -> KVCache:
    """A follower's side of :meth:`MirroredKV.drain`: the cache after ``ops`` (a reset starts a new one)."""
    for op, args in ops:
        if op == "reset":
            kv = stage.new_cache(int(args[0]) * FOLLOWER_BUDGET)
        elif op in MIRRORED and kv is not None:
            getattr(kv, op)(*args)
        else:
            raise ValueError(f"not a cache operation a group repeats: {op!r}")
    return kv


def encode_items(items: list[BatchItem]) -> list[dict]:
    """A pass's items as the other members need them (early exits never: they would skip layers on one)."""
    out = []
    for it in items:
        x = it.x.contiguous()
        mask = None if it.tree_mask is None else it.tree_mask.to(torch.bool).contiguous()
        out.append({"seq": it.seq_id, "x": x.numpy().tobytes(), "dtype": str(x.dtype).removeprefix("torch."),
                    "shape": list(x.shape), "mask": None if mask is None else mask.numpy().tobytes(),
                    "mask_shape": None if mask is None else list(mask.shape), "all_logits": it.all_logits,
                    "head": it.head, "normed": it.return_normed, "logit_rows": it.logit_rows,
                    "best_only": it.best_only})
    return out


def decode_items(raw: list[dict]) -> list[BatchItem]:
    items = []
    for d in raw:
        x = torch.from_numpy(np.frombuffer(d["x"], dtype=np.dtype(d["dtype"])).reshape(d["shape"]).copy())
        mask = None
        if d["mask"] is not None:
            mask = torch.from_numpy(np.frombuffer(d["mask"], dtype=np.bool_).reshape(d["mask_shape"]).copy())
        items.append(BatchItem(d["seq"], x, mask, d["all_logits"], d["head"], d["normed"], d["logit_rows"],
                               best_only=bool(d.get("best_only", False))))
    return items


def pass_command(number: int, ops: list, items: list[BatchItem]) -> bytes:
    return msgpack.packb({"op": "pass", "pass": number, "kv": encode_ops(ops), "items": encode_items(items)})


class GroupedStage:
    """The first member's share of a stage, with the group's other members computing beside it."""

    def __init__(self, member, link, split):
        self.member = member  # decoding StageModel over this member's share (stage.group is the link)
        self.split = split
        self._link = link
        self._passes = 0

    def __getattr__(self, name):  # config, first, end, is_first, is_last, device, packing, ...
        return getattr(self.member, name)

    @property
    def exits(self):
        return None  # an exit would skip layers on the first member only

    @exits.setter
    def exits(self, value) -> None:
        if value is not None:
            raise ValueError("a tensor group's stage takes no early exits")

    def new_cache(self, max_tokens: int = 1 << 16) -> MirroredKV:
        """(Any thread: the reset reaches the others as the first of the cache's queued operations.)"""
        return MirroredKV(self.member.new_cache(max_tokens))

    def forward_batch(self, kv: MirroredKV, items: list[BatchItem], probes=None) -> list:
        """The pass on every member: the queued cache operations and the items go first (compute thread).

        A pass this member would refuse (a full cache, a context overflow) is refused before anything is
        sent, so the others never start a pass it does not finish; one that fails after it was sent
        leaves the members out of step, so the group is given up (:class:`GroupLost`: the request replays)."""
        items = [it if it.exit_threshold == 0 else dataclasses.replace(it, exit_threshold=0.0) for it in items]
        _admissible(self.member, kv.local, items)
        self._passes += 1
        self._link.begin_pass(self._passes)
        self._link.send_command(pass_command(self._passes, encode_ops(kv.drain()), items))
        try:
            return self.member.forward_batch(kv.local, items, probes)
        except GroupLost:
            raise
        except Exception as exc:
            self._link.abort(f"the first member's pass failed: {type(exc).__name__}: {exc}")
            raise GroupLost(f"the group gave up a pass its first member could not finish ({exc})") from exc

    def abort(self, why: str) -> None:
        """End a pass waiting on the others (any thread): it raises GroupLost."""
        self._link.abort(why)

    def forward(self, kv: MirroredKV, seq_id, x, tree_mask=None, all_logits: bool = True, head: bool = True,
                return_normed: bool = False, best_only: bool = False):
        return self.forward_batch(kv, [BatchItem(seq_id, x, tree_mask, all_logits, head, return_normed,
                                                 best_only=best_only)])[0]

    def has_pending(self) -> bool:
        return False

    def fill_pending(self, kv, seqs=None) -> list:
        return []

    def drop_pending(self) -> None:
        return None

    def close(self) -> None:
        """Tell the other members this stage is gone (a new plan), then close the group's links."""
        try:
            self._link.send_command(msgpack.packb({"op": "stop"}))
        finally:
            self._link.close(linger_s=1.0)


def _admissible(stage, kv: KVCache, items: list[BatchItem]) -> None:
    """Raise what ``stage.forward_batch`` would refuse ``items`` with, before computing anything: its own
    position checks, and room for every item's rows at once (it reserves them one by one)."""
    stage.check_positions(kv, items)
    growth = sum(kv.growth(it.seq_id, int(it.x.shape[0])) for it in items)
    if growth > kv.free_tokens:
        raise CacheFull(f"KV cache full: the pass needs {growth} more positions, {kv.free_tokens} are free")
