"""A request ends at ``max_tokens`` and at EOS, the same way through the mesh and on one device.

The rule is one :class:`meshd.engine.base.Budget`; the token producers (the coordinator,
the local engine's loop) stop computing at it and the API's stream names the reason.
"""

import pytest

from meshd.engine.base import Budget, GenerationRequest
from meshd.engine.local import LocalEngine
from meshd.pipeline.engine import PipelineEngine
from meshd.pipeline.coordinator.slot import StepsRequest
from tests.support.inprocess import Mesh
from tests.support.waiting import eventually

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def local(real_source):
    return LocalEngine(real_source)


def test_the_budget_names_eos_first_then_the_spent_budget():
    b = Budget(3, (7,))
    assert [b.finish(5, 1), b.finish(5, 3), b.finish(7, 1), b.finish(7, 3)] == [None, "length", "stop", "stop"]


async def _events(engine, ids, max_tokens):
    events = [e async for e in engine.stream(GenerationRequest("r", list(ids), max_tokens))]
    return [e.token_id for e in events if e.token_id is not None], events[-1]


@pytest.mark.parametrize("question, max_tokens, finish", [
    ("Write a long story about a lighthouse keeper.", 5, "length"),
    ("What is 2+2? Answer with only the number.", 64, "stop"),
])
async def test_a_request_stops_at_max_tokens_and_at_eos_through_the_mesh_and_locally(
        real_source, local, question, max_tokens, finish):
    ids = real_source.tokenizer.apply_chat([{"role": "user", "content": question}])
    here, last_here = await _events(local, ids, max_tokens)
    async with Mesh(real_source, 2) as mesh:
        there, last_there = await _events(PipelineEngine(real_source, mesh.coord), ids, max_tokens)
        assert await eventually(lambda: mesh.coord.in_flight == 0, timeout_s=10)
    assert there == here
    assert last_there.finish_reason == last_here.finish_reason == finish
    assert last_there.usage.completion_tokens == last_here.usage.completion_tokens == len(here)
    assert len(here) == max_tokens if finish == "length" else len(here) < max_tokens


async def test_the_coordinator_ends_at_the_requests_own_eos_and_returns_it_last(real_source):
    ids = real_source.tokenizer.apply_chat([{"role": "user", "content": "Name three colours."}])
    async with Mesh(real_source, 2) as mesh:
        ref = [s.token async for s in mesh.coord.steps(StepsRequest("ref", ids, 8))]
        end = ref[3]
        got = [s.token async for s in mesh.coord.steps(StepsRequest("eos", ids, 8, eos_ids=(end,)))]
    assert got == ref[:ref.index(end) + 1]
