"""Speculative generation on real stages (in-process): equal to plain decoding, rollback exact.

Every drafter, with the model as 1, 2 and 3 stages, must produce exactly the
greedy tokens of plain decoding; a token tree verified in one pass must score
each branch as if it ran alone; and after a rollback the KV cache must be the
one that never saw the rejected tokens.
"""

import pytest
import torch

from decoding.errors import DrafterError
from decoding.generate import generate
from decoding.loader import open_model
from decoding.pipeline_local import LocalPipeline
from decoding.sampling import SamplingParams
from decoding.speculative.draft_model import ModelDrafter, check_same_tokenizer
from decoding.speculative.generate import MedusaSource, speculative_generate
from decoding.speculative.tree import DraftTree
from tests.support.speculative import PROMPTS, MirrorHeads


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    return open_model(tiny_llama[0])


def _drafters(pipe, source):
    last = pipe.stages[-1]
    return {
        "lookup": dict(drafter="lookup"),
        "medusa": dict(drafter="medusa", medusa=MedusaSource(MirrorHeads(), last.lm_head)),
        "auto": dict(drafter="auto", medusa=MedusaSource(MirrorHeads(), last.lm_head)),
        "draft_model": dict(drafter="draft_model",
                            model_drafter=ModelDrafter(LocalPipeline.from_source(source, 1))),
    }


@pytest.mark.parametrize("stages", [1, 2, 3])
@pytest.mark.parametrize("drafter", ["lookup", "medusa", "auto", "draft_model"])
def test_greedy_speculative_output_equals_plain_greedy(tiny, stages, drafter):
    pipe = LocalPipeline.from_source(tiny, stages)
    for prompt in PROMPTS:
        ref = generate(LocalPipeline.from_source(tiny, 1), prompt, 40).token_ids
        kw = _drafters(pipe, tiny)[drafter]
        got = speculative_generate(pipe, prompt, 40, **kw)
        assert got.token_ids == ref
        assert pipe.caches[0].sequences() == []  # freed


def test_forcing_every_round_to_carry_candidates_still_equals_plain_greedy(tiny):
    pipe = LocalPipeline.from_source(tiny, 2)
    prompt = PROMPTS[1]
    ref = generate(pipe, prompt, 40).token_ids
    for fixed in (1, 4, 12):
        got = speculative_generate(pipe, prompt, 40, drafter="draft_model", fixed=fixed,
                                   model_drafter=ModelDrafter(LocalPipeline.from_source(tiny, 1)))
        assert got.token_ids == ref
        assert got.speculative.rounds > 0 and got.speculative.accepted == got.speculative.drafted  # same model


def test_seeded_speculative_sampling_reproduces_plain_seeded_sampling(tiny):
    p = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=3)
    pipe = LocalPipeline.from_source(tiny, 2)
    prompt = PROMPTS[2]
    ref = generate(pipe, prompt, 40, p).token_ids
    got = speculative_generate(pipe, prompt, 40, p, drafter="auto",
                               medusa=MedusaSource(MirrorHeads(), pipe.stages[-1].lm_head))
    assert got.token_ids == ref


def test_a_tree_verified_in_one_pass_scores_each_branch_as_if_alone(tiny):
    stage = tiny.load_stage(0, tiny.config.num_layers)
    prompt = torch.tensor(list(range(3, 20)))
    tree = DraftTree.from_sequences(50, [[51, 52, 53], [51, 60], [70, 71]])
    kv = stage.new_cache()
    kv.create("t", 64)
    stage.forward(kv, "t", prompt)
    one_pass = stage.forward(kv, "t", torch.tensor(tree.tokens), tree_mask=tree.mask())
    for leaf in (3, 4, 6):
        path = tree.path_to(leaf)
        kv2 = stage.new_cache()
        kv2.create("b", 64)
        stage.forward(kv2, "b", prompt)
        alone = stage.forward(kv2, "b", torch.tensor(tree.tokens_of(path)))
        torch.testing.assert_close(one_pass[path], alone, atol=1e-4, rtol=1e-4)


def test_rollback_leaves_every_stages_kv_as_if_it_never_saw_the_rejected_tokens(tiny):
    pipe = LocalPipeline.from_source(tiny, 3)
    clean = LocalPipeline.from_source(tiny, 3)
    prompt = list(range(3, 20))
    tree = DraftTree.from_sequences(50, [[51, 52, 53], [51, 60], [70, 71]])
    path = tree.path_to(4)  # root -> 51 -> 60: a branch in the middle of the node list
    pipe.create("s", 64)
    clean.create("s", 64)
    pipe.prefill("s", prompt)
    clean.prefill("s", prompt)
    pipe.forward("s", torch.tensor(tree.tokens), tree_mask=tree.mask(), all_logits=True)
    pipe.keep("s", len(prompt), path)
    clean.forward("s", torch.tensor(tree.tokens_of(path)), all_logits=True)
    n = len(prompt) + len(path)
    for a, b in zip(pipe.caches, clean.caches):
        assert a.length("s") == b.length("s") == n
        for layer in range(a.num_layers):
            ka, va = a.visible("s", layer, n)
            kb, vb = b.visible("s", layer, n)
            torch.testing.assert_close(ka, kb, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(va, vb, atol=1e-5, rtol=1e-5)
    nxt = torch.tensor([9])
    torch.testing.assert_close(pipe.forward("s", nxt), clean.forward("s", nxt), atol=1e-5, rtol=1e-5)


class FakeTokenizer:
    """A tokenizer as far as the fingerprint looks: its pieces, its size, its EOS ids."""

    def __init__(self, pieces, eos=(0,)):
        self._pieces = dict(pieces)
        self.vocab_size = len(pieces)
        self.eos_ids = eos

    def pieces(self):
        return dict(self._pieces)


def test_a_draft_model_with_another_tokenizer_is_refused():
    ours = FakeTokenizer({"a": 0, "b": 1, "c": 2})
    check_same_tokenizer(ours, FakeTokenizer({"a": 0, "b": 1, "c": 2}))
    for other in (FakeTokenizer({"a": 0, "c": 1, "b": 2}), FakeTokenizer({"a": 0, "b": 1, "c": 2, "d": 3}),
                  FakeTokenizer({"a": 0, "b": 1, "c": 2}, eos=(2,))):
        with pytest.raises(DrafterError, match="tokenizer"):
            check_same_tokenizer(ours, other)


def test_speculative_sampling_on_a_model_keeps_its_next_token_distribution(tiny):
    """χ² over 4000 seeded draws: the first committed token follows the model's filtered distribution,
    and the second follows its conditional one, whatever the tree proposed."""
    from decoding.sampling import Sampler, filtered_probs
    from decoding.speculative.verify import verify_sampled
    from tests.support.stats import chi2_p_value

    params = SamplingParams(temperature=1.3, top_k=8)
    stage = tiny.load_stage(0, tiny.config.num_layers)
    kv = stage.new_cache()
    kv.create("p", 64)
    stage.forward(kv, "p", torch.tensor(list(range(3, 20))))
    root_logits = stage.forward(kv, "p", torch.tensor([20]))[-1]
    p1 = filtered_probs(root_logits, params)
    likely = torch.topk(p1, 3).indices.tolist()
    tree = DraftTree.from_sequences(20, [[likely[0], 5], [likely[1]], [likely[2], 7]])
    kv.truncate("p", 17)
    logits = stage.forward(kv, "p", torch.tensor(tree.tokens), tree_mask=tree.mask())
    counts = [0] * tiny.config.vocab_size
    second = {}
    for seed in range(4000):
        s = Sampler(SamplingParams(params.temperature, params.top_k, seed=seed))
        toks = verify_sampled(tree, logits, s.params, s.uniform).committed(tree)
        counts[toks[0]] += 1
        if toks[0] == likely[0] and len(toks) > 1:
            second[toks[1]] = second.get(toks[1], 0) + 1
    assert chi2_p_value(counts, p1.tolist()) > 0.01
    p2 = filtered_probs(logits[1], params)  # after the first branch's first token
    obs = [second.get(i, 0) for i in range(tiny.config.vocab_size)]
    assert chi2_p_value(obs, p2.tolist()) > 0.01
