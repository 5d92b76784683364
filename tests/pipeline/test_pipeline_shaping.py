"""Structured output and repetition penalties through the mesh equal the single-device engine.

The last stage shapes each position's logits exactly as the local engine does
(penalties, then the grammar mask, then the seeded sampler), so the same
request gives the same tokens on one device and across stages — and after a
device leaves mid-answer, the replayed last stage rebuilds the grammar and the
penalty counts from the tokens already generated.
"""

import json

import pytest

from decoding.penalties import Penalties
from decoding.sampling import SamplingParams, SamplingSpec
from meshd.engine.base import GenerationRequest
from meshd.engine.options import RequestOptions
from meshd.engine.local import LocalEngine
from meshd.pipeline.coordinator.slot import StepsRequest
from tests.support.inprocess import Mesh

pytestmark = pytest.mark.slow

SCHEMA = {"type": "json_schema", "schema": {
    "type": "object", "properties": {"room": {"type": "string"}, "on": {"type": "boolean"}},
    "required": ["room", "on"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def local(real_source):
    return LocalEngine(real_source)


async def _local_tokens(engine, ids, max_tokens, sampling, constraint=None, penalties=Penalties()):
    req = GenerationRequest("ref", list(ids), max_tokens,
                            options=RequestOptions(sampling=SamplingSpec(sampling, penalties, constraint)))
    return [t async for t in engine.token_ids(req)]


async def _mesh_tokens(mesh, ids, max_tokens, sampling, eos, rid, constraint=None, penalties=Penalties()):
    spec = SamplingSpec(sampling, penalties, constraint)
    return [s.token async for s in mesh.coord.steps(StepsRequest(rid, ids, max_tokens, spec, eos))]


async def test_schema_constrained_answers_match_the_local_engine_and_parse(real_source, local):
    tok = real_source.tokenizer
    ids = tok.apply_chat([{"role": "user", "content": "Turn on the kitchen light. Answer in JSON."}])
    eos = tuple(tok.eos_ids)
    async with Mesh(real_source, 2) as mesh:
        for seed in (1, 2, 3):
            p = SamplingParams(temperature=1.0, seed=seed)
            ref = await _local_tokens(local, ids, 48, p, SCHEMA)
            got = await _mesh_tokens(mesh, ids, 48, p, eos, f"s{seed}", SCHEMA)
            assert got == ref
            if got[-1] in eos:  # finished inside the budget: it must be a valid object
                obj = json.loads(tok.decode([t for t in got if t not in eos]))
                assert set(obj) == {"room", "on"}
        assert mesh.coord.prefixes.totals.hits == 2  # seeds 2 and 3 started on the cached prompt


async def test_tool_calls_through_the_mesh_match_the_local_engine_and_parse(real_source, local):
    """The tool grammar runs where the last stage samples: same tokens as one device, calls that parse."""
    from decoding.tool_grammar import tool_spec
    from meshd.api.tools import parse_tool_calls

    tools = [{"type": "function", "function": {"name": "HassTurnOn", "parameters": {
        "type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}}}]
    tok = real_source.tokenizer
    ids = tok.encode('Call tools as {"name": "HassTurnOn", "arguments": {"name": "..."}}.\nUser: turn on the '
                     'kitchen light\nAssistant: ')
    eos = tuple(tok.eos_ids)
    async with Mesh(real_source, 2) as mesh:
        for seed, required in ((1, True), (2, False), (3, False)):
            spec = tool_spec(tools, "hermes", required=required, parallel=False)
            p = SamplingParams(temperature=1.0, seed=seed)
            ref = await _local_tokens(local, ids, 48, p, spec)
            got = await _mesh_tokens(mesh, ids, 48, p, eos, f"t{seed}", spec)
            assert got == ref
            if got[-1] in eos:
                text = tok.decode([t for t in got if t not in eos])
                calls = parse_tool_calls(text, ["HassTurnOn"])[1]
                assert calls or not required, text
                assert all(c.name == "HassTurnOn" and isinstance(c.arguments["name"], str) for c in calls)


async def test_penalties_through_the_mesh_match_the_local_engine(real_source, local):
    tok = real_source.tokenizer
    ids = tok.apply_chat([{"role": "user", "content": "List fruits: apple, apple, apple, apple"}])
    pen = Penalties(presence=0.5, frequency=0.4, repeat=1.3, repeat_last_n=16)
    async with Mesh(real_source, 2) as mesh:
        ref = await _local_tokens(local, ids, 24, SamplingParams(), penalties=pen)
        plain = await _local_tokens(local, ids, 24, SamplingParams())
        got = await _mesh_tokens(mesh, ids, 24, SamplingParams(), tuple(tok.eos_ids), "pen", penalties=pen)
    assert got == ref and ref != plain  # the penalties did something, the same thing in both places


async def test_a_constrained_answer_survives_a_device_leaving_mid_answer(real_source, local):
    tok = real_source.tokenizer
    ids = tok.apply_chat([{"role": "user", "content": "Which room? Answer in JSON."}])
    eos = tuple(tok.eos_ids)
    p = SamplingParams(temperature=0.9, seed=5)
    ref = await _local_tokens(local, ids, 40, p, SCHEMA)
    async with Mesh(real_source, 3) as mesh:
        got = []
        async for step in mesh.coord.steps(StepsRequest("r", ids, 40, SamplingSpec(p, constraint=SCHEMA), eos)):
            got.append(step.token)
            if len(got) == 4:
                await mesh.drop_middle()  # dev1 leaves; the mesh re-plans over dev0 and dev2
        assert got == ref and mesh.coord.resumes == 1
