"""Requests start on the prefix every stage holds of them: same tokens as without, less prefill, never stale."""

from __future__ import annotations

import asyncio

import pytest

from decoding.generate import generate
from decoding.loader import open_model
from decoding.pipeline_local import LocalPipeline
from decoding.sampling import SamplingSpec
from decoding.speculative.session import SpeculationSession
from meshd.pipeline.route import Route, StageEndpoint
from meshd.pipeline.coordinator.slot import StepsRequest
from tests.support.inprocess import Mesh
from tests.support.waiting import eventually

def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


SYSTEM = [(7 * i + 3) % 200 + 2 for i in range(180)]  # a long shared "system prompt"


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    return open_model(tiny_llama[0])


async def steps(mesh, prompt, n=12, rid="r", speculation=None, chunks=None):
    """(tokens, the prompt positions the request reused)."""
    out, cached = [], None
    async for s in mesh.coord.steps(StepsRequest(rid, prompt, n, SamplingSpec(), speculation=speculation,
                                                 chunks=chunks)):
        out.append(s.token)
        cached = s.cached if cached is None else cached
    return out, cached


def conversation(turn_answers: list[list[int]], user_turns: list[list[int]]) -> list[list[int]]:
    """Each turn's prompt: the system prompt, every earlier user turn and answer, then this user turn."""
    prompts, history = [], list(SYSTEM)
    for user, answer in zip(user_turns, turn_answers + [[]]):
        prompts.append(history + user)
        history = history + user + answer
    return prompts


async def test_a_multi_turn_conversation_gives_the_same_tokens_with_the_cache_and_reuses_each_turn(tiny):
    users = [[11, 12, 13], [21, 22], [31, 32, 33, 34]]
    answers, prompts = [], []
    async with Mesh(tiny, 2, prefix_share=0.0) as off, Mesh(tiny, 2) as on:
        for t in range(len(users)):
            prompt = conversation(answers, users[: t + 1])[t]
            want, none_cached = await steps(off, prompt, rid=f"off{t}")
            got, cached = await steps(on, prompt, rid=f"on{t}")
            assert got == want and none_cached == 0
            ref = generate(LocalPipeline.from_source(tiny, 1), prompt, 12).token_ids
            assert got == ref
            # turn 1 reuses nothing; later turns reuse the previous prompt and its answer (all but the last
            # answer token, which was never fed back)
            assert cached == (0 if t == 0 else len(prompts[-1]) + len(answers[-1]) - 1)
            answers.append(got)
            prompts.append(prompt)
        assert on.coord.prefixes.totals.hits == 2
        assert all(svc.scheduler.prefix.stats.reused_tokens > 0 for svc in on.services)


async def test_a_prefix_evicted_between_probe_and_use_falls_back_to_a_full_prefill(tiny, monkeypatch):
    prompt_a, prompt_b = SYSTEM + [5, 6], SYSTEM + [8, 9, 10]
    ref = generate(LocalPipeline.from_source(tiny, 1), prompt_b, 12).token_ids
    async with Mesh(tiny, 2) as mesh:
        await steps(mesh, prompt_a, rid="a")
        last = mesh.services[1].scheduler.prefix
        monkeypatch.setattr(last, "holder", lambda ids: None)  # evicted just after answering the probe
        got, cached = await steps(mesh, prompt_b, rid="b")
        assert got == ref and cached == 0
        assert mesh.coord.prefixes.totals.misses == 1
        assert await eventually(lambda: all(svc.sequences() == [] for svc in mesh.services))


async def test_two_requests_with_one_system_prompt_at_once_compute_it_once(tiny):
    prompts = [SYSTEM + [40, 41], SYSTEM + [50, 51, 52]]
    refs = [generate(LocalPipeline.from_source(tiny, 1), p, 12).token_ids for p in prompts]
    async with Mesh(tiny, 2) as mesh:
        (a, ca), (b, cb) = await asyncio.gather(steps(mesh, prompts[0], rid="a"), steps(mesh, prompts[1], rid="b"))
        assert [a, b] == refs
        assert sorted([ca, cb]) == [0, len(SYSTEM)]  # the second forked from the first's computed prompt
        assert mesh.coord.prefixes.totals.waits == 1
        first = mesh.services[0]
        assert first.stats.tokens < 2 * len(SYSTEM)  # the system prompt went through the stage once


async def test_a_re_plan_that_moves_layers_never_lets_a_request_read_the_old_kv(tiny):
    prompt = SYSTEM + [60, 61]
    ref = generate(LocalPipeline.from_source(tiny, 1), prompt, 12).token_ids
    async with Mesh(tiny, 3) as mesh:
        assert (await steps(mesh, prompt, rid="a"))[1] == 0
        await mesh.drop_middle()  # plan 2: two stages, new layer ranges
        got, cached = await steps(mesh, prompt, rid="b")
        assert got == ref and cached == 0
        assert all(svc.scheduler.prefix.status()["entries"] <= 1 for svc in (mesh.services[0], mesh.services[2]))


async def test_a_re_plan_that_keeps_every_stage_as_it_was_keeps_the_cache(tiny):
    prompt = SYSTEM + [70, 71]
    ref = generate(LocalPipeline.from_source(tiny, 1), prompt, 12).token_ids
    async with Mesh(tiny, 2) as mesh:
        await steps(mesh, prompt, rid="a")
        assert await eventually(lambda: all(svc.scheduler.prefix.status()["entries"] == 1 for svc in mesh.services))
        same = Route(2, tuple(StageEndpoint(s.node_id, s.address, "", *s.layers) for s in mesh.route.stages))
        mesh.coord.set_route(None)
        for svc in mesh.services:
            await svc.deploy(same)
        mesh.coord.set_route(same)
        got, cached = await steps(mesh, prompt, rid="b")
        assert got == ref and cached == len(prompt) - 1


async def test_speculative_rounds_on_a_cached_prefix_give_plain_greedy_tokens(tiny):
    prompts = [SYSTEM + [80, 81, 82], SYSTEM + [80, 81, 90]]
    async with Mesh(tiny, 2) as mesh:
        for i, prompt in enumerate(prompts):
            ref = generate(LocalPipeline.from_source(tiny, 1), prompt, 24).token_ids
            session = SpeculationSession("lookup", list(prompt), cost=mesh.coord.round_cost, fixed=3)
            got, cached = await steps(mesh, prompt, 24, rid=f"s{i}", speculation=session)
            assert got == ref
            assert (cached > 0) == (i == 1)


async def test_a_client_hanging_up_mid_prefill_leaves_no_entry_behind(tiny):
    long_prompt = SYSTEM * 2 + SYSTEM[:100]
    async with Mesh(tiny, 2) as mesh:
        task = asyncio.create_task(steps(mesh, long_prompt, rid="gone", chunks=23))
        assert await eventually(lambda: mesh.services[0].stats.tokens > 0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await eventually(lambda: all(svc.sequences() == [] and svc.kv.reserved_tokens == 0
                                            for svc in mesh.services))
        assert all(svc.scheduler.prefix.status()["entries"] == 0 for svc in mesh.services)


@pytest.fixture(scope="module")
def tiny_long(tmp_path_factory):
    """A two-layer tiny model with room for 2,000-token prompts (one layer per stage: the test is the cache's
    bookkeeping under pressure, not the model)."""
    from tests.support.models import build_tiny_checkpoint

    path = tmp_path_factory.mktemp("tiny-long")
    build_tiny_checkpoint(path, "llama", max_position_embeddings=2304, num_hidden_layers=2)
    return open_model(path)


async def test_hundreds_of_distinct_2000_token_prompts_stay_within_every_stages_budget_and_keep_serving(tiny_long):
    """Through real stages and a coordinator (the 1,000-prompt run of the same bookkeeping is
    tests/stage/test_prefix_cache.py's, without the forwards)."""
    budget = 12_000
    async with Mesh(tiny_long, 2, max_kv_tokens=budget) as mesh:
        for i in range(300):
            if i == 50:
                rss_at_50 = rss_mb()
            prompt = [2 + i % 200, 2 + (i // 200) % 200] + [(i * 13 + k) % 200 + 2 for k in range(1998)]
            got, cached = await steps(mesh, prompt, 1, rid=f"p{i}", chunks=1)
            assert len(got) == 1 and cached == 0
            for svc in mesh.services:
                assert svc.kv.reserved_tokens <= budget
                assert svc.scheduler.prefix.held_tokens() <= budget // 2
        # what 300 leaked entries would hold: 300 MB; the cache's share of both budgets: 3 MB
        assert rss_mb() - rss_at_50 < 48
        for svc in mesh.services:
            status = svc.scheduler.prefix.status()
            assert status["evictions"] >= 290 and status["entries"] <= 3
        assert await eventually(lambda: all(svc.sequences() == [] for svc in mesh.services))


async def test_a_request_that_announces_its_prefill_again_releases_whoever_waited_on_the_first():
    """A replay (or a drafter's retry) announces anew; a later request sharing the prompt must not
    wait on the first announcement for ever (the sibling wait has no clock of its own)."""
    from meshd.pipeline.coordinator.prefix_reuse import MIN_SHARED, PrefixReuse

    reuse = PrefixReuse(links=None)
    prompt = list(range(MIN_SHARED + 10))
    first = reuse.prefilling("a", prompt)
    reuse.prefilling("b", prompt)
    waiting = asyncio.create_task(reuse.after_siblings("b", prompt, 0))
    await asyncio.sleep(0)  # sleep-ok: one turn of the loop, so the waiter is waiting
    assert not waiting.done()
    reuse.prefilling("a", prompt)  # "a" replays
    assert first.is_set()
    async with asyncio.timeout(5):
        assert await waiting is True
