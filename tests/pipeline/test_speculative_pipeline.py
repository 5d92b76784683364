"""Speculative decoding through the mesh: verify rounds cross every stage once, rollback rides along.

The coordinator drafts (prompt lookup, a draft model) or receives Medusa
proposals from the last stage; each round's tree goes through all stages in
one forward; the last stage accepts; the accepted path reaches every stage in
the next round's header. Output must equal plain greedy decoding, for every
drafter and stage count, and every cache must be empty afterwards.
"""

import asyncio

import pytest
import torch

from decoding.errors import DrafterError
from decoding.generate import generate
from decoding.loader import open_model
from decoding.pipeline_local import LocalPipeline
from decoding.sampling import SamplingParams, SamplingSpec
from decoding.speculative.adaptive import RoundCost
from decoding.speculative.draft_model import ModelDrafter
from decoding.speculative.generate import MedusaSource
from decoding.speculative.session import SpeculationSession
from tests.support.inprocess import Mesh
from tests.support.waiting import eventually
from tests.support.speculative import PROMPTS, MirrorHeads
from transport.messages import ErrorReply
from meshd.pipeline.coordinator.slot import StepsRequest
from transport.stage_messages import StageForward


def mirror_medusa(stage):
    return MedusaSource(MirrorHeads(), stage.lm_head)


def no_heads(stage):
    raise DrafterError("heads file /nowhere/heads.pt is missing")


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    return open_model(tiny_llama[0])


async def _run(mesh, prompt, max_tokens, session, sampling=SamplingParams(), rid="r", eos=()):
    return [s.token async for s in mesh.coord.steps(StepsRequest(rid, prompt, max_tokens, SamplingSpec(sampling), eos,
                                                    speculation=session))]


def _session(mesh, drafter, prompt, source=None, fixed=None):
    md = ModelDrafter(LocalPipeline.from_source(source, 1)) if drafter == "draft_model" else None
    return SpeculationSession(drafter, list(prompt), cost=mesh.coord.round_cost, model_drafter=md, fixed=fixed)


@pytest.mark.parametrize("stages", [1, 2, 3])
@pytest.mark.parametrize("drafter", ["lookup", "medusa", "auto", "draft_model"])
async def test_greedy_speculation_through_the_mesh_equals_plain_greedy(tiny, stages, drafter):
    async with Mesh(tiny, stages, medusa=mirror_medusa) as mesh:
        for i, prompt in enumerate(PROMPTS):
            ref = generate(LocalPipeline.from_source(tiny, 1), prompt, 40).token_ids
            session = _session(mesh, drafter, prompt, tiny)
            assert await _run(mesh, prompt, 40, session, rid=f"r{i}") == ref
        assert await eventually(lambda: all(svc.kv_tokens_in_use() == 0 for svc in mesh.services))


async def test_rounds_that_always_carry_candidates_roll_back_in_every_stage(tiny):
    """A draft model that is the target itself: every candidate accepted, every path kept."""
    async with Mesh(tiny, 3, medusa=mirror_medusa) as mesh:
        for fixed in (1, 5, 16):
            prompt = PROMPTS[0]
            ref = generate(LocalPipeline.from_source(tiny, 1), prompt, 40).token_ids
            s = _session(mesh, "draft_model", prompt, tiny, fixed=fixed)
            assert await _run(mesh, prompt, 40, s, rid=f"f{fixed}") == ref
            assert s.stats().accepted == s.stats().drafted > 0
            # it drafted each next round while the previous one was verified, and that draft was used
            assert s.model_drafter.ahead_hits > 0
            s2 = _session(mesh, "medusa", prompt, fixed=fixed)  # poor drafts: most rolled back
            assert await _run(mesh, prompt, 40, s2, rid=f"m{fixed}") == ref
            assert s2.stats().rounds > 0


async def test_seeded_sampling_with_speculation_equals_plain_seeded_sampling(tiny):
    p = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=7)
    prompt = PROMPTS[1]
    ref = generate(LocalPipeline.from_source(tiny, 1), prompt, 30, p).token_ids
    async with Mesh(tiny, 2, medusa=mirror_medusa) as mesh:
        assert await _run(mesh, prompt, 30, _session(mesh, "auto", prompt), p) == ref


async def test_missing_heads_fall_back_to_plain_decoding_with_a_reason(tiny):
    prompt = PROMPTS[0]
    ref = generate(LocalPipeline.from_source(tiny, 1), prompt, 24).token_ids
    async with Mesh(tiny, 2, medusa=no_heads) as mesh:
        s = _session(mesh, "medusa", prompt)
        assert await _run(mesh, prompt, 24, s) == ref
        assert "missing" in s.stats().fallback_reason and not s.uses_medusa


async def test_two_speculative_requests_at_once_each_equal_their_reference(tiny):
    async with Mesh(tiny, 2, medusa=mirror_medusa) as mesh:
        refs = [generate(LocalPipeline.from_source(tiny, 1), p, 32).token_ids for p in PROMPTS]
        got = await asyncio.gather(*(_run(mesh, p, 32, _session(mesh, "auto", p), rid=f"c{i}")
                                     for i, p in enumerate(PROMPTS)))
        assert got == refs
        assert await eventually(lambda: all(svc.kv_tokens_in_use() == 0 for svc in mesh.services))


@pytest.mark.parametrize("bad", [
    dict(tree_parents=[0, 0]),  # the root must have no parent
    dict(tree_parents=[-1, 5]),  # parents must come first
    dict(token_ids=torch.arange(70)),  # more nodes than any tree may have
    dict(commit_start=3, commit_keep=[0, 99]),  # keeps nodes that were never written
])
async def test_a_malformed_verify_round_is_refused_and_the_stage_keeps_serving(tiny, bad):
    async with Mesh(tiny, 1) as mesh:
        svc = mesh.services[0]
        await _run(mesh, PROMPTS[0], 4, None, rid="warm")
        base = dict(request_id="evil", plan_version=mesh.version, seq_id="coord/1/999", position_offset=0,
                    token_ids=torch.tensor([1, 2]), verify=True)
        svc.kv.create("coord/1/999", 16)
        reply = await svc.handle(StageForward(**{**base, **bad}), None)
        assert isinstance(reply, ErrorReply) and reply.code in ("bad_input", "position_mismatch")
        assert "coord/1/999" not in svc.kv  # the failed sequence is freed
        ref = generate(LocalPipeline.from_source(tiny, 1), PROMPTS[1], 16).token_ids
        assert await _run(mesh, PROMPTS[1], 16, _session(mesh, "lookup", PROMPTS[1]), rid="after") == ref


async def test_the_mesh_learns_what_a_verify_round_costs(tiny):
    async with Mesh(tiny, 2) as mesh:
        mesh.coord.round_cost = RoundCost(slope=0.5)
        s = _session(mesh, "draft_model", PROMPTS[0], tiny)
        s.cost = mesh.coord.round_cost
        await _run(mesh, PROMPTS[0], 40, s)
        assert s.stats().rounds > 0 and mesh.coord.round_cost.mean_seconds()  # every round timed


@pytest.mark.slow
async def test_real_model_answers_are_identical_with_speculation(real_source):
    tok = real_source.tokenizer
    questions = ["List three ways to save energy at home.",
                 "Summarise: 07:00 kitchen light on; 07:05 kitchen light off; 07:30 kitchen light on; "
                 "07:35 kitchen light off; 08:00 front door opened; 08:01 front door closed."]
    async with Mesh(real_source, 2) as mesh:
        for i, q in enumerate(questions):
            ids = tok.apply_chat([{"role": "user", "content": q}])
            ref = generate(LocalPipeline.from_source(real_source, 1), ids, 48, eos_ids=tok.eos_ids).token_ids
            got = await _run(mesh, ids, 48, _session(mesh, "lookup", ids), rid=f"q{i}", eos=tok.eos_ids)
            assert [t for t in got if t not in tok.eos_ids] == ref


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.9, top_k=50, seed=11)])
async def test_a_speculative_answer_survives_a_device_leaving_mid_round(tiny, sampling):
    """The middle device of three leaves after some rounds; the answer replays on two and is unchanged."""

    prompt = PROMPTS[2]
    ref = generate(LocalPipeline.from_source(tiny, 1), prompt, 40, sampling).token_ids
    async with Mesh(tiny, 3, medusa=mirror_medusa) as mesh:
        got = []
        session = _session(mesh, "auto", prompt)
        async for step in mesh.coord.steps(StepsRequest("r", prompt, 40, SamplingSpec(sampling), speculation=session)):
            got.append(step.token)
            if len(got) == 6:
                await mesh.drop_middle()  # dev1 leaves; the mesh re-plans over dev0 and dev2
        assert got == ref
        assert mesh.coord.resumes == 1


# ------------------------------------------------------------------ under a grammar

_LIGHTS = [{"type": "function", "function": {"name": "HassTurnOn", "parameters": {
    "type": "object", "properties": {"name": {"type": "string"}, "area": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "HassTurnOff", "parameters": {
        "type": "object", "properties": {"name": {"type": "string"}, "area": {"type": "string"}}}}}]


def _tool_request(source):
    from decoding.tool_grammar import style_of, tool_spec

    tok = source.tokenizer
    spec = tool_spec(_LIGHTS, style_of(tok.meta.chat_template), required=True, parallel=False)
    ids = tok.apply_chat([{"role": "system", "content": "Devices: Kitchen Ceiling Light (Kitchen), Porch Light."},
                          {"role": "user", "content": "Turn on the kitchen ceiling light"}], tools=_LIGHTS)
    return ids, SamplingSpec(SamplingParams(), constraint=spec)


def _grammar_session(mesh, source, ids):
    from decoding.constrained import make_constraint

    tok = source.tokenizer
    s = SpeculationSession("lookup", list(ids), cost=mesh.coord.round_cost)
    s.follow_grammar(make_constraint(_tool_request(source)[1].constraint, tok.path, source.config.vocab_size,
                                     tuple(tok.eos_ids)), tok.eos_ids)
    return s


@pytest.mark.parametrize("stages", [1, 2])
async def test_speculation_under_a_tool_grammar_through_the_mesh_equals_plain_constrained_decoding(real_source,
                                                                                                    stages):
    """The gguf mode's lazy head (rows over the grammar's tokens, only the walked ones): same tokens as a
    plain constrained decode through the same mesh and as one device, fewer steps, every cache freed."""
    ids, spec = _tool_request(real_source)
    eos = tuple(real_source.tokenizer.eos_ids)
    one = generate(LocalPipeline.from_source(real_source, 1, packed="gguf"), ids, 40, spec, eos_ids=eos,
                   tokenizer=real_source.tokenizer).token_ids
    async with Mesh(real_source, stages, packed="gguf") as mesh:
        plain = [s.token async for s in mesh.coord.steps(StepsRequest("p", ids, 40, spec, eos))]
        session = _grammar_session(mesh, real_source, ids)
        fast = [s.token async for s in mesh.coord.steps(StepsRequest("s", ids, 40, spec, eos, speculation=session))]
        assert plain == fast
        assert [t for t in fast if t not in eos] == one
        stats = session.stats()
        assert stats.constrained and stats.steps < stats.tokens and stats.accepted > 0
        assert await eventually(lambda: all(svc.kv_tokens_in_use() == 0 for svc in mesh.services))


async def test_a_client_hanging_up_mid_verify_leaves_no_grammar_state_or_kv_behind(real_source):
    ids, spec = _tool_request(real_source)
    eos = tuple(real_source.tokenizer.eos_ids)
    async with Mesh(real_source, 2, packed="gguf") as mesh:
        steps = mesh.coord.steps(StepsRequest("h", ids, 40, spec, eos, speculation=_grammar_session(mesh, real_source,
                                                                                                     ids)))
        got = [await steps.__anext__() for _ in range(3)]
        await steps.aclose()  # the client went away while rounds were in flight
        assert len(got) == 3
        assert await eventually(lambda: all(svc.kv_tokens_in_use() == 0 and not svc.sequences()
                                            for svc in mesh.services))
