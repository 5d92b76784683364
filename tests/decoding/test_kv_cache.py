"""KV cache semantics the decoders rely on: rollback, prefix sharing, tree verification, budgets."""

import pytest
import torch

from decoding.errors import CacheError
from decoding.loader import open_model
from decoding.masks import tree_mask_from_parents


@pytest.fixture(scope="module")
def stage(tiny_llama):
    src = open_model(tiny_llama[0])
    return src.load_stage(0, src.config.num_layers)


def ids(n, seed=0):
    return torch.randint(0, 211, (n,), generator=torch.Generator().manual_seed(seed))


def test_rollback_then_reappend_equals_never_appending(stage):
    kv = stage.new_cache()
    prompt, wrong, right = ids(20), ids(5, 1), ids(3, 2)
    kv.create("a", 8)  # deliberately small: the buffer must grow
    stage.forward(kv, "a", prompt)
    stage.forward(kv, "a", wrong)
    kv.truncate("a", 20)
    got = stage.forward(kv, "a", right)
    kv.create("b", 64)
    stage.forward(kv, "b", prompt)
    want = stage.forward(kv, "b", right)
    assert kv.length("a") == kv.length("b") == 23
    assert torch.allclose(got, want, atol=1e-5)


def test_tree_verification_equals_verifying_each_branch_separately(stage):
    #        prefix
    #       /      \
    #     n0        n1
    #    /  \         \
    #  n2    n3        n4
    parents = [-1, -1, 0, 0, 1]
    tokens = ids(5, 7)
    prompt = ids(12, 8)
    kv = stage.new_cache()
    kv.create("tree", 32)
    stage.forward(kv, "tree", prompt)
    tree_logits = stage.forward(kv, "tree", tokens, tree_mask=tree_mask_from_parents(parents))
    for leaf_path in ([0, 2], [0, 3], [1, 4]):
        kv.create(("branch", *leaf_path), 32)
        stage.forward(kv, ("branch", *leaf_path), prompt)
        branch = stage.forward(kv, ("branch", *leaf_path), tokens[leaf_path])
        assert torch.allclose(tree_logits[leaf_path], branch, atol=1e-5)


def test_keeping_an_accepted_tree_path_leaves_the_cache_as_if_only_it_was_appended(stage):
    parents, tokens, prompt = [-1, -1, 0, 1], ids(4, 3), ids(10, 4)
    kv = stage.new_cache()
    kv.create("t", 32)
    stage.forward(kv, "t", prompt)
    stage.forward(kv, "t", tokens, tree_mask=tree_mask_from_parents(parents))
    kv.keep("t", 10, [1, 3])  # accept n1 -> n3
    nxt = ids(2, 5)
    got = stage.forward(kv, "t", nxt)
    kv.create("ref", 32)
    stage.forward(kv, "ref", torch.cat([prompt, tokens[[1, 3]]]))
    assert torch.allclose(got, stage.forward(kv, "ref", nxt), atol=1e-5)


def test_forked_children_share_the_prefix_without_copying_it(stage):
    kv = stage.new_cache(max_tokens=200)
    kv.create("prompt", 40)
    prompt = ids(30, 9)
    stage.forward(kv, "prompt", prompt)
    kv.fork("prompt", "point1", capacity=16)
    kv.fork("prompt", "point2", capacity=16)
    assert kv.reserved_tokens == 40 + 16 + 16  # children hold only their own positions
    a = stage.forward(kv, "point1", ids(4, 10))
    b = stage.forward(kv, "point2", ids(6, 11))
    kv.create("ref1", 64)
    stage.forward(kv, "ref1", prompt)
    assert torch.allclose(a, stage.forward(kv, "ref1", ids(4, 10)), atol=1e-5)
    assert b.shape[0] == 6 and kv.length("point2") == 36


def test_parent_cannot_roll_back_under_a_childs_prefix_and_outlives_it(stage):
    kv = stage.new_cache()
    kv.create("p", 32)
    stage.forward(kv, "p", ids(10))
    kv.fork("p", "c", capacity=8)
    with pytest.raises(CacheError, match="forked child"):
        kv.truncate("p", 5)
    with pytest.raises(CacheError, match="shared prefix"):
        kv.truncate("c", 3)
    kv.free("p")  # storage stays while the child reads it
    stage.forward(kv, "c", ids(2, 1))
    kv.free("c")
    assert kv.reserved_tokens == 0 and kv.sequences() == []


def test_full_cache_and_unknown_sequences_are_clear_errors(stage):
    kv = stage.new_cache(max_tokens=50)
    kv.create("a", 40)
    with pytest.raises(CacheError, match="cache full"):
        kv.create("b", 20)
    with pytest.raises(CacheError, match="unknown sequence"):
        kv.truncate("nope", 0)
    with pytest.raises(CacheError, match="already exists"):
        kv.create("a", 1)
