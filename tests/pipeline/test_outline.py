"""Outline-based parallel decoding: shared prefixes, the outline strategy, the router, the API field.

Children forked from a kept prefix must decode exactly what a request with
the whole text as its prompt decodes (they read the prefix in place on every
stage, concurrently and batched); an outline answer is its points in order;
a failing point fails the request; every cache is freed afterwards.
"""

import asyncio
import contextlib
import json

import httpx
import pytest

from decoding.generate import generate
from decoding.loader import open_model
from decoding.pipeline_local import LocalPipeline
from decoding.sampling import SamplingSpec
from meshd.api import openai_schema as oa
from meshd.api.validation import RequestError
from meshd.pipeline.coordinator.failures import PipelineError
from meshd.pipeline.coordinator.slot import SharedPrefix, StepsRequest
from meshd.pipeline.outline import router as outline_router
from meshd.pipeline.outline.decoder import OutlineDecoder, OutlineStats, _title_end
from tests.support.inprocess import Mesh
from tests.support.waiting import eventually


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    return open_model(tiny_llama[0])


async def _take(agen, n=None):
    out = []
    async with contextlib.aclosing(agen):
        async for step in agen:
            out.append(step.token)
            if n is not None and len(out) == n:
                break
    return out


# --------------------------------------------------------------------------- shared prefixes


@pytest.mark.parametrize("stop_after", [None, 3])
async def test_children_forked_from_a_kept_prefix_equal_whole_prompt_requests(tiny, stop_after):
    ref = LocalPipeline.from_source(tiny, 1)
    prompt = list(range(10, 40))
    suffixes = [[50, 51, 52], [60], [70, 71, 72, 73, 74]]
    async with Mesh(tiny, 2) as mesh:
        prefix = SharedPrefix("parent")
        got = await _take(mesh.coord.steps(StepsRequest("parent", prompt, 8, SamplingSpec(), keep=prefix)), stop_after)
        held = prompt + got[:-1]  # the last sampled token is never fed
        assert prefix.seq is not None and prefix.length == len(held)
        children = await asyncio.gather(*(
            _take(mesh.coord.steps(StepsRequest(f"child{i}", s, 12, SamplingSpec(), fork=prefix)))
            for i, s in enumerate(suffixes)))
        for s, child in zip(suffixes, children):
            assert child == generate(ref, held + s, 12).token_ids
        assert all(svc.kv_tokens_in_use() > 0 for svc in mesh.services)  # the prefix is still kept
        await mesh.coord.release(prefix)
        assert await eventually(lambda: all(svc.kv_tokens_in_use() == 0 for svc in mesh.services))


async def test_a_fork_of_a_released_prefix_fails_clearly_instead_of_hanging(tiny):
    async with Mesh(tiny, 2) as mesh:
        prefix = SharedPrefix("parent")
        await _take(mesh.coord.steps(StepsRequest("parent", list(range(10, 30)), 4, SamplingSpec(), keep=prefix)))
        stale = SharedPrefix("parent", prefix.route, prefix.seq, prefix.length)
        await mesh.coord.release(prefix)
        assert await eventually(lambda: all(svc.kv_tokens_in_use() == 0 for svc in mesh.services))
        with pytest.raises(PipelineError, match="interrupted|gone|unknown"):
            await _take(mesh.coord.steps(StepsRequest("child", [5, 6], 4, SamplingSpec(), fork=stale)))


async def test_a_fork_that_arrives_after_its_free_creates_nothing(tiny):
    """A cancelled child's free overtakes its queued fork; the late fork must not leak a sequence."""
    import torch

    from transport.stage_messages import ForkSequence, FreeSequence, StageForward

    async with Mesh(tiny, 1) as mesh:
        svc, v = mesh.services[0], mesh.route.plan_version
        await svc.handle(StageForward(request_id="p", plan_version=v, seq_id="coord:p", position_offset=0,
                                      chunk_index=0, token_ids=torch.tensor([5, 6, 7]), is_last_chunk=False,
                                      reply_to="", capacity=8), None)
        await svc.handle(FreeSequence(v, "coord:c"), None)
        await svc.handle(ForkSequence(v, "coord:c", "coord:p", 3), None)
        assert "coord:c" not in svc.kv and svc.sequences() == ["coord:p"]
        await svc.handle(FreeSequence(v, "coord:p"), None)
        assert svc.kv_tokens_in_use() == 0


# --------------------------------------------------------------------------- parsing the outline


@pytest.mark.parametrize("text, end", [("Use LED", None), ("Use LED bulbs:", 13), ("Seal gaps. More", 9),
                                       ("Heat\n", 4), ("one two three four five six seven eight nine ten eleven", 55)])
def test_a_title_ends_at_its_first_clause(text, end):
    assert _title_end(text) == end


# --------------------------------------------------------------------------- the strategy, on the real model


@pytest.fixture(scope="module")
def real_mesh_source(real_source):
    return real_source


async def test_an_outline_answer_is_its_points_in_order_and_frees_everything(real_mesh_source):
    tok = real_mesh_source.tokenizer
    async with Mesh(real_mesh_source, 2) as mesh:
        stats = OutlineStats()
        dec = OutlineDecoder(mesh.coord, tok, tok.eos_ids)
        stream = await dec.run("q", [{"role": "user", "content": "What are good ways to save energy at home?"}],
                               160, SamplingSpec(), stats)
        assert stream is not None, stats.fallback
        ids = [t async for t in stream]
        text = tok.decode(ids)
        assert 3 <= stats.points <= dec.max_points
        starts = [text.find(f"{i}. ") for i in range(1, stats.points + 1)]
        assert starts[0] == 0 and starts == sorted(starts) and -1 not in starts, text
        assert sum(stats.point_tokens) > 0
        assert await eventually(lambda: all(svc.kv_tokens_in_use() == 0 for svc in mesh.services), timeout_s=10)
        assert any(k > 1 for svc in mesh.services for k in svc.stats.batches)  # the points shared passes


async def test_a_point_that_fails_fails_the_request_and_frees_everything(real_mesh_source, monkeypatch):
    tok = real_mesh_source.tokenizer
    async with Mesh(real_mesh_source, 2) as mesh:
        real_steps = mesh.coord.steps

        def steps(request):
            if request.request_id.endswith("/p2"):
                async def broken():
                    raise PipelineError("device dev1 left")
                    yield  # pragma: no cover
                return broken()
            return real_steps(request)

        monkeypatch.setattr(mesh.coord, "steps", steps)
        dec = OutlineDecoder(mesh.coord, tok, tok.eos_ids)
        stream = await dec.run("q", [{"role": "user", "content": "What are good ways to save energy at home?"}],
                               120, SamplingSpec(), OutlineStats())
        assert stream is not None
        with pytest.raises(PipelineError, match="point 2 of the outline failed: device dev1 left"):
            async for _ in stream:
                pass
        assert await eventually(lambda: all(svc.kv_tokens_in_use() == 0 for svc in mesh.services), timeout_s=10)


# --------------------------------------------------------------------------- the router


def test_the_shipped_router_is_accurate_on_held_out_questions_and_never_routes_code_or_maths():
    rows = [json.loads(x) for x in outline_router.HELD_OUT.read_text().splitlines() if x.strip()]
    router = outline_router.shipped()
    acc = outline_router.accuracy(router, rows)
    assert acc["accuracy"] >= 0.9, acc
    assert acc["by_category"]["coding"] == acc["by_category"]["math"] == 1.0
    assert {r["category"] for r in rows} >= {"generic", "knowledge", "counterfactual", "home_automation",
                                              "coding", "math"}
    assert all(sum(r["category"] == c for r in rows) >= 8 for c in {r["category"] for r in rows})


def test_training_the_router_reproduces_the_shipped_weights():
    rows = [json.loads(x) for x in outline_router.TRAIN_SET.read_text().splitlines() if x.strip()]
    fresh = outline_router.train(rows)
    shipped = outline_router.shipped()
    for q in ["What are good ways to save energy?", "Write a Python function to add two numbers.", "What is 2+2?"]:
        assert fresh.wants_outline(q) == shipped.wants_outline(q)
        assert abs(fresh.probability(q) - shipped.probability(q)) < 1e-3


# --------------------------------------------------------------------------- the API field


@pytest.mark.parametrize("value", ["auto", "on", "off"])
def test_the_outline_field_is_parsed(value):
    req = oa.parse_chat_request({"messages": [{"role": "user", "content": "hi"}], "outline": value})
    assert req.options.outline == value


@pytest.mark.parametrize("value", ["sometimes", True, 1, {"mode": "on"}])
def test_a_bad_outline_value_is_a_400_naming_the_field(value):
    with pytest.raises(RequestError) as info:
        oa.parse_chat_request({"messages": [{"role": "user", "content": "hi"}], "outline": value})
    assert (info.value.param, info.value.status) == ("outline", 400)


def test_outline_on_with_an_engine_that_cannot_is_refused(server):  # noqa: F811 - fixture
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(server.socket_path)), base_url="http://localhost") as h:
        r = h.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "outline": "on"})
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "outline" and r.json()["error"]["code"] == "unsupported_parameter"
        ok = h.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "outline": "auto"})
        assert ok.status_code == 200
