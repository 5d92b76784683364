"""Early exits through a two-stage mesh: the last stage answers early and completes its KV right after.

Untrained exit heads (the adapter is the identity, so an exit is the model's own head read at that
layer) and a low threshold make many tokens leave early; the reference is one device with the same
heads stepping the same rule.
"""

from __future__ import annotations

import pytest
import torch

from decoding.batch import BatchItem
from decoding.exits.bound import BoundExits, ExitCheck
from decoding.exits.heads import ExitHeads, default_exit_layers
from decoding.sampling import SamplingSpec
from meshd.pipeline.coordinator.slot import StepsRequest
from tests.support.inprocess import Mesh
from tests.support.waiting import eventually

THRESHOLD = 0.4


@pytest.fixture(scope="module")
def heads(real_source):
    cfg = real_source.config
    return ExitHeads(default_exit_layers(cfg.num_layers), cfg.hidden_size, torch.arange(4096),
                     num_layers=cfg.num_layers, vocab_size=cfg.vocab_size)


@pytest.fixture(scope="module")
def prompt(real_source):
    return real_source.tokenizer.apply_chat([{"role": "user", "content": "List the days of the week."}])


def one_device(real_source, heads, prompt, n, threshold):
    """Greedy with exits on one float32 stage holding every layer: (tokens, exit layers)."""
    stage = real_source.load_stage(0, real_source.config.num_layers, torch.float32)
    stage.exits = BoundExits(heads, stage)
    kv = stage.new_cache()
    kv.create("s", len(prompt) + n + 1)
    out = stage.forward(kv, "s", torch.tensor(prompt), all_logits=False)
    tokens, layers = [], []
    with torch.no_grad():
        for _ in range(n):
            exited = isinstance(out, ExitCheck)
            tokens.append(int((out.logits if exited else out[-1]).argmax()))
            layers.append(out.layer if exited else 0)
            out = stage.forward_batch(kv, [BatchItem("s", torch.tensor([tokens[-1]]), all_logits=False,
                                                     exit_threshold=threshold)])[0]
    return tokens, layers


async def test_a_two_stage_mesh_with_exits_answers_as_one_device_with_the_same_exits(real_source, heads, prompt):
    want, want_layers = one_device(real_source, heads, prompt, 20, THRESHOLD)
    async with Mesh(real_source, 2, exits=lambda stage: heads) as mesh:
        assert mesh.services[1].status()["exit_layers"] == [23, 26, 29] and mesh.services[0].status()["exit_layers"] == []
        steps = [s async for s in mesh.coord.steps(StepsRequest("x", prompt, 20, SamplingSpec(),
                                                                exit_threshold=THRESHOLD))]
        plain = await mesh.run(prompt, 20, rid="plain")
        last = mesh.services[1].status()
    assert [s.token for s in steps] == want
    assert [s.exit_layer for s in steps] == want_layers and {0, 23} <= set(want_layers)
    exits = last["exits"]
    # the first token is the prompt's (never exits); the plain request asked for none
    assert exits["asked"] == 19 and sum(exits["by_layer"].values()) == sum(1 for l in want_layers[1:] if l)
    assert plain == one_device(real_source, heads, prompt, 20, 0.0)[0]  # exits off: the full model
    assert last["kv_tokens_in_use"] == 0 or last["prefix_cache"]["held_tokens"] >= 0


async def test_an_answer_whose_last_token_left_early_is_still_kept_for_the_next_prompt(real_source, heads, prompt):
    """The request ends on an exited token: the cache is kept once the fill is done, not freed as busy."""
    async with Mesh(real_source, 2, exits=lambda stage: heads) as mesh:
        first = [s async for s in mesh.coord.steps(StepsRequest("a", prompt, 12, SamplingSpec(), exit_threshold=0.01))]
        assert first[-1].exit_layer  # the last token left early
        for svc in mesh.services:
            await eventually(lambda s=svc: s.status()["prefix_cache"]["entries"] >= 1, 10,
                             what=f"{svc.node_id} keeping the finished answer")
        again = [s async for s in mesh.coord.steps(StepsRequest("b", prompt + [first[0].token], 4, SamplingSpec()))]
    assert again[0].cached == len(prompt)  # the next request started on what the first one left


async def test_a_stage_whose_exit_heads_cannot_load_says_why_and_decodes_at_full_depth(real_source, prompt):
    from decoding.errors import DrafterError

    def broken(stage):
        raise DrafterError("no exit heads for this model")

    async with Mesh(real_source, 2, exits=broken) as mesh:
        status = mesh.services[1].status()
        got = [s async for s in mesh.coord.steps(StepsRequest("x", prompt, 8, SamplingSpec(), exit_threshold=0.5))]
        plain = await mesh.run(prompt, 8, rid="plain")
    assert status["exit_layers"] == [] and "no exit heads" in status["exits_note"]
    assert [s.token for s in got] == plain and all(s.exit_layer == 0 for s in got)
    assert mesh.coord.exits_available() is False  # so the engine refuses an explicit request, and asks none


def test_status_says_where_tokens_left_early_or_why_there_are_no_exits():
    from meshd.commands.status_extras import exits_line

    stage = {"exit_layers": [23, 29], "exits": {"asked": 40, "by_layer": {"23": 20, "29": 6}, "rate": 0.65}}
    assert exits_line(stage) == "early exits: 65% of 40 decode steps left early (after layer 23: 20, after layer 29: 6)"
    assert exits_line({**stage, "exits": {"asked": 0, "by_layer": {}, "rate": 0.0}}) == \
        "early exits: ready after layers 23, 29; no request asked for them yet"
    assert exits_line({"exit_layers": [], "exits_note": "none: this stage's layers [0, 15) hold no exit layer"}) \
        == "early exits: none: this stage's layers [0, 15) hold no exit layer"
    assert exits_line({"exit_layers": [], "exits_note": "off: no exit heads configured"}) == ""


async def test_a_coordinator_on_an_older_meshd_is_never_told_of_exits_nor_asked_to_send_them(real_source, heads,
                                                                                               prompt):
    """Its heartbeats lack the ``exits`` capability: the stage's readiness reply leaves the field out (an older
    decoder refuses a reply with a field it lacks), so that coordinator never sends an exit threshold."""
    from meshd.mesh.caps import PeerCaps

    async with Mesh(real_source, 2, exits=lambda stage: heads, peer_caps=lambda node: PeerCaps()) as mesh:
        got = [s async for s in mesh.coord.steps(StepsRequest("x", prompt, 8, SamplingSpec(), exit_threshold=0.4))]
        plain = await mesh.run(prompt, 8, rid="plain")
        assert mesh.coord.exits_available() is False and mesh.services[1].status()["exits"]["asked"] == 0
    assert [s.token for s in got] == plain and all(s.exit_layer == 0 for s in got)


class _Coordinator:
    """What the engine asks a coordinator about exits: whether a serving route's last stage checks them."""

    def __init__(self, available):
        self.available = available

    def exits_available(self):
        return self.available


def test_the_engine_decodes_with_exits_only_where_they_are_asked_for_and_can_mix(real_source):
    from decoding.penalties import Penalties
    from decoding.sampling import SamplingParams
    from decoding.speculative.params import SpeculativeParams
    from meshd.engine.errors import BadEngineRequest
    from meshd.engine.base import GenerationRequest
    from meshd.engine.options import RequestOptions
    from meshd.pipeline.engine import PipelineEngine

    def req(threshold=None, **kw):
        return GenerationRequest("r", [1, 2, 3], 8, options=RequestOptions(exit_threshold=threshold, **kw))

    off = PipelineEngine(real_source, _Coordinator(True))
    assert off.exits_for(req()) == 0.0 and off.exits_for(req(0.7)) == 0.7 and off.exits_for(req(0.0)) == 0.0
    shaped = SamplingSpec(SamplingParams(), Penalties(presence=0.5))
    for clash, kw in (("penalties", {"sampling": shaped}), ("speculative", {"speculative": SpeculativeParams("on")}),
                      ("outline", {"outline": "on"}), ("cloud budget", {"cloud": 0.5})):
        with pytest.raises(BadEngineRequest, match=clash):
            off.exits_for(req(0.7, **kw))
    default = PipelineEngine(real_source, _Coordinator(True), exit_threshold=0.7)
    assert default.exits_for(req()) == 0.7 and default.exits_for(req(0.0)) == 0.0
    assert default.exits_for(req(speculative=SpeculativeParams("on"))) == 0.0  # the default steps aside
    none_here = PipelineEngine(real_source, _Coordinator(False), exit_threshold=0.7)
    assert none_here.exits_for(req()) == 0.0  # no serving route checks exits: speculation stays available
    with pytest.raises(BadEngineRequest, match="not available"):
        none_here.exits_for(req(0.6))
    assert PipelineEngine(real_source, _Coordinator(None)).exits_for(req(0.6)) == 0.6  # not known yet: asked
