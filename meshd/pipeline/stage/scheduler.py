"""The stage's scheduler: per-sequence slots, the KV cache they own, and which messages share a pass.

Like llama.cpp's server slots, every sequence this stage holds has one
:class:`~meshd.pipeline.stage.slot.SeqSlot` with an explicit state; the scheduler alone creates, forks,
commits, rolls back and frees their KV cache entries, so whatever keeps state
per sequence (a sampler's grammar, a future prefix cache) lives in the slot
and goes when it goes.

Three rules keep the cache honest under hang-ups, failures and restarts:

- **Frees leave tombstones.** A coordinator frees a sequence on every stage
  directly (the chain may be broken), so a free can overtake prompt chunks
  still queued upstream. The scheduler remembers freed keys; a late chunk for a
  tombstoned key is dropped instead of re-creating the sequence.
- **A busy sequence is freed after its pass.** The compute thread may be
  writing its cache; the free lands when the pass ends.
- **Nothing lives forever.** A sequence untouched for ``idle_seq_timeout_s``
  is reaped (its coordinator vanished without freeing it).

Every slot also knows the token id at each position it holds (token ids travel
to every stage with each chunk): that is what the prefix cache
(:mod:`~meshd.pipeline.stage.prefix_cache`, which keeps that bookkeeping) keys a
finished request's KV on, so a stage never trusts anyone else's word for what
its cache holds.

Batching, like vLLM's engine core, happens between passes: the stage takes what
queued (:meth:`StageScheduler.take`, waiting a moment for decoding sequences that
usually join a pass: :meth:`StageScheduler.linger`) and splits it into runs
(:meth:`StageScheduler.runs`).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable, Collection
from typing import Any

from decoding.batch import EXACT_BLOCK
from decoding.speculative.params import MAX_CANDIDATES
from meshd.log import get_logger
from partition.ids import SeqKey
from meshd.pipeline.stage.errors import StageError
from meshd.pipeline.stage.prefix_cache import CacheKey, PrefixCache
from meshd.pipeline.stage.stats import StageStats
from meshd.pipeline.stage.slot import SeqSlot, SeqState
from transport.stage_messages import ReusePrefix, StageForward

log = get_logger("meshd.stage")

__all__ = ["StageScheduler", "TOMBSTONES", "MAX_BATCH_TOKENS", "MAX_BATCH_MESSAGES", "MAX_LINGER_S"]

TOMBSTONES = 1 << 16  # freed keys remembered (keys are never reused; old ones age out)
MAX_BATCH_TOKENS = 512  # tokens in one batched pass (a lone larger message still runs)
MAX_BATCH_MESSAGES = 64  # messages taken from the queue for one step
MAX_LINGER_S = 0.005  # the longest a pass waits for a decoding sequence's next step to join it


def _rows(msg: StageForward) -> int:
    t = msg.hidden if msg.hidden is not None else msg.token_ids
    return int(t.shape[0]) if t is not None and t.ndim >= 1 else 1


class StageScheduler:
    def __init__(self, stats: StageStats, max_kv_tokens: int = 1 << 16,
                 max_batch_tokens: int = MAX_BATCH_TOKENS, idle_seq_timeout_s: float = 300.0,
                 prefix: PrefixCache | None = None):
        self.stats = stats
        self.prefix = prefix if prefix is not None else PrefixCache()
        self._promised = 0  # positions this pass's sequences will grow by (reserved in the compute thread)
        self.max_kv_tokens = max_kv_tokens
        # 0 or 1: no batching (one message per pass, the way every stage used to run).
        self.max_batch_tokens = int(max_batch_tokens)
        self.idle_seq_timeout_s = idle_seq_timeout_s
        self._kv = None
        self._key: CacheKey | None = None
        self._depth = 1  # stages in the plan served
        self._slots: dict[SeqKey, SeqSlot] = {}
        self._tombstones: OrderedDict[SeqKey, None] = OrderedDict()
        # Lingering for stragglers (see linger): the last pass's duration, and how often lingering
        # caught someone lately.
        self._last_pass_s = 0.0
        self._waiting_for: set[SeqKey] | None = None
        self._linger_pays = 1.0
        self._passes = 0

    # -- the KV cache, owned here ---------------------------------------------------------------
    @property
    def kv(self):
        """The stage's KV cache (None while no layers are served); read it, change it through here."""
        return self._kv

    def reset(self, stage, depth: int, key: CacheKey | None = None) -> None:
        """A new plan: every slot dropped (coordinators replay). The cache's entries survive only when
        the plan keeps ``key`` (what this stage's KV depends on); otherwise a fresh cache for ``stage``."""
        keep = stage is not None and self._kv is not None and key is not None and key == self._key
        if stage is not None:
            stage.drop_pending()  # an exited row of a dropped slot owes its layers to nobody now
        if keep:
            for seq in list(self._slots):
                if seq in self._kv and not self.prefix.is_entry(seq):
                    self._kv.free(seq)
        else:
            self._kv = stage.new_cache(self.max_kv_tokens) if stage is not None else None
        self._key = key
        self.prefix.adopt(self._kv, key, EXACT_BLOCK if stage is not None and getattr(stage, "packing", "") else 0)
        self._slots.clear()
        self._depth = depth

    def tokens_in_use(self) -> int:
        """KV positions reserved for running sequences (not the prefix cache's entries)."""
        return int(self._kv.reserved_tokens) - self.prefix.held_tokens() if self._kv is not None else 0

    def sequences(self) -> list[SeqKey]:
        """Running sequences (the prefix cache's entries are not anyone's request)."""
        if self._kv is None:
            return []
        return [s for s in self._kv.sequences() if not self.prefix.is_entry(s)]

    def is_freed(self, seq: SeqKey) -> bool:
        return seq in self._tombstones

    def admit(self, msg: StageForward, rows: int) -> SeqSlot:
        """The message's slot, ready for its pass: created with its cache on a first chunk, the last
        verify round's outcome kept, the cache checked to hold exactly the positions before the message."""
        seq, kv = msg.seq_id, self._kv
        if seq not in kv:
            if msg.position_offset != 0:
                raise StageError("unknown_sequence", f"sequence {seq} is not in this stage's cache "
                                                     f"(offset {msg.position_offset})")
            capacity = max(int(msg.capacity), rows, 16)
            self.prefix.make_room(capacity, self._promised)
            kv.create(seq, capacity)
        slot = self._slot(seq)
        if msg.commit_start >= 0:
            self._commit(slot, msg.commit_start, msg.commit_keep or [])
        held = kv.length(seq)
        if held != msg.position_offset:
            raise StageError("position_mismatch", f"sequence {seq} holds {held} positions, "
                                                  f"message starts at {msg.position_offset}")
        growth = kv.growth(seq, rows)
        if growth:  # the forward grows the buffer in the compute thread: make room for it now
            self.prefix.make_room(growth, self._promised)
            self._promised += growth
        self.prefix.note(slot, msg, held, rows)
        slot.touched = time.monotonic()
        slot.state = (SeqState.VERIFYING if msg.verify else SeqState.DECODING if msg.is_last_chunk
                      else SeqState.PREFILLING)
        if msg.is_last_chunk and rows <= MAX_CANDIDATES + 1:  # a decode step or a verify round
            slot.stepped = slot.touched
        return slot

    def _commit(self, slot: SeqSlot, start: int, keep: list[int]) -> None:
        """Keep the verified nodes written at ``start`` (in order); roll the rest back."""
        seq, kv = slot.seq, self._kv
        if start + len(keep) > kv.length(seq) or start < 0 or any(not 0 <= k < kv.length(seq) - start for k in keep):
            raise StageError("position_mismatch", f"cannot keep {keep} at {start}: sequence {seq} holds "
                                                  f"{kv.length(seq)} positions")
        held = kv.length(seq)
        if keep == list(range(len(keep))):
            kv.truncate(seq, start + len(keep))  # a chain's accepted prefix: nothing moves
        else:
            kv.keep(seq, start, keep)
        self.prefix.committed(slot, start, keep, held)

    def truncate(self, seq: SeqKey, length: int) -> None:
        self._kv.truncate(seq, length)
        slot = self._slots.get(seq)
        if slot is not None:
            self.prefix.rolled_back(slot, length)

    def fork(self, parent: SeqKey, child: SeqKey, prefix_length: int) -> None:
        """``child`` reads ``parent``'s first ``prefix_length`` positions in place."""
        self._kv.fork(parent, child, prefix_length)
        self.prefix.forked(self._slot(child), self._slots.get(parent), parent, prefix_length)

    # -- the prefix cache's side of a slot's life ---------------------------------------------------
    def reuse(self, msg: ReusePrefix) -> None:
        """Start ``msg.seq_id`` on the held KV of its prefix (a ``prefix_miss`` if it is gone)."""
        ids = self.prefix.fork_prefix(msg.seq_id, msg.prefix_ids, msg.capacity, self._promised)
        slot = self._slot(msg.seq_id)
        slot.tokens, slot.dense_upto = ids, len(ids)

    def keep(self, seq: SeqKey) -> bool:
        """The request of ``seq`` ended: keep its verified positions as a cached prefix (tombstoning the
        key as a free does). False: nothing kept (unknown tokens, busy, the cache off): freed instead."""
        slot, kv = self._slots.get(seq), self._kv
        usable = slot is not None and not slot.busy and kv is not None and seq in kv
        shared = self.prefix.keepable(slot) if usable else None
        if shared is None:
            self.free(seq, "freed")
            return False
        try:
            kv.truncate(seq, len(shared))  # what no later request may start on is given back
        except Exception:  # noqa: BLE001 - a child still reads past n: keep nothing rather than guess
            self.free(seq, "freed")
            return False
        self._tombstone(seq)
        del self._slots[seq]
        self.prefix.keep(seq, shared)
        return True

    def _slot(self, seq: SeqKey) -> SeqSlot:
        slot = self._slots.get(seq)
        if slot is None:
            slot = self._slots[seq] = SeqSlot(seq, time.monotonic())
        return slot

    def _tombstone(self, seq: SeqKey) -> None:
        self._tombstones[seq] = None
        self._tombstones.move_to_end(seq)
        while len(self._tombstones) > TOMBSTONES:
            self._tombstones.popitem(last=False)

    def free(self, seq: SeqKey, why: str) -> None:
        """Forget ``seq`` for good (tombstoned); its cache goes now, or when the pass using it ends.
        A cached prefix's entry is not the request's to free: only eviction removes it."""
        if self.prefix.is_entry(seq):
            return
        self._tombstone(seq)
        slot = self._slots.get(seq)
        if slot is not None:
            slot.state = SeqState.FINISHED
            if slot.busy:  # the compute thread is using its cache: free it when the pass ends
                return
            del self._slots[seq]
        self.prefix.forget(seq)
        if self._kv is not None and seq in self._kv:
            self._kv.free(seq)
            log.debug("sequence_freed", seq=seq, why=why)

    # -- passes --------------------------------------------------------------------------------
    def begin_pass(self, slots: list[SeqSlot]) -> None:
        for slot in slots:
            slot.busy = True

    def end_pass(self, slots: list[SeqSlot]) -> None:
        """The compute thread is done with these slots: frees that waited for it land now."""
        self._promised = 0
        for slot in slots:
            slot.busy = False
            if slot.state is SeqState.FINISHED:
                self.free(slot.seq, "freed")

    def count_pass(self, sequences: int, seconds: float) -> None:
        self._last_pass_s = seconds
        self._passes += 1
        self.stats.count_pass(sequences, seconds)

    def runs(self, msgs: list[Any]) -> list[list[int]]:
        """Everything queued at once, as runs executed in order: forwards sharing a pass, or one control message.

        Order is kept where it matters. A sequence's second message waits for
        the next pass (its rows need the first one's keys), and any control
        message runs between passes exactly where it arrived. A pass holds at
        most ``max_batch_tokens`` tokens (a lone message may exceed it), so a
        long prompt chunk does not ride with a crowd of decode steps that would
        each wait for all of it.
        """
        if self._waiting_for is not None:  # did lingering catch anyone we waited for?
            caught = bool(self._waiting_for & {getattr(m, "seq_id", None) for m in msgs})
            self._linger_pays = 0.8 * self._linger_pays + 0.2 * caught
            self._waiting_for = None
        stepping = self._recently_stepping()
        cap = self._steps_per_pass(stepping)
        out: list[list[int]] = []
        group: list[int] = []
        seqs: set = set()
        tokens = steps = 0  # steps: decode steps / verify rounds in the group
        for i, m in enumerate(msgs):
            if not isinstance(m, StageForward):
                out += [group, [i]] if group else [[i]]
                group, seqs, tokens, steps = [], set(), 0, 0
                continue
            n = _rows(m)
            is_step = m.seq_id in stepping
            if m.seq_id in seqs or (group and tokens + n > self.max_batch_tokens) or (is_step and steps >= cap):
                out.append(group)
                group, seqs, tokens, steps = [], set(), 0, 0
            group.append(i)
            seqs.add(m.seq_id)
            tokens += n
            steps += is_step
        if group:
            out.append(group)
        return out

    async def take(self, inbox: asyncio.Queue) -> list:
        """The next step's requests, in arrival order: the first to arrive, and while batching everything
        queued behind it (up to MAX_BATCH_MESSAGES) and what arrives while the pass lingers.

        ``inbox``: the transport's queue of requests (``transport.link.Request``: ``.message``)."""
        reqs = [await inbox.get()]
        if self.max_batch_tokens <= 1:  # not batching: one message per pass
            return reqs
        while len(reqs) < MAX_BATCH_MESSAGES and not inbox.empty():
            reqs.append(inbox.get_nowait())
        linger = self.linger([r.message for r in reqs])
        if linger > 0:  # a decoding sequence's next step is due any moment: let it join this pass
            loop = asyncio.get_running_loop()
            deadline = loop.time() + linger
            while len(reqs) < MAX_BATCH_MESSAGES:
                left = deadline - loop.time()
                if left <= 0:
                    break
                try:
                    async with asyncio.timeout(left):
                        reqs.append(await inbox.get())
                except TimeoutError:
                    break
                if self.linger([r.message for r in reqs]) <= 0:
                    break
        return reqs

    def linger(self, msgs: list) -> float:
        """Seconds to wait for more messages before this pass (0: start now).

        Decoding sequences fall into step: while the stage computes one, the
        other's next token is still on its way back from the coordinator, so
        it arrives just after the pass started and each runs alone. Waiting a
        moment — at most a tenth of a pass, never over MAX_LINGER_S — for the
        sequences that were stepping here lately lets them share the pass.
        When lingering stops catching anyone (their steps are a whole pass
        away), it stops, trying again every 32 passes.
        """
        if self._last_pass_s <= 0:
            return 0.0
        here = {m.seq_id for m in msgs if isinstance(m, StageForward)}
        if not here:
            return 0.0
        stepping = self._recently_stepping()
        missing = stepping - here
        if not missing or len(here & stepping) >= self._steps_per_pass(stepping):
            return 0.0
        if self._linger_pays < 0.3 and self._passes % 32:
            return 0.0
        if self._waiting_for is None:
            self._waiting_for = missing
        return min(MAX_LINGER_S, 0.1 * self._last_pass_s)

    def _recently_stepping(self) -> set[SeqKey]:
        """Sequences decoding through this stage now (a step or verify round within the last few passes)."""
        now = time.monotonic()
        recent = max(0.05, 3 * self._last_pass_s)
        return {s.seq for s in self._slots.values()
                if s.stepped is not None and s.state is not SeqState.FINISHED and now - s.stepped < recent}

    def _steps_per_pass(self, stepping: set[SeqKey]) -> int:
        """How many decoding sequences one pass should take: enough to share the weights' reads, few
        enough that the pipeline keeps as many groups in flight as it has stages — merging two
        sequences that alternate between two stages would leave each stage idle half the time."""
        return max(1, -(-len(stepping) // max(1, self._depth)))

    # -- reaping -------------------------------------------------------------------------------
    def reap(self, waiting: Collection[str] = ()) -> None:
        """Free every sequence untouched for ``idle_seq_timeout_s`` (its coordinator vanished), but none
        with work ``waiting`` here (queued behind long prompts: its coordinator is told it advances)."""
        now = time.monotonic()
        cutoff = now - self.idle_seq_timeout_s
        for slot in list(self._slots.values()):
            if slot.seq in waiting:
                slot.touched = now
            elif slot.touched < cutoff and slot.state is not SeqState.FINISHED:
                self.stats.reaped += 1
                log.warning("sequence_reaped", seq=slot.seq, idle_s=round(now - slot.touched, 1))
                self.free(slot.seq, "reaped")

    async def reap_forever(self, waiting: Callable[[], Collection[str]] = frozenset) -> None:
        while True:
            await asyncio.sleep(max(1.0, self.idle_seq_timeout_s / 10))
            self.reap(waiting())
