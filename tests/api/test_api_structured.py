"""Structured output: answers constrained by a JSON schema always parse and validate.

The real embedded SmolLM2 (a model that does not reliably write JSON on its
own) answers through ``LocalEngine`` with llguidance's token mask; sampling
at temperature 1 with several seeds shows the guarantee holds whatever the
sampler picks. Engines without ``capabilities.constraints`` (today the pipeline
engine) refuse with a 400 instead of ignoring the request.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import ollama
import openai
import pytest
import torch

from decoding.constrained import BadConstraint, TokenConstraint, validate_spec
from tests.support.local_engines import local_engine
from tests.support.api import FakeEngine, ServerThread

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 3}},
    "required": ["name", "age", "pets"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Describe a person called Ann who has a cat, as JSON."}]


def sdk(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://localhost/v1", api_key="unused", max_retries=0, timeout=600,
                         http_client=httpx.Client(transport=httpx.HTTPTransport(uds=str(srv.socket_path))))


@pytest.fixture(scope="module")
def smol():
    with ServerThread(local_engine(None)) as srv:
        yield srv


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_json_schema_answers_always_parse_and_validate(smol, seed):
    r = sdk(smol).chat.completions.create(
        model="meshd", messages=ASK, temperature=1.0, seed=seed, max_tokens=200,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}})
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)


@pytest.mark.slow
def test_json_object_answers_are_objects_also_when_streamed(smol):
    """(The frequency penalty keeps the 135M model from repeating one key until max_tokens.)"""
    chunks = list(sdk(smol).chat.completions.create(
        model="meshd", messages=ASK, temperature=0, max_tokens=400, stream=True, frequency_penalty=1.0,
        response_format={"type": "json_object"}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "stop", text  # only a cut-off answer may not parse
    assert isinstance(json.loads(text), dict)


@pytest.mark.slow
def test_ollama_format_takes_a_schema_or_json(smol):
    c = ollama.Client(host="http://localhost", transport=httpx.HTTPTransport(uds=str(smol.socket_path)))
    r = c.chat(model="meshd", messages=ASK, format=SCHEMA, options={"seed": 4, "num_predict": 300})
    assert r.done_reason == "stop", r.message.content
    jsonschema.validate(json.loads(r.message.content), SCHEMA)
    g = c.generate(model="meshd", prompt="List two colours as JSON.", format="json",
                   options={"temperature": 0, "num_predict": 300, "repeat_penalty": 1.3})
    assert g.done_reason == "stop", g.response  # only a cut-off answer may not parse
    assert isinstance(json.loads(g.response), dict)


@pytest.mark.slow
def test_a_bad_schema_is_a_400_before_any_generation(smol):
    with pytest.raises(openai.BadRequestError) as info:
        sdk(smol).chat.completions.create(model="meshd", messages=ASK, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}})
    assert info.value.body["param"] == "response_format.json_schema.schema"
    assert info.value.body["code"] == "invalid_schema"


def test_engines_that_cannot_constrain_refuse_instead_of_ignoring():
    with ServerThread(FakeEngine()) as srv:
        with pytest.raises(openai.BadRequestError) as info:
            sdk(srv).chat.completions.create(model="meshd", messages=ASK, response_format={"type": "json_object"})
        assert "structured output is not supported" in info.value.body["message"]
        assert info.value.body["param"] == "response_format"


def test_the_constraint_masks_rolls_back_and_finishes(real_source):
    tok = real_source.tokenizer
    vocab = real_source.config.vocab_size
    c = TokenConstraint({"type": "json_schema", "schema": {"type": "object", "properties": {
        "a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}},
        tok.path, vocab, tuple(tok.eos_ids))
    first = c.allowed_mask(vocab)
    assert first.dtype == torch.bool and first.shape == (vocab,) and 0 < int(first.sum()) < vocab
    ids = tok.encode('{"a": 7}')
    for t in ids:
        assert c.allowed_mask(vocab)[t]
        c.advance(t)
    assert c.is_accepting() and c.allowed_mask(vocab)[tok.eos_ids[0]]
    c.rollback(len(ids))
    assert torch.equal(c.allowed_mask(vocab), first)
    logits = torch.zeros(vocab)
    assert torch.isinf(c.apply(logits)[~first]).all()


@pytest.mark.parametrize("spec", [
    {"type": "json_schema", "schema": {"type": "objectx"}},
    {"type": "regex", "pattern": "(("},
    {"type": "lark", "grammar": "start: nope"},
    {"type": "json_schema"},
    {"type": "xml"},
    "json",
])
def test_bad_specs_are_refused_cheaply(spec):
    with pytest.raises(BadConstraint):
        validate_spec(spec)
