"""Plans of several routes: replicas and a pipeline side by side, each request on one, the same tokens."""

from __future__ import annotations

import asyncio

import pytest

from decoding.generate import generate
from decoding.loader import open_model
from decoding.pipeline_local import LocalPipeline
from decoding.sampling import SamplingSpec
from meshd.pipeline.coordinator.slot import StepsRequest
from tests.support.inprocess import Mesh
from tests.support.waiting import eventually

SYSTEM = [(5 * i + 7) % 200 + 2 for i in range(120)]


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    return open_model(tiny_llama[0])


def reference(source, prompt, n):
    return generate(LocalPipeline.from_source(source, 1), prompt, n).token_ids


async def steps(mesh, prompt, n=10, rid="r"):
    out, cached = [], None
    async for s in mesh.coord.steps(StepsRequest(rid, prompt, n, SamplingSpec())):
        out.append(s.token)
        cached = s.cached if cached is None else cached
    return out, cached


async def test_requests_at_once_spread_over_two_replicas_and_each_equals_one_device(tiny):
    prompts = [SYSTEM[: 40 + 7 * k] + [k + 3] for k in range(4)]
    async with Mesh(tiny, 2, groups=[1, 1], prefix_share=0.0) as mesh:
        assert [len(r.stages) for r in mesh.routes] == [1, 1]
        assert all(r.stages[0].layers == (0, tiny.config.num_layers) for r in mesh.routes)
        before = [svc.stats.to_dict() for svc in mesh.services]
        outs = await asyncio.gather(*(steps(mesh, p, rid=f"q{k}") for k, p in enumerate(prompts)))
        after = [svc.stats.to_dict() for svc in mesh.services]
        for (got, _), p in zip(outs, prompts):
            assert got == reference(tiny, p, 10)
        # both replicas computed: the burst was spread, not queued on the first route
        assert all(a != b for a, b in zip(before, after))


async def test_a_conversation_returns_to_the_replica_that_holds_its_prompt(tiny):
    first = SYSTEM + [9, 8, 7]
    async with Mesh(tiny, 2, groups=[1, 1]) as mesh:
        answer, cached = await steps(mesh, first, rid="t1")
        assert cached == 0
        await eventually(lambda: sum(s.scheduler.prefix.status()["entries"] for s in mesh.services) > 0)
        second = first + answer + [5, 6]
        got, cached = await steps(mesh, second, rid="t2")
        assert got == reference(tiny, second, 10)
        assert cached >= len(first) - 1  # it went where its prefix is


async def test_a_replica_and_a_pipeline_group_serve_side_by_side_with_identical_tokens(tiny):
    prompts = [SYSTEM[: 30 + 11 * k] for k in range(3)]
    async with Mesh(tiny, 3, groups=[1, 2], prefix_share=0.0) as mesh:
        assert [len(r.stages) for r in mesh.routes] == [1, 2]
        outs = await asyncio.gather(*(steps(mesh, p, rid=f"m{k}") for k, p in enumerate(prompts)))
        for (got, _), p in zip(outs, prompts):
            assert got == reference(tiny, p, 10)


async def test_a_replica_lost_mid_request_resumes_on_the_other_with_identical_tokens(tiny):
    prompt = SYSTEM[:60]
    want = reference(tiny, prompt, 40)
    async with Mesh(tiny, 2, groups=[1, 1], prefix_share=0.0) as mesh:
        got: list[int] = []

        async def run():
            async for s in mesh.coord.steps(StepsRequest("long", prompt, 40, SamplingSpec())):
                got.append(s.token)

        task = asyncio.create_task(run())
        await eventually(lambda: len(got) >= 5)
        route_of_request = next(r for r in mesh.routes if mesh.coord.route_counts.running(r))
        lost = int(route_of_request.stages[0].node_id.removeprefix("dev"))
        survivor = f"dev{1 - lost}"
        await mesh.replan(2, [survivor], [1], gone=[lost])
        await asyncio.wait_for(task, 120)
        assert got == want
        assert mesh.coord.resumes >= 1


async def test_two_requests_on_two_replicas_both_finish_identically_when_one_replica_is_lost(tiny):
    prompts = [SYSTEM[:70], SYSTEM[10:90]]
    want = [reference(tiny, p, 40) for p in prompts]
    async with Mesh(tiny, 2, groups=[1, 1]) as mesh:
        got: list[list[int]] = [[], []]

        async def run(k):
            async for s in mesh.coord.steps(StepsRequest(f"long{k}", prompts[k], 40, SamplingSpec())):
                got[k].append(s.token)

        for r in mesh.routes:  # both known to serve first: a burst on a busy machine must not find one still probing
            await mesh.coord.table.wait_ready(r)
        tasks = [asyncio.create_task(run(k)) for k in range(2)]
        await eventually(lambda: min(len(g) for g in got) >= 5)
        assert all(mesh.coord.route_counts.running(r) == 1 for r in mesh.routes)
        await mesh.replan(2, ["dev0"], [1], gone=[1])
        await asyncio.wait_for(asyncio.gather(*tasks), 120)
        assert got == want


async def test_speculative_requests_on_replicas_equal_plain_greedy(tiny):
    from decoding.speculative.generate import MedusaSource
    from decoding.speculative.session import SpeculationSession
    from tests.support.speculative import PROMPTS, MirrorHeads

    async with Mesh(tiny, 2, groups=[1, 1], medusa=lambda st: MedusaSource(MirrorHeads(), st.lm_head)) as mesh:
        async def one(i, prompt, drafter):
            session = SpeculationSession(drafter, list(prompt), cost=mesh.coord.round_cost)
            return [s.token async for s in mesh.coord.steps(
                StepsRequest(f"s{i}", prompt, 30, SamplingSpec(), speculation=session))]
        outs = await asyncio.gather(*(one(i, p, d) for i, (p, d) in
                                      enumerate(zip(PROMPTS[:2], ["lookup", "medusa"]))))
        for out, prompt in zip(outs, PROMPTS[:2]):
            assert out == reference(tiny, prompt, 30)
        assert await eventually(lambda: all(svc.kv_tokens_in_use() == 0 for svc in mesh.services))


async def test_children_of_a_kept_prefix_run_on_the_replica_that_keeps_it(tiny):
    from meshd.pipeline.coordinator.slot import SharedPrefix

    prompt = SYSTEM[:30]
    async with Mesh(tiny, 2, groups=[1, 1], prefix_share=0.0) as mesh:
        prefix = SharedPrefix("parent")
        got = [s.token async for s in mesh.coord.steps(StepsRequest("parent", prompt, 6, SamplingSpec(), keep=prefix))]
        held = prompt + got[:-1]
        holder = prefix.route
        # the parent's replica is now busier than the other one: children must still go where the prefix is
        mesh.coord.route_counts.take(holder)
        children = await asyncio.gather(*(
            _children(mesh, f"c{i}", [70 + i, 71], prefix) for i in range(2)))
        for i, child in enumerate(children):
            assert child == reference(tiny, held + [70 + i, 71], 8)
        mesh.coord.route_counts.give(holder)
        await mesh.coord.release(prefix)
        assert await eventually(lambda: all(svc.kv_tokens_in_use() == 0 for svc in mesh.services))


async def _children(mesh, rid, suffix, prefix):
    return [s.token async for s in mesh.coord.steps(StepsRequest(rid, suffix, 8, SamplingSpec(), fork=prefix))]


async def test_requests_take_a_route_known_to_serve_over_one_that_never_answered(tiny):
    async with Mesh(tiny, 2, groups=[1, 1], prefix_share=0.0) as mesh:
        await steps(mesh, SYSTEM[:20], rid="first")  # route 0 answered: known to serve
        await mesh.services[1].server.close()  # route 1's device is gone, and no re-plan came yet
        prompts = [SYSTEM[5 * k: 5 * k + 25] for k in range(3)]
        outs = await asyncio.wait_for(asyncio.gather(*(
            _steps_within(mesh, p, f"b{k}") for k, p in enumerate(prompts))), 60)
        for got, p in zip(outs, prompts):
            assert got == reference(tiny, p, 10)


async def _steps_within(mesh, prompt, rid):
    return [s.token async for s in mesh.coord.steps(StepsRequest(rid, prompt, 10, SamplingSpec(), wait_s=20))]


async def test_a_tool_rounds_second_request_goes_where_the_first_left_its_prompt(tiny):
    """Home Assistant sends the tool result the moment the call is parsed: the second request of the round
    must start on the first's cached prompt + call, on whichever replica holds it, even while the first is
    still winding down there and even when another request keeps that replica busier."""
    system = list(SYSTEM[:120])
    async with Mesh(tiny, 2, groups=[1, 1]) as mesh:
        for r in mesh.routes:
            await mesh.coord.table.wait_ready(r)
        first = mesh.coord.steps(StepsRequest("call", system + [5, 6, 7], 8, SamplingSpec()))
        call = [(await first.__anext__()).token for _ in range(7)]
        holder = next(r for r in mesh.routes if mesh.coord.route_counts.running(r) == 1)
        call.append((await first.__anext__()).token)  # the last token is out; the attempt not yet wound down
        assert mesh.coord.route_counts.running(holder) == 0  # ... but it is no longer load
        # someone else's long answer on the same system prompt keeps that replica busier meanwhile
        busy = asyncio.create_task(_drain(mesh.coord.steps(StepsRequest("other", system + [77, 78], 60,
                                                                        SamplingSpec()))))
        await eventually(lambda: mesh.coord.route_counts.running(holder) == 1)
        second = mesh.coord.steps(StepsRequest("result", system + [5, 6, 7] + call + [9, 10, 11], 4, SamplingSpec()))
        step = await second.__anext__()
        await first.aclose()
        assert step.cached >= len(system), (holder.index, step.cached)
        await second.aclose()
        await busy


async def _drain(gen) -> list[int]:
    return [s.token async for s in gen]
