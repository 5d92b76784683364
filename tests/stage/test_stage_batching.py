"""A stage runs the work queued for several sequences in one forward, and nobody can tell.

Concurrent requests (plain, seeded sampling, speculative, a hang-up among them)
through stage services that batch give exactly the tokens each request gets
alone, the stats show that passes really held several sequences, and one bad
message in a batch fails only its own request.
"""

import asyncio

import pytest
import torch

from decoding.generate import generate
from decoding.loader import open_model
from decoding.pipeline_local import LocalPipeline
from decoding.sampling import SamplingParams, SamplingSpec
from decoding.speculative.session import SpeculationSession
from tests.support.coordinator import generate_on
from tests.support.inprocess import Mesh
from tests.support.waiting import eventually
from meshd.pipeline.coordinator.slot import StepsRequest
from transport.stage_messages import StageForward


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    return open_model(tiny_llama[0])


def _batched_passes(svc) -> int:
    return sum(v for k, v in svc.stats.batches.items() if k > 1)


async def test_eight_concurrent_requests_are_batched_and_each_equals_its_reference(tiny):
    prompts = [list(range(5 + 7 * i, 25 + 9 * i)) for i in range(8)]
    sampled = SamplingParams(temperature=0.9, top_k=30, top_p=0.9, seed=11)
    params = [sampled if i % 3 == 2 else SamplingParams() for i in range(8)]
    refs = [generate(LocalPipeline.from_source(tiny, 1), p, 24, sp).token_ids for p, sp in zip(prompts, params)]
    async with Mesh(tiny, 2) as mesh:
        got = await asyncio.gather(*(mesh.run(p, 24, sp, rid=f"r{i}", chunks=2)
                                     for i, (p, sp) in enumerate(zip(prompts, params))))
        assert await eventually(lambda: all(svc.sequences() == [] for svc in mesh.services))
        assert all(_batched_passes(svc) > 0 for svc in mesh.services), [s.stats.batches for s in mesh.services]
    assert got == refs


async def test_unbatched_stages_still_serve_one_message_per_pass(tiny):
    prompts = [list(range(5, 25)), list(range(40, 70))]
    refs = [generate(LocalPipeline.from_source(tiny, 1), p, 12).token_ids for p in prompts]
    async with Mesh(tiny, 2, max_batch_tokens=0) as mesh:
        got = await asyncio.gather(*(mesh.run(p, 12, rid=f"r{i}") for i, p in enumerate(prompts)))
        assert all(set(svc.stats.batches) == {1} for svc in mesh.services)
    assert got == refs


async def test_speculative_and_plain_requests_share_passes_losslessly(tiny):
    prompt = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]
    ref = generate(LocalPipeline.from_source(tiny, 1), prompt, 20).token_ids
    others = [list(range(30 + i, 50 + i)) for i in range(3)]
    other_refs = [generate(LocalPipeline.from_source(tiny, 1), p, 20).token_ids for p in others]
    async with Mesh(tiny, 2) as mesh:
        spec = SpeculationSession("lookup", list(prompt), cost=mesh.coord.round_cost)
        got = await asyncio.gather(
            _collect(mesh.coord.steps(StepsRequest("spec", prompt, 20, SamplingSpec(), speculation=spec))),
            *(mesh.run(p, 20, rid=f"p{i}") for i, p in enumerate(others)))
    assert [s.token for s in got[0]] == ref
    assert got[1:] == other_refs


async def test_a_client_hanging_up_mid_batch_frees_only_its_sequence(tiny):
    prompts = [list(range(5, 45)), list(range(50, 90)), list(range(100, 140))]
    refs = [generate(LocalPipeline.from_source(tiny, 1), p, 40).token_ids for p in prompts]
    async with Mesh(tiny, 2) as mesh:
        got_any = asyncio.Event()

        async def victim_run():  # runs until cancelled: it would take 440 tokens to end by itself
            async for _ in generate_on(mesh.coord, "victim", list(range(150, 210)), 440, SamplingSpec()):
                got_any.set()

        victim = asyncio.create_task(victim_run())
        survivors = asyncio.gather(*(mesh.run(p, 40, rid=f"r{i}", chunks=2) for i, p in enumerate(prompts)))
        assert await eventually(lambda: got_any.is_set() and any(_batched_passes(s) for s in mesh.services),
                                timeout_s=60)
        victim.cancel()
        got = await survivors
        with pytest.raises(asyncio.CancelledError):
            await victim
        assert await eventually(lambda: all(svc.kv_tokens_in_use() == 0 for svc in mesh.services), timeout_s=10)
    assert got == refs


async def test_a_malformed_message_in_a_batch_fails_alone(tiny):
    async with Mesh(tiny, 2) as mesh:
        first = mesh.services[0]
        good = StageForward(request_id="g", plan_version=mesh.route.plan_version, seq_id="coord:good",
                            position_offset=0, chunk_index=0, token_ids=torch.tensor([5, 6, 7]),
                            is_last_chunk=False, reply_to=mesh.coord.reply_to, capacity=16)
        bad = StageForward(request_id="b", plan_version=mesh.route.plan_version, seq_id="coord:bad",
                           position_offset=0, chunk_index=0, token_ids=torch.tensor([5, 10 ** 6]),
                           is_last_chunk=False, reply_to=mesh.coord.reply_to, capacity=16)
        replies = await first.step([good, bad])
        assert type(replies[0]).__name__ == "Ack"
        assert replies[1].code == "bad_input"
        assert "coord:good" in first.kv and "coord:bad" not in first.kv
        assert first.kv.length("coord:good") == 3


async def test_a_second_message_for_a_sequence_waits_for_the_next_pass(tiny):
    async with Mesh(tiny, 1) as mesh:
        svc = mesh.services[0]
        common = dict(request_id="x", plan_version=mesh.route.plan_version, seq_id="coord:x",
                      reply_to="", capacity=32, chunk_index=0)
        a = StageForward(position_offset=0, token_ids=torch.tensor([5, 6, 7]), is_last_chunk=False, **common)
        b = StageForward(position_offset=3, token_ids=torch.tensor([8, 9]), is_last_chunk=False, **common)
        replies = await svc.step([a, b])
        assert [type(r).__name__ for r in replies] == ["Ack", "Ack"]
        assert svc.kv.length("coord:x") == 5
        assert svc.stats.batches == {1: 2}


async def _collect(agen):
    return [x async for x in agen]
