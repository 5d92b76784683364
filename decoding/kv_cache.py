"""Per-stage KV cache: many sequences, chunked appends, rollback, prefix sharing.

Design choices, and why:
- Each sequence owns a preallocated buffer ``[layers, kv_heads, capacity, head_dim]``
  (grown by doubling if a request outlives its estimate), so appending a prefill
  chunk or a decode token is an in-place write and attention reads a view —
  no per-step concatenation on the hot path.
- ``fork`` makes a child that *references* the first ``prefix_len`` positions of
  its parent instead of copying them (outline decoding expands many points
  over one shared prompt): N children of a P-token prefix hold P + their own
  positions, not N·P, and attention reads the prefix in place (``segments``).
  The parent is pinned: it cannot roll back below a prefix a child still uses,
  and its storage lives until its last child is freed.
- ``truncate`` is O(1): speculative decoding rolls rejected tokens out of every
  stage by moving the length back; stale entries are overwritten by later writes.
- A token budget bounds the whole cache, so admission fails loudly ("cache full")
  instead of the process running out of memory mid-request.
- Buffers live on the stage's device (``device``): a GPU stage's keys and values
  never cross to the host; the forward writes and reads them in place.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from decoding.config import ModelConfig
from decoding.errors import CacheError, CacheFull


@dataclass(eq=False)
class _Seq:
    seq_id: object
    k: torch.Tensor  # [layers, kv_heads, capacity, head_dim]
    v: torch.Tensor
    length: int = 0  # own positions written and committed
    parent: "_Seq | None" = None
    prefix_len: int = 0  # positions of the parent visible to this sequence
    children: list = field(default_factory=list)
    freed: bool = False

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    @property
    def total_length(self) -> int:
        return self.prefix_len + self.length


class KVCache:
    def __init__(self, config: ModelConfig, num_layers: int, dtype: torch.dtype = torch.float32,
                 max_tokens: int = 1 << 20, device: torch.device | str = "cpu"):
        self.config = config
        self.num_layers = num_layers
        self.dtype = dtype
        self.device = torch.device(device)
        self.max_tokens = max_tokens
        self._seqs: dict[object, _Seq] = {}
        self._reserved = 0

    # -- accounting -------------------------------------------------------------
    def bytes_per_token(self) -> int:
        """KV bytes per token for this stage (all its layers)."""
        elem = torch.finfo(self.dtype).bits // 8
        return 2 * self.num_layers * self.config.num_kv_heads * self.config.head_dim * elem

    @property
    def reserved_tokens(self) -> int:
        return self._reserved

    def __contains__(self, seq_id) -> bool:
        s = self._seqs.get(seq_id)
        return s is not None and not s.freed

    def sequences(self) -> list:
        return [k for k, s in self._seqs.items() if not s.freed]

    # -- lifecycle --------------------------------------------------------------
    def _alloc(self, seq_id, capacity: int) -> _Seq:
        if seq_id in self._seqs:
            raise CacheError(f"sequence {seq_id!r} already exists in this stage's cache")
        capacity = max(int(capacity), 1)
        if self._reserved + capacity > self.max_tokens:
            raise CacheFull(
                f"KV cache full: {capacity} more positions requested, "
                f"{self.max_tokens - self._reserved} of {self.max_tokens} free")
        shape = (self.num_layers, self.config.num_kv_heads, capacity, self.config.head_dim)
        s = _Seq(seq_id, torch.empty(shape, dtype=self.dtype, device=self.device),
                 torch.empty(shape, dtype=self.dtype, device=self.device))
        self._seqs[seq_id] = s
        self._reserved += capacity
        return s

    def create(self, seq_id, capacity: int) -> None:
        self._alloc(seq_id, capacity)

    def fork(self, parent_id, child_id, prefix_len: int | None = None, capacity: int = 64) -> None:
        parent = self._get(parent_id)
        if prefix_len is None:
            prefix_len = parent.total_length
        if not 0 <= prefix_len <= parent.total_length:
            raise CacheError(
                f"cannot fork {parent_id!r} at {prefix_len}: it holds {parent.total_length} positions")
        while prefix_len <= parent.prefix_len and parent.parent is not None:
            # every position the child reads is an ancestor's: reference that one (a prefix cache
            # forks a new request from any entry at any length)
            parent = parent.parent
        child = self._alloc(child_id, capacity)
        child.parent, child.prefix_len = parent, prefix_len
        parent.children.append(child)

    def free(self, seq_id) -> None:
        s = self._seqs.get(seq_id)
        if s is None or s.freed:
            return
        s.freed = True
        self._release(s)

    def _release(self, s: _Seq) -> None:
        if s.children:  # storage still referenced by a child's prefix
            return
        self._seqs.pop(s.seq_id, None)
        self._reserved -= s.capacity
        if s.parent is not None:
            s.parent.children.remove(s)
            if s.parent.freed:
                self._release(s.parent)

    def truncate(self, seq_id, new_length: int) -> None:
        """Roll the sequence back to ``new_length`` total positions."""
        s = self._get(seq_id)
        if new_length > s.total_length:
            raise CacheError(f"cannot truncate {seq_id!r} to {new_length}: it holds {s.total_length}")
        if new_length < s.prefix_len:
            raise CacheError(
                f"cannot roll {seq_id!r} back to {new_length}: positions < {s.prefix_len} are a shared prefix")
        pinned = max((c.prefix_len for c in s.children), default=0)
        if new_length < pinned:
            raise CacheError(
                f"cannot roll {seq_id!r} back to {new_length}: a forked child uses its first {pinned} positions")
        s.length = new_length - s.prefix_len

    @torch.inference_mode()
    def trim(self, seq_id) -> int:
        """Give back the positions reserved beyond what ``seq_id`` holds (a finished request kept as a
        cached prefix no longer needs room for its answer); returns the positions given back.

        A copy, so only when it pays: at least 64 positions and an eighth of the buffer. Children
        read the parent's buffer anew on every pass, so a parent may move."""
        s = self._get(seq_id)
        spare = s.capacity - max(s.length, 1)
        if spare < max(64, s.capacity // 8):
            return 0
        keep = max(s.length, 1)
        s.k, s.v = s.k[:, :, :keep].clone(), s.v[:, :, :keep].clone()
        self._reserved -= spare
        return spare

    def capacity(self, seq_id) -> int:
        """Positions reserved for ``seq_id``'s own entries."""
        return self._get(seq_id).capacity

    def growth(self, seq_id, n: int) -> int:
        """Positions :meth:`reserve` would add to the budget's use to make room for ``n`` more."""
        s = self._get(seq_id)
        need = s.length + n
        return 0 if need <= s.capacity else max(need, 2 * s.capacity) - s.capacity

    @property
    def free_tokens(self) -> int:
        return self.max_tokens - self._reserved

    def has_children(self, seq_id) -> bool:
        """Whether another sequence reads ``seq_id``'s positions in place (freeing it frees nothing)."""
        return bool(self._get(seq_id).children)

    def length(self, seq_id) -> int:
        return self._get(seq_id).total_length

    def _get(self, seq_id) -> _Seq:
        s = self._seqs.get(seq_id)
        if s is None or s.freed:
            raise CacheError(f"unknown sequence {seq_id!r} in this stage's cache")
        return s

    # -- used by the forward ------------------------------------------------------
    def reserve(self, seq_id, n: int) -> int:
        """Make room for ``n`` more own positions; returns the write offset."""
        s = self._get(seq_id)
        need = s.length + n
        if need > s.capacity:
            new_cap = max(need, 2 * s.capacity)
            extra = new_cap - s.capacity
            if self._reserved + extra > self.max_tokens:
                raise CacheFull(f"KV cache full while growing {seq_id!r} to {new_cap} positions")
            shape = (self.num_layers, self.config.num_kv_heads, new_cap, self.config.head_dim)
            k = torch.empty(shape, dtype=self.dtype, device=self.device)
            v = torch.empty(shape, dtype=self.dtype, device=self.device)
            k[:, :, : s.length] = s.k[:, :, : s.length]
            v[:, :, : s.length] = s.v[:, :, : s.length]
            s.k, s.v = k, v
            self._reserved += extra
        return s.length

    def write(self, seq_id, layer: int, offset: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [kv_heads, n, head_dim] written at own positions [offset, offset + n)."""
        s = self._seqs[seq_id]
        n = k.shape[1]
        s.k[layer, :, offset: offset + n] = k
        s.v[layer, :, offset: offset + n] = v

    def segments(self, seq_id, layer: int, own_end: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Where this sequence's keys/values live, oldest first: each ancestor's shared prefix, then its own [0, own_end).

        Views only, nothing copied: a forked child reads its parent's prefix in
        place (attention concatenates scores, not keys — see
        ``decoding.attention.segmented_attention``).
        """
        s = self._seqs[seq_id]
        segs = [(s.k[layer, :, :own_end], s.v[layer, :, :own_end])]
        node, upto = s.parent, s.prefix_len
        while node is not None:
            take = upto - node.prefix_len
            if take:
                segs.append((node.k[layer, :, :take], node.v[layer, :, :take]))
            node, upto = node.parent, node.prefix_len
        return segs[::-1]

    def spans(self, seq_id, own_end: int) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
        """:meth:`segments` of every layer at once: (keys, values, positions read), oldest first, keys and
        values the whole buffers [layers, kv_heads, capacity, head_dim] (for a kernel that steps through
        the layers itself: layer ``i``'s segment starts ``i`` layer strides in)."""
        s = self._seqs[seq_id]
        spans = [(s.k, s.v, own_end)]
        node, upto = s.parent, s.prefix_len
        while node is not None:
            take = upto - node.prefix_len
            if take:
                spans.append((node.k, node.v, take))
            node, upto = node.parent, node.prefix_len
        return spans[::-1]

    def visible(self, seq_id, layer: int, own_end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """All keys/values this sequence attends to, as one tensor each (a copy when it is forked)."""
        segs = self.segments(seq_id, layer, own_end)
        if len(segs) == 1:
            return segs[0]
        return torch.cat([k for k, _ in segs], dim=1), torch.cat([v for _, v in segs], dim=1)

    def commit(self, seq_id, n: int) -> None:
        self._seqs[seq_id].length += n

    @torch.inference_mode()
    def keep(self, seq_id, start: int, keep: list[int]) -> None:
        """After tree verification: keep the accepted nodes (indices relative to ``start``), in order,
        compacted to positions ``start, start+1, ...``, and drop the rest.

        In inference mode: a buffer that grew inside a forward is an inference tensor,
        which torch lets only inference mode update in place (callers — the stage
        service's event loop, ``LocalPipeline.keep`` — run outside it)."""
        s = self._get(seq_id)
        own_start = start - s.prefix_len
        if own_start < 0:
            raise CacheError("cannot compact inside a shared prefix")
        idx = torch.tensor([own_start + i for i in keep], dtype=torch.long, device=self.device)
        if len(keep):
            s.k[:, :, own_start: own_start + len(keep)] = s.k[:, :, idx]
            s.v[:, :, own_start: own_start + len(keep)] = s.v[:, :, idx]
        self.truncate(seq_id, start + len(keep))
