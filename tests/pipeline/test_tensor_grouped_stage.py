"""The first member's stage, as the stage service drives it: batched passes, a cached prefix forked, a
verify round's tree kept in part, a rollback, a free — the other member repeats every one of them over the
group's links, and the answers are one device's (float32: to rounding)."""

from __future__ import annotations

import threading

import pytest
import torch

from decoding.batch import BatchItem
from decoding.loader import open_model
from decoding.models.llama.tensor_slice import layer_shape, member_stage
from meshd.pipeline.tensor.grouped import GroupedStage
from meshd.pipeline.tensor.member import follow
from partition.tensor_split import split_layers
from tests.support.models import build_tiny_checkpoint
from transport.group_link import GroupLink, GroupPeer
from transport.keys import Keypair


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-grouped")
    build_tiny_checkpoint(path, "qwen2", seed=5, num_attention_heads=4, num_key_value_heads=2,
                          intermediate_size=128, tie_word_embeddings=True)
    source = open_model(path)
    return source.load_stage(0, source.config.num_layers, torch.float32)


@pytest.fixture
def group(whole):
    """(the first member's GroupedStage, the follower's thread and its outcome)."""
    split = split_layers(layer_shape(whole), 2)
    keys = [Keypair.generate(), Keypair.generate()]
    links = [GroupLink(r, 2, keys[r]) for r in range(2)]
    peers = [GroupPeer(r, links[r].endpoint, keys[r].public) for r in range(2)]
    for r in range(2):
        links[r].admit([peers[1 - r]])
    members = [member_stage(whole, split.members[r], links[r]) for r in range(2)]
    outcome: list = []

    def follower():
        try:
            links[1].connect([peers[0]])
            follow(members[1], links[1])
            outcome.append("stopped")
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            outcome.append(exc)
        finally:
            links[1].close()

    t = threading.Thread(target=follower)
    t.start()
    links[0].connect([peers[1]])
    grouped = GroupedStage(members[0], links[0], split)
    yield grouped, t, outcome
    grouped.close()
    t.join(timeout=30)


def ids(*xs):
    return torch.tensor(xs, dtype=torch.long)


def test_every_cache_operation_and_pass_is_repeated_and_answers_as_one_device(whole, group):
    grouped, follower, outcome = group
    kv, ref = grouped.new_cache(4096), whole.new_cache(4096)

    def both(op, *args):
        getattr(kv, op)(*args)
        getattr(ref, op)(*args)

    def forward(items):
        got = grouped.forward_batch(kv, items)
        want = whole.forward_batch(ref, items)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=5e-5, rtol=1e-5)
        return got

    both("create", "a", 64)
    both("create", "b", 64)
    forward([BatchItem("a", ids(5, 9, 13, 21, 34), all_logits=False), BatchItem("b", ids(7, 8), all_logits=False)])
    both("fork", "a", "a2", 3, 16)  # a cached prefix read in place
    forward([BatchItem("a2", ids(40, 41), all_logits=False), BatchItem("b", ids(3), all_logits=False)])
    # a verify round: a tree of 3 drafts over "a", two of them kept
    mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    forward([BatchItem("a", ids(50, 51, 52), tree_mask=mask, all_logits=True)])
    both("keep", "a", 5, [0, 2])
    both("truncate", "b", 2)
    forward([BatchItem("a", ids(60), all_logits=False), BatchItem("b", ids(61), all_logits=False)])
    both("free", "a2")
    both("trim", "b")
    forward([BatchItem("b", ids(62, 63), all_logits=True, logit_rows=1)])
    assert follower.is_alive() and not outcome  # still in step, nothing failed


def test_a_refused_sequence_keeps_the_members_in_step(whole, group):
    """A context overflow is refused before any partial sum, on both members alike: the next pass works."""
    grouped, follower, outcome = group
    kv = grouped.new_cache(4096)
    kv.create("long", 64)
    too_long = torch.zeros(whole.config.max_position + 1, dtype=torch.long)
    with pytest.raises(Exception, match="context"):
        grouped.forward_batch(kv, [BatchItem("long", too_long, all_logits=False)])
    out = grouped.forward_batch(kv, [BatchItem("long", ids(1, 2, 3), all_logits=False)])[0]
    assert out.shape[-1] == whole.config.vocab_size and follower.is_alive() and not outcome


def test_a_member_that_fails_a_pass_ends_the_first_members_wait(whole, group, monkeypatch):
    """The follower raises in a pass (its own trouble): it leaves the group, and the first member's pass
    ends in GroupLost (a 'link' error: the request replays) instead of waiting for partial sums forever."""
    from decoding.tensor_group import GroupLost

    grouped, follower, outcome = group
    kv = grouped.new_cache(4096)
    kv.create("s", 64)
    grouped.forward_batch(kv, [BatchItem("s", ids(1, 2, 3), all_logits=False)])
    kv.create("doomed", 64)
    # the follower's cache refuses what the first member admitted (as a follower out of step would)
    monkeypatch.setattr("meshd.pipeline.tensor.member.apply_ops",
                        lambda stage, kv, ops: (_ for _ in ()).throw(RuntimeError("out of step")))
    with pytest.raises(GroupLost):
        grouped.forward_batch(kv, [BatchItem("doomed", ids(4, 5), all_logits=False)])
    follower.join(timeout=30)
    assert not follower.is_alive() and isinstance(outcome[0], RuntimeError)


def test_leaving_for_a_new_plan_ends_a_pass_that_waits_on_the_others(whole, group, monkeypatch):
    """A first member blocked in an exchange (the other member went quiet) is freed by abort, at once."""
    from decoding.tensor_group import GroupLost
    from meshd.pipeline.tensor import member

    grouped, _, _ = group
    kv = grouped.new_cache(4096)
    kv.create("s", 64)
    grouped.forward_batch(kv, [BatchItem("s", ids(1, 2), all_logits=False)])
    quiet = threading.Event()
    real = member.apply_ops
    monkeypatch.setattr(member, "apply_ops", lambda *a: (quiet.wait(30), real(*a))[1])
    timer = threading.Timer(0.5, grouped.abort, args=("a new plan",))
    timer.start()
    try:
        with pytest.raises(GroupLost, match="new plan"):
            grouped.forward_batch(kv, [BatchItem("s", ids(3), all_logits=False)])
    finally:
        quiet.set()
        timer.join()
