"""One model per home: plans name their model, stages and coordinators refuse another, token ids are
checked against the vocabulary before any stage sees them.

The daemons' side (a mixed-model home, its status and its answers) is in
tests/mesh/test_daemon_model_identity.py; here are the pure rules and the in-process pipeline.
"""

from __future__ import annotations

import openai
import pytest

from decoding.loader import open_model
from decoding.sampling import SamplingSpec
from meshd.pipeline.coordinator.failures import BadTokens, ModelMismatch
from meshd.pipeline.coordinator.service import PipelineCoordinator
from meshd.pipeline.route import Route
from meshd.mesh.home_plan import Plan, not_planned, plannable_members
from partition.stages import StageAssignment as Stage
from tests.support.clients import sdk
from tests.support.api import FakeEngine, ServerThread
from tests.support.coordinator import generate_on
from tests.support.inprocess import Mesh

SMOL, QWEN = ("SmolLM2-135M-Instruct.Q4_1.gguf@aa", 30), ("qwen2.5-coder-0.5b-instruct.gguf@bb", 24)


# -- which model the home serves, and who is left out --------------------------------------------


def test_a_tie_keeps_the_model_the_current_plan_serves_so_one_restarted_device_does_not_move_the_home():
    facts = {"a": ("loaded", *QWEN), "b": ("loaded", *SMOL)}  # "a" restarted with another model
    members, model, _, excluded = plannable_members(facts, incumbent=SMOL[0])
    assert (members, model) == (["b"], SMOL[0])
    assert excluded == {"a": "holds qwen2.5-coder-0.5b-instruct, the home serves SmolLM2-135M-Instruct.Q4_1"}


def test_the_home_moves_to_another_model_only_once_most_members_hold_it():
    facts = {"a": ("loaded", *QWEN), "b": ("loaded", *QWEN), "c": ("loaded", *SMOL)}
    members, model, layers, excluded = plannable_members(facts, incumbent=SMOL[0])
    assert (members, model, layers) == (["a", "b"], QWEN[0], 24)
    assert excluded["c"] == "holds SmolLM2-135M-Instruct.Q4_1, the home serves qwen2.5-coder-0.5b-instruct"


def test_two_files_of_one_name_are_told_apart_by_their_digests():
    facts = {"a": ("loaded", "m.gguf@11", 30), "b": ("loaded", "m.gguf@22", 30)}
    assert plannable_members(facts, incumbent="m.gguf@22")[3] == {"a": "holds m.gguf@11, the home serves m.gguf@22"}


def test_every_ready_member_without_layers_is_listed_with_a_reason_on_any_member():
    plan = Plan(4, (Stage("a", 0, 30),), 30, reason="one device is fastest", leader="a",
                members=("a", "b"), model=SMOL[0])
    facts = {"a": ("loaded", *SMOL), "b": ("loaded", *SMOL), "c": ("loaded", *QWEN),
             "d": ("loading", "", 0), "e": ("loaded", *SMOL)}
    assert not_planned(plan, facts) == {
        "b": "the planner gave it no layers (one device is fastest)",
        "c": "holds qwen2.5-coder-0.5b-instruct, the home serves SmolLM2-135M-Instruct.Q4_1",
        "d": "model loading",
        "e": "not in plan v4 (made before it was ready); the next plan includes it",
    }
    # The plan's model is what the home serves, even where the members at hand are split evenly.
    assert not_planned(plan, {"a": ("loaded", *SMOL), "c": ("loaded", *QWEN)})["c"].startswith("holds qwen")
    assert not_planned(None, {"a": ("loaded", *SMOL)}) == {"a": "no plan yet"}


def test_a_plan_carries_its_model_on_the_wire_and_older_plans_without_one_still_read():
    plan = Plan(3, (Stage("x", 0, 10), Stage("y", 10, 30)), 30, leader="x", members=("x", "y"), model=SMOL[0])
    again = Plan.from_assignment(3, plan.to_assignment())
    assert again == plan and again.to_status()["model"] == SMOL[0]
    old = {n: {k: v for k, v in row.items() if k != "model"} for n, row in plan.to_assignment().items()}
    assert Plan.from_assignment(3, old).model == ""
    # The digest a 0.1 daemon computes for the same stages is unchanged (mixed-version homes agree).
    assert Plan.from_assignment(3, old).digest() == plan.digest()


def test_the_warning_says_how_to_start_a_device_on_the_homes_model():
    from meshd.model.store import CATALOG, DEFAULT_MODEL, model_flag_for

    qwen = CATALOG["qwen2.5-coder-0.5b-instruct"]
    assert model_flag_for(f"{qwen.file_name}@{qwen.sha256[:16]}") == "with --model qwen2.5-coder-0.5b-instruct"
    assert model_flag_for(f"{DEFAULT_MODEL.name}@{DEFAULT_MODEL.sha256[:16]}") == \
        "without --model (the embedded default)"
    assert model_flag_for("my-finetune.gguf@0123") == "with --model set to a copy of my-finetune.gguf"


# -- stages and coordinators refuse another model ---------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    return open_model(tiny_llama[0])


async def test_a_stage_given_a_plan_for_another_model_loads_nothing_and_refuses_its_requests(tiny):
    async with Mesh(tiny, 2) as mesh:
        other = Route(2, mesh.route.stages, model="other-model.gguf@0123456789abcdef")
        for svc in mesh.services:
            await svc.deploy(other)
            assert svc.stage is None  # never the plan's layer range out of this file
        # A coordinator that does not know its own model (so does not check) is refused by the stage.
        mesh.coord.set_route(other)
        with pytest.raises(ModelMismatch, match=r"stage dev\d holds \S+, the home serves other-model"):
            await mesh.run([5, 6, 7], 4)


async def test_a_coordinator_holding_another_model_than_the_plan_refuses_at_once(tiny):
    async with Mesh(tiny, 2) as mesh:
        coord = PipelineCoordinator(mesh.nodes[-1], "coord2", mesh.dir.__getitem__, model="mine.gguf@1",
                                    resume_timeout_s=30)
        mesh.coord.set_route(None)
        coord.set_route(Route(1, mesh.route.stages, model="theirs.gguf@2"))
        with pytest.raises(ModelMismatch, match="this device holds mine, the home serves theirs"):
            async for _ in generate_on(coord, "r", [5, 6, 7], 4, SamplingSpec()):
                pass
        assert sum(s.stats.forwards for s in mesh.services) == 0


async def test_prompt_token_ids_outside_the_vocabulary_never_reach_a_stage(tiny):
    vocab = tiny.config.vocab_size
    async with Mesh(tiny, 2) as mesh:
        mesh.coord.vocab_size = vocab
        before = [(s.stats.forwards, s.stats.errors) for s in mesh.services]
        with pytest.raises(BadTokens, match=rf"token id {vocab} at position 1 .*\[0, {vocab}\)"):
            await mesh.run([5, vocab, 7], 4)
        assert [(s.stats.forwards, s.stats.errors) for s in mesh.services] == before
        assert await mesh.run([5, 6, 7], 4, rid="r2")  # and the mesh serves on


# -- what a client sees --------------------------------------------------------------------------


class AsciiEngine(FakeEngine):
    vocab_size = 128  # one token per character: "é" (233) has no embedding


def test_a_prompt_the_vocabulary_cannot_hold_is_a_400_before_any_generation():
    eng = AsciiEngine()
    with ServerThread(eng) as srv:
        with pytest.raises(openai.BadRequestError) as info:
            sdk(srv).chat.completions.create(
                model="fake-model", messages=[{"role": "user", "content": "café"}])
        assert info.value.body["code"] == "invalid_token_ids"
        assert "token id 233" in info.value.body["message"] and "[0, 128)" in info.value.body["message"]
        assert eng.requests == []
        assert sdk(srv).chat.completions.create(
            model="fake-model", messages=[{"role": "user", "content": "cafe"}]).choices[0].message.content

