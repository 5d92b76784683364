"""The stage's scheduler: per-sequence slots, the KV cache they own, and which messages share a pass.

Like llama.cpp's server slots, every sequence this stage holds has one
:class:`SeqSlot` with an explicit state; the scheduler alone creates, forks,
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

Batching, like vLLM's engine core, happens between passes: everything queued
at once is split into runs (:meth:`StageScheduler.runs`), and a pass may wait a
moment for decoding sequences that usually join it (:meth:`StageScheduler.linger`).
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from decoding.speculative.params import MAX_CANDIDATES
from decoding.selector import TokenSelector
from meshd.log import get_logger
from partition.ids import SeqKey
from meshd.pipeline.stage.errors import StageError
from meshd.pipeline.stage.stats import StageStats
from transport.messages import StageForward

log = get_logger("meshd.stage")

__all__ = ["SeqState", "SeqSlot", "StageScheduler", "TOMBSTONES", "MAX_BATCH_TOKENS", "MAX_LINGER_S"]

TOMBSTONES = 1 << 16  # freed keys remembered (keys are never reused; old ones age out)
MAX_BATCH_TOKENS = 512  # tokens in one batched pass (a lone larger message still runs)
MAX_LINGER_S = 0.005  # the longest a pass waits for a decoding sequence's next step to join it


class SeqState(enum.Enum):
    PREFILLING = "prefilling"  # prompt chunks arriving
    DECODING = "decoding"  # one token per step
    VERIFYING = "verifying"  # speculative rounds: a token tree per step
    FINISHED = "finished"  # freed (its cache goes when the pass using it ends)


@dataclass(eq=False)
class SeqSlot:
    """One sequence held here: its state, when it was last active, and its last-stage sampling state."""

    seq: SeqKey
    touched: float
    state: SeqState = SeqState.PREFILLING
    stepped: float | None = None  # when it last ran a decode step or verify round here
    busy: bool = False  # in the compute thread's current pass
    selector: TokenSelector | None = None  # last stage: logits -> tokens, built on its first sample


def _rows(msg: StageForward) -> int:
    t = msg.hidden if msg.hidden is not None else msg.token_ids
    return int(t.shape[0]) if t is not None and t.ndim >= 1 else 1


class StageScheduler:
    def __init__(self, stats: StageStats, max_kv_tokens: int = 1 << 16,
                 max_batch_tokens: int = MAX_BATCH_TOKENS, idle_seq_timeout_s: float = 300.0):
        self.stats = stats
        self.max_kv_tokens = max_kv_tokens
        # 0 or 1: no batching (one message per pass, the way every stage used to run).
        self.max_batch_tokens = int(max_batch_tokens)
        self.idle_seq_timeout_s = idle_seq_timeout_s
        self._kv = None
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

    def reset(self, stage, depth: int) -> None:
        """A new plan: a fresh cache for ``stage`` (None: none), every slot dropped (coordinators replay)."""
        self._kv = stage.new_cache(self.max_kv_tokens) if stage is not None else None
        self._slots.clear()
        self._depth = depth

    def tokens_in_use(self) -> int:
        return int(self._kv.reserved_tokens) if self._kv is not None else 0

    def sequences(self) -> list[SeqKey]:
        return list(self._kv.sequences()) if self._kv is not None else []

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
            kv.create(seq, max(int(msg.capacity), rows, 16))
        slot = self._slot(seq)
        if msg.commit_start >= 0:
            self._commit(seq, msg.commit_start, msg.commit_keep or [])
        held = kv.length(seq)
        if held != msg.position_offset:
            raise StageError("position_mismatch", f"sequence {seq} holds {held} positions, "
                                                  f"message starts at {msg.position_offset}")
        slot.touched = time.monotonic()
        slot.state = (SeqState.VERIFYING if msg.verify else SeqState.DECODING if msg.is_last_chunk
                      else SeqState.PREFILLING)
        if msg.is_last_chunk and rows <= MAX_CANDIDATES + 1:  # a decode step or a verify round
            slot.stepped = slot.touched
        return slot

    def _commit(self, seq: SeqKey, start: int, keep: list[int]) -> None:
        """Keep the verified nodes written at ``start`` (in order); roll the rest back."""
        kv = self._kv
        if start + len(keep) > kv.length(seq) or start < 0 or any(not 0 <= k < kv.length(seq) - start for k in keep):
            raise StageError("position_mismatch", f"cannot keep {keep} at {start}: sequence {seq} holds "
                                                  f"{kv.length(seq)} positions")
        if keep == list(range(len(keep))):
            kv.truncate(seq, start + len(keep))  # a chain's accepted prefix: nothing moves
        else:
            kv.keep(seq, start, keep)

    def truncate(self, seq: SeqKey, length: int) -> None:
        self._kv.truncate(seq, length)

    def fork(self, parent: SeqKey, child: SeqKey, prefix_length: int) -> None:
        """``child`` reads ``parent``'s first ``prefix_length`` positions in place."""
        self._kv.fork(parent, child, prefix_length)
        self._slot(child)

    def _slot(self, seq: SeqKey) -> SeqSlot:
        slot = self._slots.get(seq)
        if slot is None:
            slot = self._slots[seq] = SeqSlot(seq, time.monotonic())
        return slot

    def free(self, seq: SeqKey, why: str) -> None:
        """Forget ``seq`` for good (tombstoned); its cache goes now, or when the pass using it ends."""
        self._tombstones[seq] = None
        self._tombstones.move_to_end(seq)
        while len(self._tombstones) > TOMBSTONES:
            self._tombstones.popitem(last=False)
        slot = self._slots.get(seq)
        if slot is not None:
            slot.state = SeqState.FINISHED
            if slot.busy:  # the compute thread is using its cache: free it when the pass ends
                return
            del self._slots[seq]
        if self._kv is not None and seq in self._kv:
            self._kv.free(seq)
            log.debug("sequence_freed", seq=seq, why=why)

    # -- passes --------------------------------------------------------------------------------
    def begin_pass(self, slots: list[SeqSlot]) -> None:
        for slot in slots:
            slot.busy = True

    def end_pass(self, slots: list[SeqSlot]) -> None:
        """The compute thread is done with these slots: frees that waited for it land now."""
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

    def linger(self, reqs: list) -> float:
        """Seconds the batch lane should wait for more before this pass (0: start now).

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
        here = {r.message.seq_id for r in reqs if isinstance(r.message, StageForward)}
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
    def reap(self) -> None:
        """Free every sequence untouched for ``idle_seq_timeout_s`` (its coordinator vanished)."""
        now = time.monotonic()
        cutoff = now - self.idle_seq_timeout_s
        for slot in list(self._slots.values()):
            if slot.touched < cutoff and slot.state is not SeqState.FINISHED:
                self.stats.reaped += 1
                log.warning("sequence_reaped", seq=slot.seq, idle_s=round(now - slot.touched, 1))
                self.free(slot.seq, "reaped")

    async def reap_forever(self) -> None:
        while True:
            await asyncio.sleep(max(1.0, self.idle_seq_timeout_s / 10))
            self.reap()
