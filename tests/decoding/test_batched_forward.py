"""Batched stage forwards: several sequences in one pass give what each gives alone.

The batch shares the weight reads, never the keys: every sequence keeps its own
positions, cache, masks and plan of rows, so a batch of a prompt chunk, a decode
step, a verify tree and a forked child's step equals running each by itself
(logits within float tolerance; greedy tokens identical on the real model).
"""

import pytest
import torch

from decoding.loader import open_model
from decoding.masks import tree_mask_from_parents
from decoding.attention import segmented_attention
from decoding.batch import BatchItem

ATOL = 1e-4


@pytest.fixture(scope="module")
def tiny_stages(tiny_llama):
    src = open_model(tiny_llama[0])
    n = src.config.num_layers
    return src, src.load_stage(0, n), src.load_stage(0, n // 2), src.load_stage(n // 2, n)


def ids(n, seed=0):
    return torch.randint(0, 211, (n,), generator=torch.Generator().manual_seed(seed))


def _close(a, b):
    if isinstance(a, tuple):
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, atol=ATOL, rtol=ATOL)
    else:
        torch.testing.assert_close(a, b, atol=ATOL, rtol=ATOL)


def test_a_mixed_batch_equals_each_sequence_run_alone(tiny_stages):
    _, stage, _, _ = tiny_stages
    alone, batched = stage.new_cache(), stage.new_cache()
    prompts = {"a": ids(9, 1), "b": ids(17, 2), "c": ids(4, 3)}
    for kv in (alone, batched):
        for s, p in prompts.items():
            kv.create(s, 8)  # small: buffers grow inside the batch
            stage.forward(kv, s, p, head=False)
    tree = tree_mask_from_parents([-1, 0, 0, 1])
    items = [BatchItem("a", ids(1, 4), all_logits=False),                     # a decode step
             BatchItem("b", ids(4, 5), tree_mask=tree, return_normed=True),   # a verify tree
             BatchItem("c", ids(6, 6), head=False),                           # a prompt chunk
             BatchItem("d", ids(5, 7), all_logits=True)]                      # a new sequence's first chunk
    alone.create("d", 8)
    batched.create("d", 8)
    want = [stage.forward(alone, it.seq_id, it.x, it.tree_mask, it.all_logits, it.head, it.return_normed)
            for it in items]
    got = stage.forward_batch(batched, items)
    for g, w in zip(got, want):
        _close(g, w)
    assert got[0].shape[0] == 1 and got[1][0].shape[0] == 4 and got[2].shape[0] == 6
    for s in "abcd":
        assert batched.length(s) == alone.length(s)
    # and the caches hold the same keys: the next step agrees too
    nxt = ids(1, 9)
    for s in "abcd":
        _close(stage.forward(batched, s, nxt), stage.forward(alone, s, nxt))


def test_batches_through_a_two_stage_split_equal_the_whole_model(tiny_stages):
    _, whole, first, last = tiny_stages
    kv_w, kv_1, kv_2 = whole.new_cache(), first.new_cache(), last.new_cache()
    seqs = {f"s{i}": ids(3 + 5 * i, 10 + i) for i in range(4)}
    for kv in (kv_w, kv_1, kv_2):
        for s in seqs:
            kv.create(s, 32)
    for s, p in seqs.items():
        whole.forward(kv_w, s, p, head=False)
    hidden = first.forward_batch(kv_1, [BatchItem(s, p) for s, p in seqs.items()])
    last.forward_batch(kv_2, [BatchItem(s, h, head=False) for s, h in zip(seqs, hidden)])
    step = {s: ids(1, 20 + i) for i, s in enumerate(seqs)}
    want = [whole.forward(kv_w, s, t) for s, t in step.items()]
    hidden = first.forward_batch(kv_1, [BatchItem(s, t) for s, t in step.items()])
    got = last.forward_batch(kv_2, [BatchItem(s, h, all_logits=False) for s, h in zip(seqs, hidden)])
    for g, w in zip(got, want):
        _close(g, w)


def test_a_sequence_may_appear_only_once_per_batch(tiny_stages):
    _, stage, _, _ = tiny_stages
    kv = stage.new_cache()
    kv.create("a", 8)
    with pytest.raises(ValueError, match="only once"):
        stage.forward_batch(kv, [BatchItem("a", ids(1)), BatchItem("a", ids(1, 1))])


def test_forked_children_read_the_shared_prefix_in_place_and_match_a_private_copy(tiny_stages):
    _, stage, _, _ = tiny_stages
    kv = stage.new_cache()
    prefix = ids(20, 30)
    kv.create("parent", 32)
    stage.forward(kv, "parent", prefix, head=False)
    before = kv.reserved_tokens
    kids = [f"k{i}" for i in range(4)]
    for k in kids:
        kv.fork("parent", k, capacity=8)
    assert kv.reserved_tokens == before + 4 * 8  # P + own, never N * P
    own = {k: ids(3 + i, 40 + i) for i, k in enumerate(kids)}
    got = stage.forward_batch(kv, [BatchItem(k, own[k]) for k in kids])
    for k, g in zip(kids, got):
        ref = stage.new_cache()
        ref.create("x", 64)
        stage.forward(ref, "x", prefix, head=False)
        _close(g, stage.forward(ref, "x", own[k]))
    # a grandchild forked from a child sees parent prefix + child's own tokens
    kv.fork("k0", "g", capacity=4)
    g = stage.forward(kv, "g", ids(2, 50))
    ref = stage.new_cache()
    ref.create("x", 64)
    stage.forward(ref, "x", torch.cat([prefix, own["k0"]]), head=False)
    _close(g, stage.forward(ref, "x", ids(2, 50)))
    # freeing is reference-counted: the parent's storage outlives its own free until the last child goes
    kv.free("parent")
    assert kv.reserved_tokens > 0
    for k in [*kids, "g"]:
        kv.free(k)
    assert kv.reserved_tokens == 0


def test_segmented_attention_equals_attention_over_the_concatenated_keys():
    torch.manual_seed(0)
    nh, nkv, hd, n = 6, 2, 8, 3
    q = torch.randn(nh, n, hd)
    segs = [(torch.randn(nkv, L, hd), torch.randn(nkv, L, hd)) for L in (5, 7, n)]
    total = 5 + 7 + n
    mask = torch.ones(n, total, dtype=torch.bool)
    mask[:, -n:] = torch.tril(torch.ones(n, n, dtype=torch.bool))
    keys = torch.cat([k for k, _ in segs], 1)
    values = torch.cat([v for _, v in segs], 1)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0), attn_mask=mask, scale=hd ** -0.5,
        enable_gqa=True)[0]
    torch.testing.assert_close(segmented_attention(q, segs, mask, hd ** -0.5), want, atol=1e-5, rtol=1e-5)


def test_real_model_batched_greedy_decoding_is_token_identical_to_each_request_alone(real_source):
    stage = real_source.load_stage(0, real_source.config.num_layers)
    tok = real_source.tokenizer
    prompts = ["The capital of France is", "List three uses of a smart thermostat:",
               "def fibonacci(n):", "Once upon a time"]
    steps = 12

    def alone(p):
        kv = stage.new_cache()
        kv.create("s", 64)
        out, x = [], torch.tensor(tok.encode(p))
        for _ in range(steps):
            t = int(stage.forward(kv, "s", x, all_logits=False)[-1].argmax())
            out.append(t)
            x = torch.tensor([t])
        return out

    want = [alone(p) for p in prompts]
    kv = stage.new_cache()
    xs = {}
    for i, p in enumerate(prompts):
        kv.create(i, 64)
        xs[i] = torch.tensor(tok.encode(p))
    got = {i: [] for i in xs}
    for _ in range(steps):
        logits = stage.forward_batch(kv, [BatchItem(i, x, all_logits=False) for i, x in xs.items()])
        for i, lg in zip(list(xs), logits):
            t = int(lg[-1].argmax())
            got[i].append(t)
            xs[i] = torch.tensor([t])
    assert [got[i] for i in range(len(prompts))] == want
