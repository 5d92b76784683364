"""A tensor-parallel split: whole blocks, whole KV groups (or one group, replicated), balanced by speed;
checked against brute force over every valid set of cut points."""

from __future__ import annotations

import itertools

import pytest

from partition.tensor_split import LayerShape, SplitError, split_layers

QWEN_1_5B = LayerShape(12, 2, 128, 8960, 151936, o_block=256, down_block=256)
QWEN_0_5B = LayerShape(14, 2, 64, 4864, 151936, o_block=32, down_block=32)
SMOLLM2 = LayerShape(9, 3, 64, 1536, 49152, o_block=32, down_block=32)
LLAMA_8B = LayerShape(32, 8, 128, 14336, 128256, o_block=256, down_block=256)


def valid_head_cuts(shape: LayerShape, bounds) -> bool:
    group = shape.num_heads // shape.num_kv_heads
    for a, b in zip(bounds, bounds[1:]):
        if b <= a or (a * shape.head_dim) % shape.o_block or (b * shape.head_dim) % shape.o_block:
            return False
        if not ((a % group == 0 and b % group == 0) or a // group == (b - 1) // group):
            return False
    return True


def brute_force_cost(shape: LayerShape, speeds) -> float:
    n, best = len(speeds), float("inf")
    for inner in itertools.combinations(range(1, shape.num_heads), n - 1):
        bounds = (0, *inner, shape.num_heads)
        if valid_head_cuts(shape, bounds):
            best = min(best, max((b - a) / s for a, b, s in zip(bounds, bounds[1:], speeds)))
    return best


@pytest.mark.parametrize("shape", [QWEN_1_5B, QWEN_0_5B, SMOLLM2, LLAMA_8B], ids=["1.5b", "0.5b", "smollm2", "8b"])
@pytest.mark.parametrize("speeds", [(1, 1), (1, 1, 1), (1, 1, 1, 1), (2, 1), (1, 3, 1), (1,) * 8])
def test_head_cuts_are_the_brute_force_optimum_and_valid(shape, speeds):
    try:
        brute = brute_force_cost(shape, speeds)
    except ValueError:
        brute = float("inf")
    if brute == float("inf"):
        with pytest.raises(SplitError):
            split_layers(shape, len(speeds), speeds)
        return
    split = split_layers(shape, len(speeds), speeds)
    bounds = (0, *(m.heads[1] for m in split.members))
    assert valid_head_cuts(shape, bounds)
    assert max(m.num_heads / s for m, s in zip(split.members, speeds)) == pytest.approx(brute)


@pytest.mark.parametrize("shape", [QWEN_1_5B, QWEN_0_5B, LLAMA_8B])
@pytest.mark.parametrize("n", [2, 4])
def test_every_row_and_column_belongs_to_exactly_one_member(shape, n):
    split = split_layers(shape, n)
    for field, total in (("heads", shape.num_heads), ("inter", shape.intermediate), ("vocab", shape.vocab)):
        ranges = [getattr(m, field) for m in split.members]
        assert ranges[0][0] == 0 and ranges[-1][1] == total
        assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(ranges, ranges[1:]))
    assert all(m.inter[0] % shape.down_block == 0 for m in split.members)


def test_each_member_holds_the_kv_heads_its_query_heads_read():
    for shape, n in ((QWEN_1_5B, 2), (QWEN_1_5B, 4), (LLAMA_8B, 8), (SMOLLM2, 3)):
        group = shape.num_heads // shape.num_kv_heads
        for m in split_layers(shape, n).members:
            needed = {h // group for h in range(*m.heads)}
            assert set(range(*m.kv_heads)) == needed


def test_more_members_than_kv_heads_replicate_a_kv_head():
    """Qwen2.5-1.5B has two KV heads: each of four members takes query heads of one group, whose KV head
    it computes alongside the other member in that group."""
    split = split_layers(QWEN_1_5B, 4)
    assert split.replicated_kv
    assert all(m.num_kv_heads == 1 for m in split.members)
    assert not split_layers(QWEN_1_5B, 2).replicated_kv


def test_a_faster_member_gets_the_larger_share():
    split = split_layers(LLAMA_8B, 2, (3.0, 1.0))
    fast, slow = split.members
    assert fast.num_heads > slow.num_heads
    assert fast.inter[1] - fast.inter[0] > slow.inter[1] - slow.inter[0]
    assert fast.vocab[1] - fast.vocab[0] > slow.vocab[1] - slow.vocab[0]


def test_the_leader_never_takes_the_odd_block():
    """35 super-blocks of Qwen2.5-1.5B's MLP over two: the first member (which also samples) takes 17."""
    first, second = split_layers(QWEN_1_5B, 2).members
    assert (first.inter[1] - first.inter[0], second.inter[1] - second.inter[0]) == (17 * 256, 18 * 256)


def test_impossible_splits_say_why():
    with pytest.raises(SplitError, match="do not split"):
        split_layers(QWEN_1_5B, 7)  # six runs of two heads (a 256-wide block each) at most
    with pytest.raises(SplitError, match="speeds"):
        split_layers(QWEN_1_5B, 2, (1.0,))
    with pytest.raises(SplitError, match="blocks"):
        split_layers(LayerShape(12, 2, 128, 8960, 1000, o_block=256, down_block=256), 64)


@pytest.mark.parametrize("shape", [QWEN_1_5B, SMOLLM2, LLAMA_8B], ids=["1.5b", "smollm2", "8b"])
def test_attention_held_whole_gives_every_member_every_head_and_splits_the_rest_as_before(shape):
    """Even where the heads cannot be split (SmolLM2's 9 heads over 4), every member computes them all."""
    for n in (2, 4):
        whole = split_layers(shape, n, attention="whole")
        assert whole.attention == "whole"
        assert all(m.heads == (0, shape.num_heads) and m.kv_heads == (0, shape.num_kv_heads) for m in whole.members)
        inter = [m.inter for m in whole.members]
        assert inter[0][0] == 0 and inter[-1][1] == shape.intermediate and all(a[1] == b[0] for a, b in zip(inter, inter[1:]))
        try:
            split = split_layers(shape, n)
        except SplitError:
            continue
        assert [m.inter for m in split.members] == inter and [m.vocab for m in split.members] == [m.vocab for m in whole.members]


def test_an_unknown_way_to_hold_the_attention_is_refused():
    with pytest.raises(SplitError, match="split or whole"):
        split_layers(QWEN_1_5B, 2, attention="halves")
