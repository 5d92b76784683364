"""Tool calls that always parse: the lazy tool grammar, driven adversarially.

The property every test here pins: with tools offered, an answer that starts
like a call (or holds the template's call tag) comes back as calls, each
naming an offered tool with arguments valid against its schema; an answer
that does not is free text, never masked. The samplers are hostile on
purpose: random logits pushed towards braces, fences, tags and end-of-text,
and the real embedded model sampled hot.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from decoding.constrained import BadConstraint, ConstraintViolated, grammar_tokenizer, make_constraint, validate_spec
from decoding.tool_grammar import CALL_START, HERMES_OPEN, INLINE_CALL, build, style_of, tool_spec
from meshd.api.tools import parse_tool_calls

TOOLS = [
    {"type": "function", "function": {"name": "HassTurnOn", "parameters": {
        "type": "object", "properties": {"name": {"type": "string"}, "area": {"type": "string"},
                                         "domain": {"type": "array", "items": {"type": "string",
                                                                               "enum": ["light", "switch"]}}}}}},
    {"type": "function", "function": {"name": "HassSetVolume", "parameters": {
        "type": "object", "properties": {"name": {"type": "string"},
                                         "volume_level": {"type": "integer", "minimum": 0, "maximum": 100}},
        "required": ["volume_level"]}}},
    {"type": "function", "function": {"name": "GetLiveContext", "parameters": {"type": "object", "properties": {}}}},
]
OFFERED = [t["function"]["name"] for t in TOOLS]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def vocab(real_source):
    tok = real_source.tokenizer
    return tok, real_source.config.vocab_size


def _valid_args(name: str, args: dict) -> bool:
    """A hand check of the schemas above (the grammar engine is what is under test)."""
    schema = SCHEMAS[name]
    props = schema.get("properties", {})
    if not set(args) <= set(props) or not set(schema.get("required", [])) <= set(args):
        return False
    for k, v in args.items():
        p = props[k]
        if p.get("type") == "string" and not isinstance(v, str):
            return False
        if p.get("type") == "integer" and not (isinstance(v, int) and p["minimum"] <= v <= p["maximum"]):
            return False
        if p.get("type") == "array" and not (isinstance(v, list) and set(v) <= set(p["items"]["enum"])):
            return False
    return True


def assert_well_formed(text: str, calls_expected: bool | None = None) -> None:
    content, calls = parse_tool_calls(text, OFFERED)
    starts_call = bool(CALL_START.match(text)) or HERMES_OPEN in text or bool(INLINE_CALL.search(text))
    assert bool(calls) == starts_call, f"unparsed or stray call in {text!r}"
    for c in calls:
        assert c.name in OFFERED and _valid_args(c.name, c.arguments), (text, c)
    if calls_expected is not None:
        assert bool(calls) == calls_expected, text


def _hostile_logits(n: int, rng: random.Random, boost: list[int]) -> torch.Tensor:
    """Noise with the tokens that break calls (braces, quotes, fences, tags, end) pushed up."""
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    logits = torch.randn(n, generator=g) * 3
    for t in rng.sample(boost, k=min(len(boost), 40)):
        logits[t] += rng.uniform(4, 12)
    return logits


def _boost_ids(tok, n: int) -> list[int]:
    pieces = ["{", "{{", "}", '"', '{"', '"name', "name", '":', "```", "json", "\n", "[", "]", ",", "<",
              "tool", "_call", ">", HERMES_OPEN, "</tool_call>", "Hass", "Turn", "On", "Get", "Live"]
    ids = {i for p in pieces for i in tok.encode(p, add_bos=False)} | set(tok.eos_ids)
    return sorted(i for i in ids if i < n)


@pytest.mark.parametrize("style", ["hermes", "json", "mistral"])
@pytest.mark.parametrize("required", [False, True])
def test_a_hostile_sampler_never_gets_an_unparsed_call_or_a_tool_that_was_not_offered(vocab, style, required):
    tok, n = vocab
    spec = tool_spec(TOOLS, style, required=required, parallel=True)
    eos = tuple(tok.eos_ids)
    rng = random.Random(f"{style}{required}")
    draws = torch.Generator().manual_seed(rng.getrandbits(63))  # the draws too: the same run every time
    boost = _boost_ids(tok, n)
    finished = 0
    for _ in range(12):
        c = make_constraint(spec, tok.path, n, eos)
        out: list[int] = []
        for _ in range(160):
            logits = c.apply(_hostile_logits(n, rng, boost))
            t = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=draws))
            if t in eos or c.is_finished():
                break
            c.advance(t)
            out.append(t)
        else:
            continue  # cut by length: a call may be unfinished, as with max_tokens
        finished += 1
        assert c.is_accepting()
        assert_well_formed(tok.decode(out), calls_expected=True if required else None)
    assert finished >= 4  # the sampler does reach ends


def test_the_real_embedded_model_sampled_hot_only_writes_calls_that_parse(real_source):
    """The embedded model has no tool template; a Hermes-style prompt and grammar still hold."""
    import asyncio

    from decoding.sampling import SamplingParams, SamplingSpec
    from meshd.engine.base import GenerationRequest
    from meshd.engine.local import LocalEngine
    from meshd.engine.options import RequestOptions

    engine = LocalEngine(real_source)
    tok = engine.tokenizer
    prompt = tok.encode("Answer with a tool call like <tool_call>\n{\"name\": \"HassTurnOn\", \"arguments\": "
                        "{\"name\": \"Kitchen light\"}}\n</tool_call> or in words.\nUser: turn on the hall light\n"
                        "Assistant: ")
    spec = tool_spec(TOOLS, "hermes", required=False, parallel=True)

    async def answer(seed: int) -> tuple[str, str]:
        sampling = SamplingSpec(SamplingParams(temperature=1.3, seed=seed), constraint=spec)
        req = GenerationRequest(request_id=f"hot{seed}", prompt_ids=prompt, max_tokens=64,
                                options=RequestOptions(sampling=sampling))
        parts, finish = [], None
        async for ev in engine.stream(req):
            parts.append(ev.text)
            finish = ev.finish_reason or finish
        return "".join(parts), finish

    try:
        for seed in range(6):
            text, finish = asyncio.run(answer(seed))
            if finish == "stop":
                assert_well_formed(text)
            else:  # cut by max_tokens: a call may be unfinished, but nothing may be a stray call
                assert finish == "length"
                calls = parse_tool_calls(text, OFFERED)[1]
                assert all(c.name in OFFERED and _valid_args(c.name, c.arguments) for c in calls), text
    finally:
        engine.close()


@pytest.mark.parametrize("text, phase", [
    ("The kitchen light is on.", "text"),
    ('{"data": {"ok": true}}', "text"),  # a tool result echoed back is words, not a call
    ("```python\nprint(1)\n```", "text"),
    ('{"name": "HassTurnOn", "arguments": {}}', "call"),
    ('{ "name": "HassTurnOn", "arguments": {}}', "call"),
    ('```json\n{"name": "GetLiveContext", "arguments": {}}\n```', "call"),
    ('<tool_call>\n{"name": "GetLiveContext", "arguments": {}}\n</tool_call>', "call"),
    ('Sure.\n<tool_call>\n{"name": "GetLiveContext", "arguments": {}}\n</tool_call>', "call"),
])
def test_text_stays_free_and_calls_are_held_to_the_grammar(vocab, text, phase):
    tok, n = vocab
    c = make_constraint(tool_spec(TOOLS, "hermes", required=False, parallel=True), tok.path, n, tuple(tok.eos_ids))
    for t in tok.encode(text, add_bos=False):
        assert c.allowed_mask()[t], f"{tok.decode([t])!r} refused in {text!r}"
        c.advance(t)
    assert c.phase == phase and c.is_accepting()
    if phase == "text":
        logits = torch.randn(n)
        assert c.apply(logits) is logits  # nothing masked, nothing copied while the model talks


@pytest.mark.parametrize("bad_start", ['{{"name": "HassTurnOn"', '```json\n{{"name"', '{"name": "HassSetTemp',
                                       '<tool_call>\n{"name": "Nope'])
def test_the_ways_small_models_break_calls_are_masked(vocab, bad_start):
    tok, n = vocab
    c = make_constraint(tool_spec(TOOLS, "hermes", required=False, parallel=True), tok.path, n, tuple(tok.eos_ids))
    with pytest.raises(ConstraintViolated):
        for t in tok.encode(bad_start, add_bos=False):
            c.advance(t)


def test_parallel_false_allows_one_call_and_required_allows_no_text(vocab):
    tok, n = vocab
    eos = tuple(tok.eos_ids)
    two = '<tool_call>\n{"name": "GetLiveContext", "arguments": {}}\n</tool_call>\n<tool_call>'
    single = make_constraint(tool_spec(TOOLS, "hermes", required=False, parallel=False), tok.path, n, eos)
    with pytest.raises(ConstraintViolated):
        for t in tok.encode(two, add_bos=False):
            single.advance(t)
    required = make_constraint(tool_spec(TOOLS, "json", required=True, parallel=True), tok.path, n, eos)
    assert required.phase == "call"
    with pytest.raises(ConstraintViolated):
        for t in tok.encode("Hello", add_bos=False):
            required.advance(t)
    named = tool_spec(TOOLS, "hermes", required=False, parallel=True, only="GetLiveContext")
    assert named["required"] and [t["name"] for t in named["tools"]] == ["GetLiveContext"]


def test_rollback_replays_the_phase(vocab):
    tok, n = vocab
    c = make_constraint(tool_spec(TOOLS, "hermes", required=False, parallel=True), tok.path, n, tuple(tok.eos_ids))
    ids = tok.encode('{"name": "GetLiveContext", "arguments": {}}', add_bos=False)
    for t in ids:
        c.advance(t)
    c.rollback(len(ids))
    assert c.phase == "start"
    for t in tok.encode("Hello", add_bos=False):
        c.advance(t)
    assert c.phase == "text"


def test_the_spec_is_checked_and_a_schema_the_engine_cannot_compile_is_a_bad_constraint():
    spec = tool_spec(TOOLS, "hermes", required=False, parallel=True)
    assert validate_spec(spec) is spec
    json.dumps(spec)  # it crosses the wire as plain JSON
    for bad in ({**spec, "style": "xml"}, {**spec, "tools": []}, {**spec, "tools": [{"name": 3}]},
                {**spec, "required": "yes"}):
        with pytest.raises(BadConstraint):
            validate_spec(bad)
    broken = tool_spec([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "pattern": "(unclosed"}}}}}],
        "json", required=False, parallel=True)
    with pytest.raises(BadConstraint):
        validate_spec(broken)


def test_the_call_style_follows_the_chat_template():
    assert style_of("... <tool_call>\n{...}\n</tool_call> ...") == "hermes"
    assert style_of("... [TOOL_CALLS] ...") == "mistral"
    assert style_of(None) == style_of("{{ messages }}") == "json"
    g = build(tool_spec(TOOLS, "hermes", required=True, parallel=True), {"<tool_call>": 7})
    assert g.plain is None and "<[7]>" in g.calls and g.resume is not None


def test_grammar_tokenizer_is_shared_per_model(vocab):
    tok, n = vocab
    assert grammar_tokenizer(tok.path, n, tuple(tok.eos_ids)) is grammar_tokenizer(tok.path, n, tuple(tok.eos_ids))
