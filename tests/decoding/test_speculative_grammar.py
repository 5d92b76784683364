"""Speculation under a grammar: drafts the grammar allows, verified in one pass, token for token exact.

A tool call is mostly not the model's choice: the grammar forces its separators and key
names, and the entity it names is copied from the prompt. The drafter's own copy of the
grammar turns forced text into draft tokens and cuts every draft at the first token the
grammar refuses; the last stage verifies with the sequence's selector, masking each row it
walks. The contract pinned here: greedy output equals plain constrained greedy decoding on
every shipped model with Home Assistant's tools, sampled output keeps the masked
distribution, and the grammar's state after a round is exactly plain decoding's.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from bench.ha_home import TOOLS as HA_TOOLS
from decoding.constrained import make_constraint
from decoding.generate import generate
from decoding.pipeline_local import LocalPipeline
from decoding.sampling import SamplingParams, SamplingSpec
from decoding.selector import TokenSelector
from decoding.speculative.generate import speculative_generate
from decoding.speculative.session import SpeculationSession
from decoding.speculative.tree import DraftTree
from decoding.speculative.verify import verify_shaped
from decoding.tool_grammar import style_of, tool_spec
from tests.support.local_engines import TOOL_MODEL
from tests.support.stats import chi2_p_value

SYSTEM = ("You are a voice assistant for Home Assistant. When controlling Home Assistant always call the "
          "intent tools.\nDevices:\n- names: Kitchen Ceiling Light\n  domain: light\n  areas: Kitchen\n"
          "- names: Bedroom Speaker\n  domain: media_player\n  areas: Bedroom\n"
          "- names: Garage Door\n  domain: cover\n  areas: Garage\n")
COMMANDS = ("Turn on the kitchen ceiling light", "Set the bedroom speaker volume to 25")


def _tools_spec(tok) -> dict:
    return tool_spec(HA_TOOLS, style_of(tok.meta.chat_template), required=False, parallel=True)


@pytest.fixture(scope="module")
def qwen():
    from meshd.model.store import is_named_pulled, open_model

    if not is_named_pulled(TOOL_MODEL):
        pytest.skip(f"{TOOL_MODEL} is not cached (scripts/setup.sh --with-tool-model fetches it)")
    return open_model(TOOL_MODEL)


def _models(real_source, request):
    return real_source if request.param == "smollm2" else request.getfixturevalue("qwen")


@pytest.fixture(scope="module", params=["smollm2", "qwen"])
def model(real_source, request):
    return _models(real_source, request)


def _pipeline(source) -> LocalPipeline:
    return LocalPipeline.from_source(source, 1, packed="gguf")


def test_speculation_under_the_tool_grammar_equals_plain_constrained_greedy(model):
    """Home Assistant's tools, both model families: the same tokens, in fewer model steps."""
    tok = model.tokenizer
    pipe = _pipeline(model)
    spec = SamplingSpec(SamplingParams(), constraint=_tools_spec(tok))
    eos = tuple(tok.eos_ids)
    steps = tokens = 0
    for cmd in COMMANDS if model.config.vocab_size < 100_000 else COMMANDS[:1]:  # Qwen's prefill: one is enough
        ids = tok.apply_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": cmd}],
                             tools=HA_TOOLS)
        plain = generate(pipe, ids, 48, spec, eos_ids=eos, tokenizer=tok)
        fast = speculative_generate(pipe, ids, 48, spec, eos_ids=eos, tokenizer=tok, drafter="lookup")
        assert fast.token_ids == plain.token_ids, (cmd, plain.text, fast.text)
        assert fast.finish_reason == plain.finish_reason
        stats = fast.speculative
        assert stats.constrained and stats.tokens >= len(plain.token_ids)
        steps, tokens = steps + stats.steps, tokens + stats.tokens
    assert steps < tokens  # drafts were taken under the grammar


def test_speculation_under_a_json_schema_equals_plain_constrained_greedy(real_source):
    tok = real_source.tokenizer
    pipe = _pipeline(real_source)
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
              "required": ["city", "days"]}
    spec = SamplingSpec(SamplingParams(), constraint={"type": "json_schema", "schema": schema})
    ids = tok.apply_chat([{"role": "user", "content": "Weather in Paris for 3 days, as JSON with city and days."}])
    plain = generate(pipe, ids, 40, spec, eos_ids=tuple(tok.eos_ids), tokenizer=tok)
    fast = speculative_generate(pipe, ids, 40, spec, eos_ids=tuple(tok.eos_ids), tokenizer=tok, drafter="lookup")
    assert fast.token_ids == plain.token_ids
    json.loads(plain.text)  # a complete object: the grammar ended the answer


def _call_tokens(tok) -> list[int]:
    return tok.encode('<tool_call>\n{"name": "HassTurnOn", "arguments": {"name": "Kitchen Ceiling Light"}}\n'
                      '</tool_call>', add_bos=False)


def test_forced_text_becomes_draft_tokens_the_grammar_takes(model):
    tok = model.tokenizer
    g = make_constraint(_tools_spec(tok), tok.path, model.config.vocab_size, tuple(tok.eos_ids))
    forced_somewhere = False
    for t in _call_tokens(tok) if "<tool_call>" in (tok.meta.chat_template or "") else tok.encode(
            '{"name": "HassTurnOn", "arguments": {"name": "Kitchen Ceiling Light"}}', add_bos=False):
        g.advance(t)
        draft = g.forced_draft()
        assert g.valid_prefix(draft) == len(draft)
        forced_somewhere |= bool(draft)
    assert forced_somewhere  # a key name once the tool is chosen, the rest of a unique tool name


def test_drafts_are_cut_at_the_first_token_the_grammar_refuses(real_source):
    """Lookup proposes what followed in the prompt; only what the grammar takes is sent."""
    tok = real_source.tokenizer
    spec = _tools_spec(tok)
    vocab, eos = real_source.config.vocab_size, tuple(tok.eos_ids)
    prompt = tok.encode('Example: {"name": "HassTurnOn", "arguments": {"name": "Kitchen Ceiling Light"}} and '
                        '{"name": "HassTurnOn", "bogus": 1}', add_bos=False)
    answer = tok.encode('{"name": "HassTurnOn", "', add_bos=False)
    session = SpeculationSession("lookup", list(prompt), max_candidates=64, fixed=64)
    session.follow_grammar(make_constraint(spec, tok.path, vocab, eos), eos)
    session.extend(answer)  # the answer so far, its last token the next round's root
    tree = session.next_tree()
    assert tree.num_candidates > 0
    check = make_constraint(spec, tok.path, vocab, eos)
    for t in answer:
        check.advance(t)
    for node in range(1, tree.size):  # every path from the root is a sequence the grammar takes
        path = tree.tokens_of(tree.path_to(node))[1:]
        assert check.valid_prefix(path) == len(path)
    drafted = {tuple(tree.tokens_of(tree.path_to(n))[1:]) for n in range(1, tree.size)}
    assert any(tok.decode(list(p)).startswith('arguments') for p in drafted)


def _random_tree(rng: random.Random, tokens: list[int], size: int) -> DraftTree:
    """A drafter's tree: random branches merged into a trie (siblings never share a token)."""
    seqs = [[rng.choice(tokens) for _ in range(rng.randrange(1, 5))] for _ in range(rng.randrange(1, 4))]
    return DraftTree.from_sequences(tokens[0], seqs, max_nodes=size)


def test_a_shaped_verify_round_commits_plain_constrained_decodings_tokens_and_leaves_its_grammar_state(
        real_source):
    """Random trees over the tokens a grammar cares about, random logits: the walk commits what plain
    constrained greedy decoding of the same rows would, and a rejected draft leaves the grammar exactly
    where plain decoding has it (its masks agree afterwards)."""
    tok = real_source.tokenizer
    vocab, eos = real_source.config.vocab_size, tuple(tok.eos_ids)
    spec = SamplingSpec(SamplingParams(), constraint={"type": "regex", "pattern": "(yes|no|maybe)( (yes|no|maybe))*"})
    words = sorted({t for w in ("yes", "no", "maybe", " yes", " no", " maybe", " ", "y", "es") for t in
                    tok.encode(w, add_bos=False)})
    rng = random.Random(0)
    for trial in range(40):
        tree = _random_tree(rng, words, rng.randrange(1, 9))
        logits = torch.randn(tree.size, vocab)
        for i in range(tree.size):  # make the drafted tokens likely, so some are accepted
            kids = [k for k in range(1, tree.size) if tree.parents[k] == i]
            for k in kids[:1]:
                logits[i, tree.tokens[k]] += 30.0
        sel = TokenSelector.for_spec(spec, tokenizer=tok, vocab_size=vocab)
        verdict = verify_shaped(tree, logits, sel, lambda t: t in sel.eos_ids or sel.finished)
        ref = TokenSelector.for_spec(spec, tokenizer=tok, vocab_size=vocab)
        node, expect = 0, []
        while True:  # plain decoding, one row at a time, following the tree while it agrees
            t = ref(logits[node])
            expect.append(t)
            nxt = next((k for k in range(1, tree.size) if tree.parents[k] == node and tree.tokens[k] == t), None)
            if nxt is None or t in eos or ref.finished:
                break
            node = nxt
        assert verdict.committed(tree) == expect, trial
        assert torch.equal(sel.constraint.allowed_mask(), ref.constraint.allowed_mask())


def test_sampled_verification_under_a_grammar_keeps_the_masked_distribution(real_source):
    """Two candidates at the root, temperature 1: the first committed token follows softmax(masked row)."""
    tok = real_source.tokenizer
    vocab = real_source.config.vocab_size
    spec = {"type": "regex", "pattern": "(yes|no|maybe)"}
    allowed = TokenSelector.for_spec(SamplingSpec(SamplingParams(), constraint=spec), tokenizer=tok,
                                     vocab_size=vocab).constraint.allowed_mask()
    ids = allowed.nonzero().flatten().tolist()
    g = torch.Generator().manual_seed(1)
    row = torch.randn(vocab, generator=g) * 0.5
    row[ids[:4]] += 2.0
    masked = torch.softmax(row.masked_fill(~allowed, float("-inf")), -1)
    tree = DraftTree.from_sequences(ids[0], [[ids[1]], [ids[2]]])
    logits = torch.stack([row, row, row])
    counts = torch.zeros(vocab)
    for seed in range(3000):
        sel = TokenSelector.for_spec(SamplingSpec(SamplingParams(temperature=1.0, seed=seed), constraint=spec),
                                     tokenizer=tok, vocab_size=vocab)
        first = verify_shaped(tree, logits, sel, lambda t: t in sel.eos_ids or sel.finished).committed(tree)[0]
        counts[first] += 1
    assert counts[~allowed].sum() == 0
    assert chi2_p_value([int(counts[i]) for i in ids], [float(masked[i]) for i in ids]) > 0.01
