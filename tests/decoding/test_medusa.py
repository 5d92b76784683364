"""Medusa self-drafting heads: the file format, the heads' maths, the tree, training, the shipped file."""

from __future__ import annotations

import random

import pytest
import torch

from decoding.errors import DrafterError
from decoding.loader import open_model
from decoding.masks import tree_mask_from_parents
from decoding.medusa import MedusaHeads, build_tree, chain_tree, expected_accepted, tree_parents
from decoding.training.medusa import TrainConfig, mean_loss, train_heads
from decoding.training.medusa_data import (IGNORE, Example, HiddenSet, RuntimeCheck, collect_hidden, generate_runtime,
                                           is_heldout, load_prompts)
from decoding.training.medusa_eval import evaluate, simulate_greedy


def random_heads(k=3, d=16, vocab=40, seed=0, tree=None) -> MedusaHeads:
    torch.manual_seed(seed)
    heads = MedusaHeads(k, d, tree=tree, meta={"vocab_size": vocab, "hidden_size": d, "note": "test"})
    with torch.no_grad():
        heads.w1.normal_(0, 0.3)
        heads.b1.normal_(0, 0.3)
    return heads


# -- file format ---------------------------------------------------------------------
def test_save_then_load_gives_the_same_heads_tree_and_meta(tmp_path):
    heads = random_heads(tree=[(0,), (1,), (0, 0), (0, 0, 0)])
    path = tmp_path / "h.pt"
    digest = heads.save(path)
    from decoding.loader.files import sha256_of

    assert digest == sha256_of(path)
    back = MedusaHeads.load(path, sha256=digest, vocab_size=40, hidden_size=16)
    assert (back.num_heads, back.hidden_size) == (3, 16)
    assert back.tree == [(0,), (1,), (0, 0), (0, 0, 0)]
    assert back.meta == heads.meta
    lm = torch.randn(40, 16)
    x = torch.randn(5, 16)
    # fp16 storage: the round trip is close, not bit-exact
    torch.testing.assert_close(back.head_logits(x, lm), heads.head_logits(x, lm), atol=2e-2, rtol=1e-2)
    assert not any(p.requires_grad for p in back.parameters())


def test_a_missing_heads_file_is_a_clear_drafter_error(tmp_path):
    with pytest.raises(DrafterError, match="not found"):
        MedusaHeads.load(tmp_path / "nope.pt")


def test_a_sha256_mismatch_is_refused(tmp_path):
    path = tmp_path / "h.pt"
    random_heads().save(path)
    with pytest.raises(DrafterError, match="sha256 mismatch"):
        MedusaHeads.load(path, sha256="0" * 64)


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_a_damaged_file_is_a_drafter_error(tmp_path, damage):
    path = tmp_path / "h.pt"
    random_heads().save(path)
    data = path.read_bytes()
    path.write_bytes({"truncate": data[: len(data) // 2], "garbage": b"\x00not a heads file" * 50,
                      "empty": b""}[damage])
    with pytest.raises(DrafterError, match="not a readable Medusa heads file"):
        MedusaHeads.load(path)


class Evil:
    def __reduce__(self):
        return (print, ("this must never run",))


def test_a_pickle_with_code_is_never_executed(tmp_path, capsys):
    path = tmp_path / "evil.pt"
    torch.save({"format": "meshd-medusa-heads", "payload": Evil()}, path)
    with pytest.raises(DrafterError):
        MedusaHeads.load(path)
    assert "must never run" not in capsys.readouterr().out


def test_a_file_that_is_not_heads_or_has_wrong_shapes_is_refused(tmp_path):
    path = tmp_path / "other.pt"
    torch.save({"weights": torch.zeros(3)}, path)
    with pytest.raises(DrafterError, match="format tag"):
        MedusaHeads.load(path)
    state = random_heads().state_for_file({})
    state["w1"] = state["w1"][:, :8]
    torch.save(state, path)
    with pytest.raises(DrafterError, match=r"w1 must be \[3, 16, 16\]"):
        MedusaHeads.load(path)
    state = random_heads().state_for_file({})
    state["tree"] = [[0, 0]]  # a child without its parent
    torch.save(state, path)
    with pytest.raises(DrafterError, match="must be listed before"):
        MedusaHeads.load(path)


def test_heads_for_another_model_shape_are_refused(tmp_path):
    path = tmp_path / "h.pt"
    random_heads(d=16, vocab=40).save(path)
    with pytest.raises(DrafterError, match="hidden size 16, this model has 32"):
        MedusaHeads.load(path, hidden_size=32)
    with pytest.raises(DrafterError, match="vocabulary of 40 tokens, this model has 41"):
        MedusaHeads.load(path, vocab_size=41)
    heads = MedusaHeads.load(path)
    with pytest.raises(DrafterError, match="vocabulary of 40"):
        heads.head_logits(torch.randn(16), torch.randn(41, 16))
    with pytest.raises(DrafterError, match="hidden states of size 16"):
        heads.head_logits(torch.randn(32), torch.randn(40, 32))


# -- the heads' maths ----------------------------------------------------------------
def test_head_logits_shapes_and_dtype():
    heads = random_heads(k=4, d=16, vocab=40)
    lm = torch.randn(40, 16)
    assert heads.head_logits(torch.randn(16), lm).shape == (4, 40)
    out = heads.head_logits(torch.randn(7, 16), lm)
    assert out.shape == (7, 4, 40) and out.dtype == torch.float32
    x = torch.randn(16)
    torch.testing.assert_close(heads.head_logits(x, lm, num_heads=2), heads.head_logits(x, lm)[:2])
    # a bfloat16 stage's tensors work too, and still give float32 logits
    assert heads.head_logits(torch.randn(16, dtype=torch.bfloat16), lm.bfloat16()).dtype == torch.float32


def test_untrained_heads_equal_the_models_own_lm_head():
    heads = MedusaHeads(5, 16)
    assert torch.count_nonzero(heads.w1) == 0
    lm, x = torch.randn(40, 16), torch.randn(3, 16)
    out = heads.head_logits(x, lm)
    for k in range(5):
        torch.testing.assert_close(out[:, k], x @ lm.T)


def test_each_head_is_a_residual_block_before_the_shared_lm_head():
    heads = random_heads(k=2, d=16, vocab=40)
    lm, x = torch.randn(40, 16), torch.randn(16)
    out = heads.head_logits(x, lm)
    for k in range(2):
        y = x + torch.nn.functional.silu(heads.w1[k] @ x + heads.b1[k])
        torch.testing.assert_close(out[k], lm @ y.detach(), rtol=1e-4, atol=1e-4)


# -- trees ---------------------------------------------------------------------------
def test_chain_tree_is_top1_of_each_head_in_order():
    assert chain_tree(5) == [(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0), (0, 0, 0, 0, 0)]
    assert tree_parents(chain_tree(5)) == [-1, 0, 1, 2, 3]


def test_tree_parents_feed_the_tree_mask_and_reject_bad_orders():
    paths = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]
    parents = tree_parents(paths)
    assert parents == [-1, -1, 0, 0, 1, 2]
    mask = tree_mask_from_parents(parents)
    assert mask[5].tolist() == [True, False, True, False, False, True]  # (0,0,0) sees (0,), (0,0), itself
    with pytest.raises(ValueError, match="listed before"):
        tree_parents([(0, 0), (0,)])
    with pytest.raises(ValueError, match="twice"):
        tree_parents([(0,), (0,)])


def all_prefix_closed_trees(num_heads, ranks, max_nodes):
    """Every prefix-closed set of at most max_nodes paths (brute force, tiny cases only)."""
    seen = {frozenset()}
    frontier = [frozenset()]
    while frontier:
        nxt = []
        for s in frontier:
            if len(s) == max_nodes:
                continue
            cands = [(i,) for i in range(ranks)] + [p + (i,) for p in s if len(p) < num_heads for i in range(ranks)]
            for c in cands:
                if c not in s:
                    t = s | {c}
                    if t not in seen:
                        seen.add(t)
                        nxt.append(t)
        frontier = nxt
    return seen


@pytest.mark.parametrize("seed", range(6))
def test_build_tree_is_the_best_prefix_closed_tree_by_brute_force(seed):
    rng = random.Random(seed)
    num_heads, ranks = 3, 2
    acc = []
    for _ in range(num_heads):
        a = sorted((rng.random() for _ in range(ranks)), reverse=True)
        total = sum(a) * rng.uniform(1.0, 1.6)
        acc.append([x / total for x in a])  # per-rank chances of one head sum to <= 1
    trees = all_prefix_closed_trees(num_heads, ranks, 5)
    for max_nodes in range(1, 6):
        tree = build_tree(acc, max_nodes=max_nodes)
        assert len(tree) <= max_nodes
        tree_parents(tree)  # parents first, prefix-closed (raises otherwise)
        best = max(expected_accepted(sorted(t), acc) for t in trees if len(t) <= max_nodes)
        assert expected_accepted(tree, acc) == pytest.approx(best)
        # best first: every prefix of the list is itself the best tree of its size
        assert tree[: max_nodes - 1] == build_tree(acc, max_nodes=max_nodes - 1)


def test_build_tree_caps_at_64_nodes_and_skips_hopeless_nodes():
    acc = [[0.6, 0.2, 0.1, 0.05] + [0.0] * 6 for _ in range(5)]
    tree = build_tree(acc)
    assert len(tree) == 64
    assert all(max(p) <= 3 for p in tree)  # rank >= 4 has accuracy 0 and is never worth a node
    assert tree[0] == (0,) and tree[1] == (0, 0)
    assert build_tree([[1.0, 0.0]] * 2, max_nodes=64) == [(0,), (0, 0)]


# -- training ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_data(tiny_llama):
    path, _ = tiny_llama
    source = open_model(path)
    stage = source.load_stage(0, source.config.num_layers)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 200) for _ in range(rng.randint(3, 8))] for _ in range(8)]
    answers = generate_runtime(stage, prompts, max_new_tokens=24, eos_ids=())
    examples = [Example(f"p{i}", i >= 6, p, a) for i, (p, a) in enumerate(zip(prompts, answers))]
    check = RuntimeCheck()
    data = collect_hidden(stage, [e for e in examples if not e.heldout], 3, check)
    held = collect_hidden(stage, [e for e in examples if e.heldout], 3, RuntimeCheck())
    return stage, examples, data, held, check


def test_cached_rows_are_the_models_own_greedy_continuation(tiny_data):
    stage, examples, data, _, check = tiny_data
    # the runtime generated the answers, so nothing is cut and every row's LM head gives back its root
    assert check.kept_tokens == check.tokens == 6 * 24 and check.cut_answers == 0
    assert torch.equal((data.hidden @ stage.lm_head.float().T).argmax(-1), data.root)
    ex = examples[0]
    seq = ex.prompt_ids + ex.answer_ids
    start, end = data.spans[0]
    p = len(ex.prompt_ids)
    assert end - start == len(seq) - p - 1  # positions p-1 .. len-3
    for row, t in zip(range(start, end), range(p - 1, len(seq) - 2)):
        assert int(data.root[row]) == seq[t + 1]
        for k in range(3):
            want = seq[t + k + 2] if t + k + 2 < len(seq) else IGNORE
            assert int(data.targets[row, k]) == want


def test_an_answer_is_cut_where_it_stops_being_the_runtimes_greedy_choice(tiny_data):
    stage, examples, _, _, _ = tiny_data
    ex = examples[0]
    wrong = list(ex.answer_ids)
    wrong[10] = (wrong[10] + 1) % stage.config.vocab_size
    check = RuntimeCheck()
    data = collect_hidden(stage, [Example("x", False, ex.prompt_ids, wrong)], 3, check)
    assert check.kept_tokens == 10 and check.cut_answers == 1
    assert data.spans == [(0, 9)]  # positions p-1 .. p+7: targets never reach the bad token


def test_a_short_training_run_lowers_the_loss(tiny_data):
    stage, _, data, held, _ = tiny_data
    heads = MedusaHeads(3, stage.config.hidden_size)
    lm = stage.lm_head.float()
    before = mean_loss(heads, data, lm)
    stats = train_heads(heads, data, lm, steps=40, cfg=TrainConfig(lr=3e-3, batch_size=32, bf16=False))
    after = mean_loss(heads, data, lm)
    assert stats["steps"] == 40
    assert after < 0.8 * before
    ev = evaluate(heads, held, lm)
    assert len(ev["top1"]) == 3 and all(0.0 <= a <= b <= 1.0 for a, b in zip(ev["top1"], ev["top5"]))
    assert 1 <= ev["tree_nodes"] <= 64
    if set(chain_tree(3)) <= {tuple(p) for p in ev["tree"]}:  # a tree holding the chain accepts at least as much
        assert ev["built_tree"]["mean_accepted"] >= ev["chain"]["mean_accepted"]


def test_greedy_replay_accepts_the_longest_matching_path():
    # one answer of 8 rows; targets[t, k] is the token k+2 ahead, encoded as 100*t + k
    n, k = 8, 3
    targets = torch.tensor([[100 * t + j if t + j < n else IGNORE for j in range(k)] for t in range(n)])
    data = HiddenSet(torch.zeros(n, 4), torch.zeros(n, dtype=torch.long), targets, [(0, n)])
    top = torch.full((n, k, 2), -1, dtype=torch.long)
    top[0, 0, 0], top[0, 1, 0] = 0, 1           # row 0: heads 0 and 1 right at rank 0 -> accept 2, jump to row 3
    top[3, 0, 1], top[3, 1, 0] = 300, 301       # row 3: head 0 right only at rank 1 -> chain 0, tree 2
    chain = simulate_greedy(top, data, chain_tree(k))
    tree = simulate_greedy(top, data, [(0,), (1,), (0, 0), (1, 0)])
    # chain: row0 accepts 2 (->3), row3 accepts 0 (->4), rows 4,5,6,7 accept 0: 6 rounds, 2 accepted
    assert chain["rounds"] == 6 and chain["mean_accepted"] == pytest.approx(2 / 6)
    # tree: row0 accepts 2 (->3), row3 accepts 2 via (1,0) (->6), rows 6, 7: 4 rounds, 4 accepted
    assert tree["rounds"] == 4 and tree["tokens_per_round"] == pytest.approx(8 / 4)


def test_the_shipped_prompt_set_is_varied_and_split_deterministically():
    from meshd.commands.heads import DEFAULT_PROMPTS

    prompts = load_prompts(DEFAULT_PROMPTS)
    assert len(prompts) >= 300
    assert len({p.category for p in prompts}) >= 8
    held = [p for p in prompts if p.heldout]
    assert 0.08 * len(prompts) < len(held) < 0.25 * len(prompts)
    assert all(p.heldout == is_heldout(p.id) for p in prompts)


# -- the shipped heads ---------------------------------------------------------------
def test_the_shipped_heads_load_verified_for_the_embedded_model(real_source, real_stage):
    from meshd.model.heads import HEADS_FILE, embedded_heads

    cfg = real_source.config
    heads = embedded_heads(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                           model_identity=real_source.identity)
    assert HEADS_FILE.stat().st_size < 8 * 2 ** 20
    assert heads.num_heads == 5 and heads.hidden_size == cfg.hidden_size
    assert 5 <= len(heads.tree) <= 64
    tree_parents(heads.tree)
    acc = heads.meta["heldout"]["top1"]
    assert len(acc) == 5 and acc[0] > 0.2  # trained: untrained heads echo the next token and score a few per cent
    assert len(heads.meta["topk_accuracy"]) == 5
    ids = real_source.tokenizer.apply_chat([{"role": "user", "content": "Turn off the kitchen light."}])
    from decoding.training.medusa_data import runtime_hidden

    h = runtime_hidden(real_stage, ids)
    assert heads.head_logits(h[-1], real_stage.lm_head).shape == (5, cfg.vocab_size)


def test_the_shipped_heads_refuse_another_model():
    from meshd.model.heads import embedded_heads

    with pytest.raises(DrafterError, match="trained for"):
        embedded_heads(model_identity="some-other-model.gguf@0123456789abcdef")
