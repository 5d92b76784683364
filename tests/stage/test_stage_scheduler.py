"""The stage scheduler: slots with a state, the KV cache they own, and which messages share a pass."""

from __future__ import annotations

import asyncio

import pytest
import torch

from decoding.config import ModelConfig
from decoding.kv_cache import KVCache
from meshd.pipeline.stage.errors import StageError
from meshd.pipeline.stage.scheduler import MAX_BATCH_MESSAGES, StageScheduler
from meshd.pipeline.stage.slot import SeqState
from meshd.pipeline.stage.stats import StageStats
from transport.stage_messages import FreeSequence, StageForward

CONFIG = ModelConfig("llama", vocab_size=32, hidden_size=8, intermediate_size=16, num_layers=2, num_heads=2,
                     num_kv_heads=1, head_dim=4)


class TinyStage:
    def new_cache(self, max_tokens: int) -> KVCache:
        return KVCache(CONFIG, 2, torch.float32, max_tokens)

    def drop_pending(self) -> None:  # a real stage forgets the layers exited rows still owed
        pass


def fwd(seq: str, offset: int = 0, rows: int = 1, **kw) -> StageForward:
    return StageForward(request_id="r", plan_version=1, seq_id=seq, position_offset=offset,
                        token_ids=torch.arange(rows), **kw)


def grow(sched: StageScheduler, seq: str, n: int) -> None:
    """What a forward leaves in the cache: ``n`` more positions."""
    sched.kv.reserve(seq, n)
    sched.kv.commit(seq, n)


@pytest.fixture
def sched() -> StageScheduler:
    s = StageScheduler(StageStats(), max_kv_tokens=4096, max_batch_tokens=8, idle_seq_timeout_s=60)
    s.reset(TinyStage(), depth=2)
    return s


def test_a_sequence_moves_from_prefilling_to_decoding_and_its_cache_goes_with_its_slot(sched):
    first = fwd("c/1/1", rows=4, is_last_chunk=False)
    slot = sched.admit(first, 4)
    assert slot.state is SeqState.PREFILLING and sched.sequences() == ["c/1/1"]
    grow(sched, "c/1/1", 4)
    step = fwd("c/1/1", offset=4)
    assert sched.admit(step, 1) is slot
    assert slot.state is SeqState.DECODING and slot.stepped is not None
    sched.free("c/1/1", "freed")
    assert slot.state is SeqState.FINISHED and sched.sequences() == [] and sched.tokens_in_use() == 0
    assert sched.is_freed("c/1/1")


def test_a_later_chunk_of_an_unknown_sequence_and_a_misplaced_one_are_refused(sched):
    with pytest.raises(StageError) as err:
        sched.admit(fwd("c/1/2", offset=3), 1)
    assert err.value.code == "unknown_sequence"
    sched.admit(fwd("c/1/3", rows=2), 2)
    grow(sched, "c/1/3", 2)
    with pytest.raises(StageError) as err:
        sched.admit(fwd("c/1/3", offset=5), 1)
    assert err.value.code == "position_mismatch"


def test_a_verify_round_keeps_the_accepted_nodes_of_the_last_one(sched):
    msg = fwd("c/1/4", rows=3)
    sched.admit(msg, 3)
    grow(sched, "c/1/4", 7)  # 3 prompt positions and a 4-node round
    nxt = fwd("c/1/4", offset=5, verify=True, commit_start=3, commit_keep=[0, 2])
    slot = sched.admit(nxt, 1)
    assert sched.kv.length("c/1/4") == 5 and slot.state is SeqState.VERIFYING


def test_a_sequence_freed_during_its_pass_keeps_its_cache_until_the_pass_ends(sched):
    msg = fwd("c/1/5")
    slot = sched.admit(msg, 1)
    sched.begin_pass([slot])
    sched.free("c/1/5", "freed")
    assert "c/1/5" in sched.kv and slot.state is SeqState.FINISHED
    sched.end_pass([slot])
    assert "c/1/5" not in sched.kv and sched.is_freed("c/1/5")


def test_a_forked_child_gets_a_slot_and_an_idle_sequence_is_reaped(sched):
    parent = fwd("c/1/6", rows=4)
    sched.admit(parent, 4)
    grow(sched, "c/1/6", 4)
    sched.fork("c/1/6", "c/1/7", 4)
    assert sorted(sched.sequences()) == ["c/1/6", "c/1/7"]
    sched.reap()
    assert sched.stats.reaped == 0  # touched just now
    sched.idle_seq_timeout_s = -1.0  # every slot is now older than the timeout
    sched.reap()
    assert sched.sequences() == [] and sched.stats.reaped == 2


def test_a_sequence_with_work_queued_here_is_not_reaped_however_long_it_waits(sched):
    """Queued behind a long prompt, a sequence is idle only in appearance: its coordinator hears that
    this stage advances, so freeing it would drop its chunk unanswered and replay it at the back."""
    sched.admit(fwd("c/1/8"), 1)
    sched.idle_seq_timeout_s = -1.0
    sched.reap(waiting={"c/1/8"})
    assert sched.sequences() == ["c/1/8"] and sched.stats.reaped == 0
    sched.reap()
    assert sched.sequences() == [] and sched.stats.reaped == 1


def test_runs_keep_a_sequences_messages_and_control_messages_in_order(sched):
    msgs = [fwd("a/1/1"), fwd("b/1/1"), fwd("a/1/1", offset=1), FreeSequence(1, "b/1/1"), fwd("c/1/1", rows=8),
            fwd("d/1/1", rows=4)]
    assert sched.runs(msgs) == [[0, 1], [2], [3], [4], [5]]  # a's second step waits; 8 + 4 > 8 tokens


class Queued:  # what the transport queues: a request carrying its message
    def __init__(self, message) -> None:
        self.message = message


async def test_a_step_takes_everything_queued_in_order_and_an_unbatched_stage_one_message():
    inbox = asyncio.Queue()
    for i in range(MAX_BATCH_MESSAGES + 3):
        inbox.put_nowait(Queued(fwd(f"s/{i}")))
    batching = StageScheduler(StageStats(), max_batch_tokens=8)
    taken = await batching.take(inbox)
    assert [r.message.seq_id for r in taken] == [f"s/{i}" for i in range(MAX_BATCH_MESSAGES)]
    alone = StageScheduler(StageStats(), max_batch_tokens=0)
    assert [r.message.seq_id for r in await alone.take(inbox)] == [f"s/{MAX_BATCH_MESSAGES}"]
    assert inbox.qsize() == 2
