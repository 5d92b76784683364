"""Speculative decoding's pure parts: token trees, acceptance, drafters, the adaptive controller.

Lossless is the contract: greedy verification reproduces greedy decoding token
for token, sampled verification keeps the target's distribution (χ² tests over
thousands of draws) and, with a seed, reproduces plain seeded sampling exactly.
"""

import itertools
import random

import pytest
import torch

from decoding.errors import BadSpeculativeParams
from decoding.masks import tree_mask_from_parents
from decoding.sampling import Sampler, SamplingParams, filtered_probs
from decoding.speculative.adaptive import Controller, RoundCost
from decoding.speculative.lookup import LookupDrafter
from decoding.speculative.params import SpeculativeParams, SpeculativeStats
from decoding.speculative.session import MedusaProposal, SpeculationSession
from decoding.speculative.tree import DraftTree
from decoding.speculative.verify import (verify_chain_rejection, verify_greedy, verify_sampled,
                                         verify_typical)
from tests.support.stats import chi2_p_value
from tests.support.repo import ROOT


# ------------------------------------------------------------------ trees

def test_a_trie_of_sequences_merges_common_prefixes_in_insertion_order():
    t = DraftTree.from_sequences(9, [[1, 2, 3], [1, 2, 4], [5]])
    assert t.tokens == (9, 1, 2, 3, 4, 5)
    assert t.parents == (-1, 0, 1, 2, 2, 0)
    assert t.children(2) == [3, 4] and t.depth() == 3 and not t.is_chain


def test_a_truncated_tree_is_still_a_tree_and_a_chain_needs_no_mask():
    t = DraftTree.from_sequences(0, [[1, 2, 3], [4, 5]])
    assert t.truncated(2).tokens == (0, 1, 2)
    assert t.truncated(0) == DraftTree.root_only(0)
    assert DraftTree.chain(0, [1, 2]).mask() is None
    assert torch.equal(t.mask(), tree_mask_from_parents(list(t.parents)))


@pytest.mark.parametrize("parents", [(0,), (-1, 1), (-1, 0, 3, 0), (-1, -1)])
def test_malformed_trees_are_refused(parents):
    with pytest.raises(ValueError):
        DraftTree(tuple(range(len(parents))), parents)


def test_from_sequences_caps_the_candidate_count():
    t = DraftTree.from_sequences(0, [[1, 2, 3, 4], [5, 6]], max_nodes=5)
    assert t.num_candidates == 5 and t.tokens == (0, 1, 2, 3, 4, 5)


# ------------------------------------------------------------------ greedy verification

def _brute_force_greedy(tree, logits):
    """Try every root-to-node path; the accepted one is the longest whose tokens are all argmax."""
    best = torch.argmax(logits, -1).tolist()
    good = [0]
    for node in range(1, tree.size):
        path = tree.path_to(node)
        if all(tree.tokens[path[i + 1]] == best[path[i]] for i in range(len(path) - 1)):
            if len(path) > len(good):
                good = path
    return tuple(good), best[good[-1]]


def test_greedy_verification_equals_brute_force_on_random_trees():
    rng = random.Random(3)
    for _ in range(200):
        vocab = rng.choice([3, 5])
        seqs = [[rng.randrange(vocab) for _ in range(rng.randint(1, 4))] for _ in range(rng.randint(1, 4))]
        tree = DraftTree.from_sequences(rng.randrange(vocab), seqs)
        logits = torch.randn(tree.size, vocab, generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
        v = verify_greedy(tree, logits)
        assert (v.path, v.next_token) == _brute_force_greedy(tree, logits)
        assert v.committed(tree) == tree.tokens_of(v.path[1:]) + [v.next_token]


# ------------------------------------------------------------------ sampled verification is lossless

def _fake_target(vocab=6, depth=3, seed=0):
    """Target logits as a function of the path's tokens (a random Markov-ish model)."""
    g = torch.Generator().manual_seed(seed)
    table = torch.randn(vocab ** depth + 7, vocab, generator=g) * 1.5

    def logits_for(prefix: tuple) -> torch.Tensor:
        key = 0
        for t in prefix:
            key = key * vocab + t + 1
        return table[key % table.shape[0]]
    return logits_for


def _tree_logits(tree, logits_for):
    return torch.stack([logits_for(tuple(tree.tokens_of(tree.path_to(i)))) for i in range(tree.size)])


PARAMS = SamplingParams(temperature=0.9, top_k=5, top_p=0.95, seed=11)


def test_sampled_tree_verification_keeps_the_targets_two_token_distribution():
    vocab = 6
    logits_for = _fake_target(vocab)
    tree = DraftTree.from_sequences(2, [[0, 1], [3], [1, 4], [0, 5]])
    logits = _tree_logits(tree, logits_for)
    n = 6000
    gen = torch.Generator().manual_seed(5)
    uniform = lambda: torch.rand((), generator=gen, dtype=torch.float64).item()  # noqa: E731
    counts = {}
    for _ in range(n):
        v = verify_sampled(tree, logits, PARAMS, uniform)
        toks = v.committed(tree)
        if len(toks) < 2:  # the path stopped after one token: draw the second from the target itself
            toks.append(int(torch.multinomial(filtered_probs(logits_for((2, toks[0])), PARAMS), 1,
                                              generator=gen)))
        counts[tuple(toks[:2])] = counts.get(tuple(toks[:2]), 0) + 1
    p1 = filtered_probs(logits_for((2,)), PARAMS)
    expected, observed = [], []
    for a, b in itertools.product(range(vocab), range(vocab)):
        expected.append(float(p1[a]) * float(filtered_probs(logits_for((2, a)), PARAMS)[b]))
        observed.append(counts.get((a, b), 0))
    assert sum(observed) == n
    assert chi2_p_value(observed, expected) > 0.01


def test_seeded_tree_verification_draws_the_same_tokens_as_plain_seeded_sampling():
    """One uniform per committed token, in order: speculation changes nothing about the stream."""
    logits_for = _fake_target(6, seed=4)
    plain = Sampler(PARAMS)
    context = (1,)
    expected = []
    for _ in range(40):
        t = plain(logits_for(context))
        expected.append(t)
        context += (t,)
    spec = Sampler(PARAMS)
    context, got = (1,), []
    rng = random.Random(0)
    while len(got) < 40:
        seqs = [[rng.randrange(6) for _ in range(3)] for _ in range(2)]
        tree = DraftTree.from_sequences(context[-1], seqs)
        logits = torch.stack([logits_for(context[:-1] + tuple(tree.tokens_of(tree.path_to(i))))
                              for i in range(tree.size)])
        v = verify_sampled(tree, logits, PARAMS, spec.uniform)
        toks = v.committed(tree)
        got += toks
        context += tuple(toks)
    assert got[:40] == expected
    assert spec.draws == len(got)


def test_chain_rejection_with_a_draft_distribution_is_lossless():
    vocab = 5
    g = torch.Generator().manual_seed(1)
    target = torch.randn(3, vocab, generator=g)
    draft = torch.softmax(torch.randn(2, vocab, generator=g), -1)
    params = SamplingParams(temperature=1.0, seed=1)
    gen = torch.Generator().manual_seed(9)
    uniform = lambda: torch.rand((), generator=gen, dtype=torch.float64).item()  # noqa: E731
    counts = [0] * vocab
    n = 6000
    for _ in range(n):
        x1 = int(torch.multinomial(draft[0], 1, generator=gen))
        x2 = int(torch.multinomial(draft[1], 1, generator=gen))
        tree = DraftTree.chain(0, [x1, x2])
        v = verify_chain_rejection(tree, target, draft, params, uniform)
        counts[v.committed(tree)[0]] += 1  # the first token's law must be the target's at the root
    p = torch.softmax(target[0], -1).tolist()
    assert chi2_p_value(counts, p) > 0.01


def test_typical_acceptance_is_greedy_exact_at_temperature_zero_and_opt_in_only():
    tree = DraftTree.chain(0, [1, 2])
    logits = torch.randn(3, 4)
    g = verify_greedy(tree, logits)
    assert verify_typical(tree, logits, SamplingParams(), lambda: 0.5) == g
    assert SpeculativeParams.parse("auto").typical is False


# ------------------------------------------------------------------ drafters

def _brute_force_lookup(tokens, n, length):
    suffix = tokens[-n:]
    for start in range(len(tokens) - n - 1, -1, -1):
        if tokens[start:start + n] == suffix:
            return tokens[start + n:start + n + length]
    return None


def test_lookup_proposes_what_followed_the_most_recent_match_of_the_longest_ngram():
    rng = random.Random(7)
    for _ in range(300):
        toks = [rng.randrange(4) for _ in range(rng.randint(2, 30))]
        d = LookupDrafter(toks, max_ngram=3, max_branches=1)
        got = d.propose(5)
        want = None
        for n in range(min(3, len(toks)), 0, -1):
            want = _brute_force_lookup(toks, n, 5)
            if want:
                break
        assert (got[0] if got else None) == (want or None)


def test_lookup_branches_start_with_different_tokens_and_extend_incrementally():
    d = LookupDrafter([1, 2, 3, 1, 2, 4, 1, 2], max_branches=3)
    props = d.propose(2)
    assert props[0] == [4, 1] and [3, 1] in props
    assert len({p[0] for p in props}) == len(props)
    d.extend([4])
    assert d.propose(1)[0] == [1]


# ------------------------------------------------------------------ adaptive

def test_the_controller_sends_nothing_when_rounds_cost_more_than_drafts_win():
    c = Controller(RoundCost(slope=1.0))
    assert c.choose([0.3, 0.1]) == 0
    cheap = Controller(RoundCost(slope=0.05))
    assert cheap.choose([0.9, 0.8, 0.7, 0.01]) == 3


def test_the_controller_probes_again_after_a_run_of_plain_rounds():
    c = Controller(RoundCost(slope=1.0), probe_every=3)  # each row a whole step: a probe of one candidate
    assert [c.choose([0.2, 0.1]) for _ in range(3)] == [0, 0, 1]
    cheap = Controller(RoundCost(slope=0.2), probe_every=3)
    assert [cheap.choose([0.05, 0.01]) for _ in range(3)] == [0, 0, 2]


def test_a_probe_wins_only_when_what_it_took_paid_for_its_rows():
    c = Controller(RoundCost(slope=0.6), probe_every=2, max_probe_every=8)
    c.choose([0.2]), c.choose([0.2])  # the second is a probe of one candidate: 1.6 steps
    c.observe(0.2, 1)  # two tokens for 1.6 steps: a win, the next probe comes as soon
    assert c.choose([0.2]) == 0 and c.choose([0.2]) == 1
    expensive = Controller(RoundCost(slope=1.5), probe_every=2, max_probe_every=8)
    expensive.choose([0.2]), expensive.choose([0.2])
    expensive.observe(0.2, 1)  # two tokens for 2.5 steps: not a win, the next probe waits twice as long
    assert [expensive.choose([0.2]) for _ in range(4)] == [0, 0, 0, 1]


def test_heads_are_asked_for_only_when_the_next_round_may_use_them():
    """Once speculation stops paying, the last stage stops computing heads, except before a probe."""
    s = SpeculationSession("medusa", [1, 2, 3], cost=RoundCost(slope=1.0))
    s.controller = Controller(s.cost, probe_every=3)
    from decoding.speculative.verify import Verdict

    weak = MedusaProposal([[9], [9, 8]], [0.2, 0.1])
    wants = []
    for _ in range(6):
        tree = s.next_tree(weak if wants[-1:] != [False] else None)
        wants.append(s.wants_medusa)
        s.commit(tree, Verdict((0,), 4))
    # idle, ask before the probe, probe; it won nothing, so the next probe is twice as far away
    assert wants == [False, True, True, False, False, False]
    assert SpeculationSession("lookup", [1, 2]).wants_medusa is False
    eager = SpeculationSession("medusa", [1, 2], cost=RoundCost(slope=0.0))
    eager.next_tree(MedusaProposal([[9]], [0.9]))
    assert eager.wants_medusa


def test_probes_that_win_nothing_back_off_and_a_win_restores_them():
    c = Controller(RoundCost(slope=1.0), probe_every=2, max_probe_every=8)

    def plain_rounds_before_a_probe(accepted: int) -> int:
        n = 0
        while c.choose([0.2, 0.1]) == 0:
            n += 1
        c.observe(0.3, accepted)
        return n

    assert [plain_rounds_before_a_probe(0) for _ in range(5)] == [1, 3, 7, 7, 7]
    plain_rounds_before_a_probe(1)
    assert plain_rounds_before_a_probe(0) == 1


def test_round_cost_learns_the_slope_of_observed_rounds():
    cost = RoundCost(slope=0.5)
    for _ in range(5):
        for m in (1, 4, 8):
            cost.observe(m, 0.040 + 0.004 * (m - 1))  # 40 ms + 4 ms per extra token
    assert cost.slope == pytest.approx(0.1, rel=0.05)


def test_a_session_pools_drafts_best_first_and_counts_what_was_accepted():
    s = SpeculationSession("auto", [5, 6, 7, 5, 6], cost=RoundCost(slope=0.0))
    tree = s.next_tree(MedusaProposal([[9], [9, 8]], [0.1, 0.05]))
    assert tree.root == 6 and tree.tokens[1] == 7  # the lookup continuation outranks weak heads
    from decoding.speculative.verify import Verdict
    toks = s.commit(tree, Verdict((0, 1), 5))
    assert toks == [7, 5] and s.context[-2:] == [7, 5]
    st = s.stats()
    assert (st.rounds, st.accepted) == (1, 1) and st.drafted == tree.num_candidates


# ------------------------------------------------------------------ the request field

@pytest.mark.parametrize("value,expected", [
    (None, SpeculativeParams()), ("auto", SpeculativeParams()), ("off", SpeculativeParams(mode="off")),
    ({"drafter": "lookup"}, SpeculativeParams(mode="on", drafter="lookup")),
    ({"drafter": "medusa", "max_candidates": 5, "typical": True},
     SpeculativeParams(mode="on", drafter="medusa", max_candidates=5, typical=True)),
    ({"draft_model": "small.gguf"}, SpeculativeParams(mode="on", drafter="draft_model", draft_model="small.gguf")),
])
def test_the_speculative_field_parses(value, expected):
    assert SpeculativeParams.parse(value) == expected


@pytest.mark.parametrize("value", ["fast", 3, [], {"drafter": "magic"}, {"max_candidates": 0},
                                   {"max_candidates": 10 ** 30}, {"max_candidates": True},
                                   {"typical": "yes"}, {"surprise": 1}, {"drafter": "lookup", "typical": True}])
def test_a_malformed_speculative_field_is_a_clear_error(value):
    with pytest.raises(BadSpeculativeParams):
        SpeculativeParams.parse(value)


def test_stats_report_tokens_per_round():
    s = SpeculativeStats("lookup", rounds=4, drafted=12, accepted=6)
    assert s.to_dict()["accepted_per_round"] == 2.5


def test_the_profiles_price_a_verify_round_and_observations_then_take_over():
    from partition.link import parse_link
    from partition.planner import stage_timings
    from partition.profile import load
    from partition.sequence import round_cost_slope
    from partition.stages import StageAssignment

    prof = load(ROOT / "profiles" / "x86_64-2core-1thread.json")
    stages = stage_timings((StageAssignment("a", 0, 15), StageAssignment("b", 15, prof.num_layers)),
                           {"a": prof, "b": prof}, parse_link("1gbit,1ms"))
    slope = round_cost_slope(stages, context=256, m=8)
    t1 = sum(s.chunk_time(1, 256) for s in stages)
    t8 = sum(s.chunk_time(8, 256) for s in stages)
    assert slope == pytest.approx((t8 - t1) / (7 * t1)) and 0 < slope < 1
    cost = RoundCost()
    cost.prior(slope)
    assert cost.slope == pytest.approx(slope)
    for _ in range(4):
        for m in (1, 5):
            cost.observe(m, 0.05 + 0.001 * (m - 1))
    cost.prior(0.9)  # too late: what the mesh measured wins
    assert cost.slope == pytest.approx(0.02, rel=0.1)
