"""The stage's prefix cache: finished requests' KV kept by exact token ids, bounded, evicted LRU, keyed on the plan."""

from __future__ import annotations

import pytest
import torch

from decoding.config import ModelConfig
from decoding.kv_cache import KVCache
from meshd.pipeline.stage.errors import StageError
from meshd.pipeline.stage.prefix_cache import CacheKey, PrefixCache
from meshd.pipeline.stage.scheduler import StageScheduler
from meshd.pipeline.stage.stats import StageStats
from transport.stage_messages import ReusePrefix, StageForward

CONFIG = ModelConfig("llama", vocab_size=50_000, hidden_size=8, intermediate_size=16, num_layers=2, num_heads=2,
                     num_kv_heads=1, head_dim=4)
KEY = CacheKey("model-sha", (0, 2), "float32", ())


class TinyStage:
    def new_cache(self, max_tokens: int) -> KVCache:
        return KVCache(CONFIG, 2, torch.float32, max_tokens)

    def drop_pending(self) -> None:  # a real stage forgets the layers exited rows still owed
        pass


def make(budget: int = 4096, share: float = 0.5, pins=()) -> StageScheduler:
    s = StageScheduler(StageStats(), max_kv_tokens=budget, idle_seq_timeout_s=60, prefix=PrefixCache(share, pins))
    s.reset(TinyStage(), depth=1, key=KEY)
    return s


def prefill(s: StageScheduler, seq: str, ids: list[int], offset: int = 0, capacity: int = 0, last: bool = True):
    """What a first stage does with a prompt chunk: admit it, then the forward writes its positions."""
    msg = StageForward(request_id="r", plan_version=1, seq_id=seq, position_offset=offset,
                       token_ids=torch.tensor(ids), is_last_chunk=last, capacity=capacity or len(ids) + 8)
    slot = s.admit(msg, len(ids))
    s.kv.reserve(seq, len(ids))
    s.kv.commit(seq, len(ids))
    if last:
        s.prefix.share_prompt(slot)
    return slot


def reuse(s: StageScheduler, seq: str, ids: list[int], capacity: int = 0) -> None:
    s.reuse(ReusePrefix("r", 1, seq, torch.tensor(ids), capacity or len(ids) + 16, ""))


def test_a_finished_request_is_kept_and_a_later_prompt_forks_from_it_without_copying():
    s = make()
    system = list(range(1000, 1300))
    prefill(s, "c/1", system + [7, 8])
    prefill(s, "c/1", [42], offset=302)  # an answer token fed back
    assert s.keep("c/1")
    assert s.sequences() == [] and s.tokens_in_use() == 0 and s.prefix.status()["entries"] == 1
    assert s.prefix.probe(system + [7, 8, 42, 5]) == 303 and s.prefix.probe(system + [9]) == 300
    reuse(s, "c/2", system + [7])
    assert s.kv.length("c/2") == 301 and s.sequences() == ["c/2"]
    prefill(s, "c/2", [3, 4], offset=301)  # only the rest is computed
    assert s.prefix.stats.reused_tokens == 301


def test_a_prefix_no_longer_held_is_a_prefix_miss_never_a_guess():
    s = make()
    prefill(s, "c/1", list(range(50)))
    assert s.keep("c/1")
    with pytest.raises(StageError) as err:
        reuse(s, "c/2", list(range(49)) + [999])
    assert err.value.code == "prefix_miss" and "c/2" not in s.kv


def test_a_running_prompt_is_shared_while_it_decodes_and_a_hang_up_leaves_nothing_behind():
    s = make()
    prompt = list(range(500, 560))
    prefill(s, "c/1", prompt[:30], last=False, capacity=100)
    assert s.prefix.probe(prompt) == 0  # mid-prefill: nothing computed is shared yet
    prefill(s, "c/1", prompt[30:], offset=30)
    assert s.prefix.probe(prompt) == 60  # its prompt is computed: a second request can fork from it
    s.free("c/1", "freed")  # the client hung up: no entry, nothing referenced
    assert s.prefix.probe(prompt) == 0 and s.prefix.status()["entries"] == 0 and s.kv.reserved_tokens == 0


def test_a_hang_up_mid_prefill_is_freed_not_kept():
    s = make()
    prefill(s, "c/1", list(range(40)), last=False, capacity=100)
    s.free("c/1", "freed")
    assert s.prefix.status()["entries"] == 0 and s.kv.reserved_tokens == 0


def test_only_verified_positions_are_kept():
    s = make()
    prefill(s, "c/1", list(range(20)))
    # a verify round writes 4 draft nodes at [20, 24); its verdict never arrives (the request ended)
    msg = StageForward(request_id="r", plan_version=1, seq_id="c/1", position_offset=20,
                       token_ids=torch.tensor([5, 6, 7, 8]), verify=True)
    s.admit(msg, 4)
    s.kv.reserve("c/1", 4)
    s.kv.commit("c/1", 4)
    assert s.keep("c/1")
    assert s.prefix.probe(list(range(20)) + [5, 6]) == 20


def test_entries_stay_within_their_share_and_the_least_recently_used_goes_first():
    s = make(budget=4096, share=0.5)
    prompts = {f"c/{i}": [10_000 + i] + list(range(299)) for i in range(12)}
    for seq, ids in prompts.items():
        prefill(s, seq, ids)
        assert s.keep(seq)
        s.prefix.enforce_share()
        if seq == "c/2":
            reuse(s, "c/r", prompts["c/0"][:100])  # c/0 is used again: the most recent
            s.free("c/r", "freed")
        assert s.prefix.held_tokens() <= 2048
    assert s.prefix.stats.evictions >= 5
    assert s.prefix.probe(prompts["c/11"]) == 300  # the newest is held
    assert s.prefix.probe(prompts["c/1"]) == 0  # ... the least recently used went


def test_cached_content_never_makes_an_admission_fail():
    s = make(budget=2048, share=1.0)
    for i in range(6):
        prefill(s, f"c/{i}", [20_000 + i] + list(range(299)))
        assert s.keep(f"c/{i}")
    assert s.kv.free_tokens < 1500
    prefill(s, "c/new", list(range(30_000, 31_500)), capacity=1500)  # evicts what it needs
    assert s.kv.reserved_tokens <= 2048 and s.prefix.stats.evictions >= 1


def test_an_entry_a_running_request_reads_is_never_evicted():
    s = make(budget=1024, share=1.0)
    prefill(s, "c/1", list(range(400)))
    assert s.keep("c/1")
    reuse(s, "c/2", list(range(300)), capacity=300 + 200)
    with pytest.raises(Exception, match="full"):
        prefill(s, "c/3", list(range(40_000, 40_500)), capacity=500)
    assert s.prefix.probe(list(range(400))) == 400


def test_a_pinned_prompt_is_never_evicted():
    system = list(range(2000, 2200))
    s = make(budget=4096, share=0.25, pins=[system])
    prefill(s, "c/0", system + [1, 2, 3])
    assert s.keep("c/0")
    for i in range(1, 30):
        prefill(s, f"c/{i}", [30_000 + i] + list(range(200)))
        assert s.keep(f"c/{i}")
        s.prefix.enforce_share()
    assert s.prefix.probe(system + [9]) == 200 and s.prefix.status()["pinned"] == 1


def test_a_new_plan_keeps_the_entries_only_when_nothing_they_depend_on_changed():
    s = make()
    prefill(s, "c/1", list(range(100)))
    assert s.keep("c/1")
    prefill(s, "c/2", list(range(300, 340)), capacity=64)  # a running request: dropped either way
    s.reset(TinyStage(), depth=1, key=KEY)  # a re-plan that keeps this stage's layers, mode and upstream
    assert s.prefix.probe(list(range(100))) == 100 and s.sequences() == []
    moved = CacheKey("model-sha", (0, 2), "float32", (("other-device", (0, 3)),))  # an upstream stage changed
    s.reset(TinyStage(), depth=2, key=moved)
    assert s.prefix.probe(list(range(100))) == 0 and s.prefix.status()["entries"] == 0 and s.kv.reserved_tokens == 0


def test_a_stage_reloaded_on_another_device_starts_a_fresh_cache():
    """Found on a GPU: the same layers and mode reloaded on CUDA kept a host KV cache, and attention mixed devices."""
    s = make()
    prefill(s, "c/1", list(range(100)))
    assert s.keep("c/1")
    s.reset(TinyStage(), depth=1, key=CacheKey("model-sha", (0, 2), "float32", (), "cuda:0"))
    assert s.prefix.probe(list(range(100))) == 0 and s.prefix.status()["entries"] == 0


def test_a_thousand_distinct_long_prompts_keep_the_cache_within_its_budget():
    s = make(budget=16_384, share=0.5)
    for i in range(1000):
        seq = f"c/{i}"
        prefill(s, seq, [40_000 + i % 9000] + [i % 7] * 1999, capacity=2048)
        assert s.kv.reserved_tokens <= 16_384
        assert s.keep(seq)
        s.prefix.enforce_share()
        assert s.prefix.held_tokens() <= 8192
    assert s.prefix.stats.evictions >= 990 and s.sequences() == []


class PackedTinyStage(TinyStage):
    packing = "packed"  # an exact stage: rows computed in whole 64-position blocks or alone


def test_an_exact_stage_shares_only_whole_blocks_a_cold_prompt_computes_the_same_way():
    s = StageScheduler(StageStats(), max_kv_tokens=4096, idle_seq_timeout_s=60, prefix=PrefixCache(0.5))
    s.reset(PackedTinyStage(), depth=1, key=KEY)
    prompt = list(range(3000, 3150))  # 150 positions: blocks [0, 128) dense, 22 rows alone
    prefill(s, "c/1", prompt[:128], last=False, capacity=300)
    prefill(s, "c/1", prompt[128:], offset=128)
    for t, pos in ((7, 150), (8, 151)):  # answer tokens fed one by one: alone, never shared
        prefill(s, "c/1", [t], offset=pos)
    assert s.prefix.probe(prompt + [7, 8, 9]) == 128
    assert s.keep("c/1") and s.kv.length("c/1") == 128
    with pytest.raises(StageError) as err:
        reuse(s, "c/2", prompt[:100])  # not at a block boundary: a cold prompt computes it otherwise
    assert err.value.code == "prefix_miss"
    reuse(s, "c/3", prompt[:128])
    assert s.kv.length("c/3") == 128
