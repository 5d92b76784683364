"""The stage's prefix cache: finished requests' KV kept, keyed on their exact token ids.

Home Assistant resends one 2–3.5k-token system prompt with every request; a
turn that recomputes it costs seconds. So a request's KV is not freed when it
ends: its coordinator asks every stage to *keep* it (``CacheSequence``), and
the sequence becomes an **entry** here, indexed by the token ids it holds
(:class:`~decoding.prefix_index.PrefixIndex`). A later request whose ids start
the same way forks from the entry — referencing its positions, not copying
them — and only the rest is prefilled.

What the cache promises:

- **Bounded.** Entries live inside the stage's KV token budget, and at most
  ``share`` of it. Whenever a request needs room, entries nobody reads are
  evicted least recently used first; cached content never makes an admission
  fail. A pinned entry (an operator's system prompt) is never evicted.
- **Keyed on everything that changes the KV.** The token ids exactly, and the
  cache's :class:`CacheKey` (model, this stage's layer range and numeric mode,
  and every stage upstream of it with its layers): a new plan that changes any
  of them drops every entry, one that keeps them all keeps them.
- **Running requests share too.** A sequence whose prompt is fully computed is
  indexed while it decodes, so a second request with the same prompt forks
  from it instead of computing it again.

What a slot's positions hold (its token ids, how much of it is shared, how far
an exact stage computed it in whole blocks) is bookkeeping for this cache alone,
so it is kept here too (:meth:`PrefixCache.note`, :meth:`PrefixCache.rolled_back`,
:meth:`PrefixCache.share_prompt`, ...), on the slot the scheduler owns.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from decoding.prefix_index import PrefixIndex
from meshd.log import get_logger
from meshd.pipeline.stage.errors import StageError
from meshd.pipeline.stage.slot import SeqSlot, SeqState
from partition.ids import SeqKey
from transport.stage_messages import StageForward

log = get_logger("meshd.stage")

__all__ = ["CacheKey", "PrefixCache", "PrefixStats", "DEFAULT_SHARE"]

DEFAULT_SHARE = 0.5  # of the KV token budget that finished requests may keep


@dataclass(frozen=True)
class CacheKey:
    """What the KV this stage computes depends on, besides the token ids."""

    model: str
    layers: tuple[int, int]
    mode: str  # this stage's numeric mode (weights and KV dtype)
    upstream: tuple  # (node id, layers) of every stage before this one, in order, and the plan's mode
    device: str = "cpu"  # where the KV lives: a stage reloaded on another device computes (and holds) it anew
    # a tensor group's stage: its members' caches start empty with every plan's group, so nothing is kept
    # across one (the plan version, the members, their shares)
    group: tuple = ()

    @classmethod
    def of(cls, model: str, stage, mode: str, route, index: int | None, activation_dtype: str | None
           ) -> CacheKey | None:
        """The key of ``stage`` (a StageModel; None: no layers here) at ``index`` of ``route``."""
        if stage is None or index is None:
            return None
        upstream = tuple((s.node_id, tuple(s.layers)) for s in route.stages[:index])
        own = route.stages[index]
        group = ((int(route.plan_version), tuple(s.node_id for s in own.group), tuple(own.group_speeds))
                 if getattr(own, "group", ()) else ())
        return cls(model, (stage.first, stage.end), mode,
                   upstream + ((route.weights or "", activation_dtype or ""),), str(stage.device), group)


@dataclass
class PrefixStats:
    probes: int = 0  # coordinators asked how much of a prompt is held here
    probe_hits: int = 0  # ... and some was
    reuses: int = 0  # requests that forked from a held prefix
    reused_tokens: int = 0  # positions those requests did not compute
    misses: int = 0  # a request asked for a prefix no longer held (it fell back to a full prefill)
    kept: int = 0  # finished requests kept as entries
    evictions: int = 0
    evicted_tokens: int = 0

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass(eq=False)
class _Entry:
    seq: SeqKey
    tokens: int
    used: float = field(default_factory=time.monotonic)
    pinned: bool = False


class PrefixCache:
    def __init__(self, share: float = DEFAULT_SHARE, pins: Sequence[Sequence[int]] = ()):
        """``share``: the fraction of the KV budget entries may hold (0: keep nothing); ``pins``:
        token-id prefixes (system prompts) whose first entry is never evicted."""
        if not 0.0 <= share <= 1.0:
            raise ValueError("the prefix cache's share of the KV budget must be in [0, 1]")
        self.share = float(share)
        self.pins = [tuple(int(t) for t in p) for p in pins if len(p)]
        self.stats = PrefixStats()
        self._kv = None
        self._key: CacheKey | None = None
        self._block = 0  # exact stages: positions are shared at block boundaries only (see adopt)
        self._index = PrefixIndex()
        self._entries: OrderedDict[SeqKey, _Entry] = OrderedDict()  # least recently used first
        self._pinned: set[tuple[int, ...]] = set()  # pins some entry holds

    @property
    def enabled(self) -> bool:
        return self.share > 0.0

    # -- a new plan -----------------------------------------------------------------------------
    def adopt(self, kv, key: CacheKey | None, block: int = 0) -> bool:
        """Serve ``kv`` under ``key``. Returns whether the entries survive (same key, same cache):
        otherwise every entry is dropped with the old cache. ``block``: a packed stage computes a row in a
        whole block or alone, by its position (decoding.batch.RowPlan), so only positions a cold prompt
        would compute the same way are shared, at multiples of ``block`` (0: any position)."""
        same = kv is not None and kv is self._kv and key == self._key
        if not same:
            if self._entries:
                log.info("prefix_cache_dropped", entries=len(self._entries), reason="plan_changed")
            self._entries.clear()
            self._index = PrefixIndex()
            self._pinned.clear()
        else:  # live sequences go (coordinators replay them); entries stay
            for holder in [h for h in self._index.holders() if h not in self._entries]:
                self._index.remove(holder)
        self._kv, self._key, self._block = kv, key, block
        return same

    # -- lookups ----------------------------------------------------------------------------------
    def probe(self, ids: Sequence[int]) -> int:
        """How many leading ``ids`` are held here, live or kept (0 while no layers are served); an exact
        stage answers at a block boundary."""
        if self._kv is None:
            return 0
        self.stats.probes += 1
        n, _ = self._index.longest(ids) if self.enabled else (0, set())
        self.stats.probe_hits += n > 0
        return n // self._block * self._block if self._block else n

    def holder(self, ids: Sequence[int]) -> SeqKey | None:
        """A sequence holding all of ``ids`` (marked used), or None (evicted since the probe)."""
        n, holders = self._index.longest(ids) if self.enabled else (0, set())
        if n < len(ids) or not holders:
            self.stats.misses += 1
            return None
        now = time.monotonic()
        for h in holders:
            e = self._entries.get(h)
            if e is not None:
                e.used = now
                self._entries.move_to_end(h)
        # Prefer a running sequence or the most recently used entry: both stay longest.
        live = [h for h in holders if h not in self._entries]
        return live[0] if live else next(h for h in reversed(self._entries) if h in holders)

    def reused(self, n: int) -> None:
        self.stats.reuses += 1
        self.stats.reused_tokens += n

    # -- what is held ------------------------------------------------------------------------------
    def index_live(self, seq: SeqKey, tokens: Sequence[int]) -> None:
        """A running sequence's computed prompt, shared while it decodes."""
        if self.enabled and tokens:
            self._index.insert(seq, tokens)

    def keep(self, seq: SeqKey, tokens: Sequence[int]) -> None:
        """``seq`` (finished, holding exactly ``tokens``) becomes an entry."""
        self._index.insert(seq, tokens)
        entry = self._entries[seq] = _Entry(seq, len(tokens))
        self._entries.move_to_end(seq)
        self.stats.kept += 1
        for pin in self.pins:
            if pin not in self._pinned and tuple(tokens[:len(pin)]) == pin:
                entry.pinned = True
                self._pinned.add(pin)
                log.info("prefix_pinned", seq=seq, tokens=len(pin))

    def forget(self, seq: SeqKey) -> None:
        """``seq`` no longer holds what it was indexed with (freed, rolled back)."""
        self._index.remove(seq)
        entry = self._entries.pop(seq, None)
        if entry is not None and entry.pinned:
            self._pinned -= {p for p in self._pinned if self._index.longest(p)[0] < len(p)}

    def covered(self, tokens: Sequence[int]) -> bool:
        """Whether an entry already holds all of ``tokens``."""
        n, holders = self._index.longest(tokens)
        return n == len(tokens) and any(h in self._entries for h in holders)

    def tokens_of(self, seq: SeqKey) -> tuple[int, ...]:
        return self._index.tokens_of(seq)

    def is_entry(self, seq: SeqKey) -> bool:
        return seq in self._entries

    # -- what a slot's positions hold --------------------------------------------------------------
    def note(self, slot: SeqSlot, msg: StageForward, held: int, rows: int) -> None:
        """Record the token ids ``msg`` writes at [held, held + rows) of ``slot``."""
        ids = msg.token_ids
        if slot.tokens is not None and (ids is None or ids.ndim != 1 or ids.numel() != rows
                                        or len(slot.tokens) != held):
            slot.tokens = None  # a sender that does not pass token ids on: this sequence is never shared
        if slot.tokens is not None:
            slot.tokens.extend(int(t) for t in ids.tolist())
        slot.unverified_from = held if msg.verify else None
        b = self._block
        if b and not msg.verify and msg.tree_mask is None and held == slot.dense_upto and held % b == 0:
            slot.dense_upto = (held + rows) // b * b

    def rolled_back(self, slot: SeqSlot, length: int) -> None:
        """Positions from ``length`` on are gone or moved: token ids and sharing follow."""
        if slot.tokens is not None:
            del slot.tokens[length:]
        slot.dense_upto = min(slot.dense_upto, length)
        if slot.indexed > length:
            self.forget(slot.seq)
            slot.indexed = 0

    def committed(self, slot: SeqSlot, start: int, keep: list[int], held: int) -> None:
        """A verify round's nodes ``keep`` written at ``start`` stayed (in order), the rest went; ``held``:
        the positions the sequence had before."""
        tokens = slot.tokens
        kept_ids = [tokens[start + k] for k in keep] if tokens is not None and len(tokens) == held else None
        self.rolled_back(slot, start)
        if slot.tokens is not None:
            if kept_ids is None:
                slot.tokens = None
            else:
                slot.tokens.extend(kept_ids)
        slot.unverified_from = None

    def forked(self, child: SeqSlot, parent: SeqSlot | None, parent_seq: SeqKey, n: int) -> None:
        """``child`` reads the first ``n`` positions of ``parent_seq`` (a running slot, or an entry)."""
        tokens = parent.tokens if parent is not None else self.tokens_of(parent_seq) \
            if self.is_entry(parent_seq) else None
        child.tokens = list(tokens[:n]) if tokens is not None else None
        child.dense_upto = min(parent.dense_upto if parent is not None else 0, n)

    def _shared(self, slot: SeqSlot, n: int) -> list[int]:
        """The token ids of ``slot``'s first ``n`` positions other requests may start on."""
        return slot.tokens[:min(n, slot.dense_upto)] if self._block else slot.tokens[:n]

    def share_prompt(self, slot: SeqSlot) -> None:
        """A pass wrote the sequence's last prompt chunk: share its prompt while it decodes."""
        if slot.indexed or slot.tokens is None or slot.state is SeqState.FINISHED or slot.unverified_from is not None:
            return
        shared = self._shared(slot, len(slot.tokens))
        self.index_live(slot.seq, shared)
        slot.indexed = len(shared)

    def keepable(self, slot: SeqSlot) -> list[int] | None:
        """What a finished ``slot`` may leave as an entry: its verified positions others may start on (None:
        nothing — unknown tokens, the cache off, or an entry holds all of it already)."""
        if slot.tokens is None or not self.enabled:
            return None
        n = len(slot.tokens) if slot.unverified_from is None else min(slot.unverified_from, len(slot.tokens))
        shared = self._shared(slot, n)
        return None if not shared or self.covered(shared) else shared

    def fork_prefix(self, seq: SeqKey, ids: torch.Tensor | None, capacity: int, promised: int) -> list[int]:
        """Start ``seq`` on the held KV of the prefix ``ids``; returns them (a ``prefix_miss`` if it is gone)."""
        kv = self._kv
        if ids is None or ids.ndim != 1 or ids.numel() == 0 or ids.is_floating_point():
            raise StageError("bad_input", "a reused prefix needs a non-empty 1-d tensor of token ids")
        if seq in kv:
            raise StageError("bad_input", f"sequence {seq} already exists here: a prefix starts a sequence")
        ids = [int(t) for t in ids.tolist()]
        holder = self.holder(ids) if not self._block or len(ids) % self._block == 0 else None
        if holder is None:
            raise StageError("prefix_miss", f"this stage no longer holds the {len(ids)}-token prefix "
                                            f"(evicted, or a new plan)")
        capacity = max(int(capacity) - len(ids), 16)
        self.make_room(capacity, promised, protect=holder)
        kv.fork(holder, seq, len(ids), capacity=capacity)
        self.reused(len(ids))
        return ids

    # -- room -------------------------------------------------------------------------------------
    def held_tokens(self) -> int:
        """KV positions reserved by entries (what the cache keeps of the budget)."""
        return sum(self._kv.capacity(s) for s in self._entries) if self._kv is not None else 0

    def make_room(self, need: int, promised: int = 0, protect: SeqKey | None = None) -> None:
        """Evict entries until ``need`` more positions fit beside ``promised`` ones (or nothing is left
        to evict: then the request meets a full cache of running sequences, as before); ``protect``:
        an entry about to be forked from."""
        kv = self._kv
        while kv is not None and kv.free_tokens - promised < need and self._evict_one("room", protect):
            pass

    def enforce_share(self) -> None:
        """Keep entries within their share of the budget."""
        if self._kv is None:
            return
        limit = int(self.share * self._kv.max_tokens)
        held = self.held_tokens()
        while held > limit:
            before = held
            if not self._evict_one("share"):
                return
            held = self.held_tokens()
            if held >= before:  # what was evicted is still read by a child: nothing came back
                return

    def _evict_one(self, why: str, protect: SeqKey | None = None) -> bool:
        """Evict the least recently used entry nobody reads; False: there is none."""
        kv = self._kv
        for seq, e in self._entries.items():
            if e.pinned or seq == protect or kv.has_children(seq):
                continue
            self.forget(seq)
            kv.free(seq)
            self.stats.evictions += 1
            self.stats.evicted_tokens += e.tokens
            log.debug("prefix_evicted", seq=seq, tokens=e.tokens, why=why)
            return True
        return False

    def status(self) -> dict:
        return {"enabled": self.enabled, "share": self.share, "entries": len(self._entries),
                "held_tokens": self.held_tokens(), "pinned": len(self._pinned), **self.stats.to_dict()}
