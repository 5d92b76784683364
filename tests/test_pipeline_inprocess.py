"""The transport pipeline (stage services + coordinator) reproduces the single-device reference."""

import asyncio

import pytest
import torch

from decoding.generate import generate
from decoding.loader import open_model
from decoding.pipeline_local import LocalPipeline, even_split
from decoding.sampling import SamplingParams
from meshd.pipeline.coordinator import PipelineCoordinator, PipelineError
from meshd.pipeline.route import Route, StageEndpoint
from meshd.pipeline.stage_service import StageService
from transport.node import TransportNode


class Mesh:
    """N stage services and a coordinator on loopback, CURVE off (in-process test harness)."""

    def __init__(self, source, n, version=1):
        self.source, self.n, self.version = source, n, version
        self.dir = {}

    async def __aenter__(self):
        self.nodes = [TransportNode(f"dev{i}", curve=False) for i in range(self.n + 1)]
        self.services = []
        for i in range(self.n):
            svc = StageService(self.nodes[i], f"dev{i}", self.source, self.dir.__getitem__)
            self.dir[f"dev{i}"] = (await svc.start(), "")
            self.services.append(svc)
        self.coord = PipelineCoordinator(self.nodes[-1], "coord", self.dir.__getitem__, token_timeout_s=20)
        self.dir["coord"] = (await self.coord.start(), "")
        ranges = even_split(self.source.config.num_layers, self.n)
        self.route = Route(self.version, tuple(StageEndpoint(f"dev{i}", self.dir[f"dev{i}"][0], "", a, b)
                                               for i, (a, b) in enumerate(ranges)))
        for s in self.services:
            await s.deploy(self.route)
        self.coord.set_route(self.route)
        return self

    async def __aexit__(self, *exc):
        await self.coord.close()
        for s in self.services:
            await s.close()
        for nd in self.nodes:
            await nd.close()

    async def run(self, prompt, max_tokens, sampling=SamplingParams(), rid="r1", **kw):
        return [t async for t in self.coord.generate(rid, prompt, max_tokens, sampling, **kw)]


async def eventually(cond, timeout=3.0):
    """Frees travel one-way: give them a moment to land."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        if loop.time() > end:
            return False
        await asyncio.sleep(0.02)
    return True


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    return open_model(tiny_llama[0])


@pytest.mark.parametrize("stages,cuts", [(2, [5, 17]), (3, None), (4, [1, 2, 3])])
async def test_pipeline_greedy_equals_reference(tiny, stages, cuts):
    prompt = list(range(7, 40))
    ref = generate(LocalPipeline.from_source(tiny, 1), prompt, 24).token_ids
    async with Mesh(tiny, stages) as mesh:
        got = await mesh.run(prompt, 24, cuts=cuts)
    assert got == ref


async def test_seeded_sampling_through_the_mesh_equals_reference(tiny):
    p = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=7)
    prompt = list(range(3, 30))
    ref = generate(LocalPipeline.from_source(tiny, 1), prompt, 20, p).token_ids
    async with Mesh(tiny, 2) as mesh:
        assert await mesh.run(prompt, 20, p, chunks=3) == ref


async def test_concurrent_requests_interleave_and_each_matches_reference(tiny):
    prompts = [list(range(5, 25)), list(range(50, 90)), list(range(100, 111))]
    refs = [generate(LocalPipeline.from_source(tiny, 1), p, 16).token_ids for p in prompts]
    async with Mesh(tiny, 3) as mesh:
        got = await asyncio.gather(*(mesh.run(p, 16, rid=f"r{i}", chunks=2) for i, p in enumerate(prompts)))
        assert await eventually(lambda: all(svc.kv.sequences() == [] for svc in mesh.services))
    assert got == refs


async def test_stale_plan_is_refused_with_a_clear_error(tiny):
    async with Mesh(tiny, 2) as mesh:
        # The coordinator still believes in plan 1 while the stages moved to plan 2.
        new = Route(2, mesh.route.stages)
        for s in mesh.services:
            await s.deploy(new)
        with pytest.raises(PipelineError, match="stale_plan"):
            await mesh.run(list(range(5, 15)), 4)
        mesh.coord.set_route(new)
        assert len(await mesh.run(list(range(5, 15)), 4, rid="r2")) == 4  # still serving


async def test_a_vanished_stage_fails_the_request_in_bounded_time(tiny):
    async with Mesh(tiny, 2) as mesh:
        mesh.coord.token_timeout_s = 1.5
        mesh.services[0].send_timeout_s = 1.0  # how long a stage may block on a dead successor
        await mesh.services[1].server.close()  # device 1 disappears
        with pytest.raises(PipelineError, match="unreachable|no token from the last stage"):
            await mesh.run(list(range(5, 15)), 4)
        assert await eventually(lambda: mesh.services[0].kv.sequences() == [])  # its cache was freed


async def test_engine_streams_text_through_the_mesh_and_maps_errors(tiny):
    from meshd.engine import GenerationRequest, NoPlan
    from meshd.pipeline.engine import PipelineEngine

    class Tok:  # the tiny model has no tokenizer: ids are their own text
        eos_ids = ()

        def decode(self, ids):
            return " ".join(map(str, ids))

    tiny.__dict__["tokenizer"] = Tok()
    async with Mesh(tiny, 2) as mesh:
        engine = PipelineEngine(tiny, mesh.coord)
        req = GenerationRequest("q1", list(range(5, 45)), max_tokens=12, temperature=0.0)
        ids = [t async for t in engine.token_ids(req)]
        assert ids == generate(LocalPipeline.from_source(tiny, 1), list(range(5, 45)), 12).token_ids
        mesh.coord.set_route(None)
        with pytest.raises(NoPlan):
            [t async for t in engine.token_ids(GenerationRequest("q2", [1, 2, 3], max_tokens=2))]


def test_default_cuts_give_about_two_chunks_per_stage_and_none_too_short():
    from meshd.pipeline.engine import default_cuts

    assert default_cuts(1024, 2) == [256, 512, 768]
    assert default_cuts(40, 2) == []
    assert default_cuts(500, 1) == []


async def test_last_stage_returns_only_the_requested_top_k_distribution(tiny):
    prompt = list(range(9, 30))
    ref = LocalPipeline.from_source(tiny, 1)
    ref.create("r", 64)
    logits = ref.prefill("r", prompt)[-1]
    want = torch.topk(torch.softmax(logits, -1), 5)
    async with Mesh(tiny, 2) as mesh:
        steps = [s async for s in mesh.coord.steps("k", prompt, 3, SamplingParams(), return_topk=5)]
        plain = [s async for s in mesh.coord.steps("n", prompt, 1, SamplingParams())]
    assert steps[0].topk_ids == want.indices.tolist()
    assert steps[0].topk_probs == pytest.approx(want.values.tolist(), abs=1e-5)
    assert steps[0].token == steps[0].topk_ids[0]  # greedy picks the most likely
    assert plain[0].topk_ids is None  # nothing extra crosses the link unless asked


async def test_waiting_for_a_stage_that_never_loads_ends_when_the_mesh_replans(tiny):
    async with Mesh(tiny, 2) as mesh:
        await mesh.services[1].server.close()  # its device is gone before the first request
        stale = Route(2, mesh.route.stages)
        mesh.coord.set_route(stale)
        waiting = asyncio.create_task(mesh.coord.wait_ready(stale, timeout_s=60))
        await asyncio.sleep(0.5)
        mesh.coord.set_route(Route(3, mesh.route.stages))  # membership noticed and re-planned
        with pytest.raises(PipelineError, match="re-planned"):
            await asyncio.wait_for(waiting, 10)


def test_daemon_cut_points_come_from_the_sequence_partitioner_table():
    import json
    from pathlib import Path

    from meshd.pipeline.engine import cut_table_for

    prof = json.loads((Path(__file__).parent.parent / "profiles" / "x86_64-2core-1thread.json").read_text())
    route = Route(4, (StageEndpoint("a", "", "", 0, 15), StageEndpoint("b", "", "", 15, 30)))
    table = cut_table_for(route, {"a": prof, "b": prof}, 30, "1gbit,1ms")
    cuts = table.lookup(2048)
    assert len(cuts) >= 3 and list(cuts) == sorted(cuts)
    assert cuts[0] > 2048 - cuts[-1]  # early chunks longer: later ones attend to more cached keys
    assert cut_table_for(route, {"a": prof}, 30, "1gbit,1ms") is None  # a member without a profile
