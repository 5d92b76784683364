"""The transport pipeline (stage services + coordinator) reproduces the single-device reference."""

import asyncio

import pytest
import torch

from decoding.generate import generate
from decoding.loader import open_model
from decoding.pipeline_local import LocalPipeline
from decoding.sampling import SamplingParams, SamplingSpec
from meshd.pipeline.coordinator.failures import PipelineError
from meshd.pipeline.coordinator.service import PipelineCoordinator
from meshd.pipeline.route import Route, StageEndpoint
from meshd.pipeline.stage import StageService
from meshd.pipeline.coordinator.slot import StepsRequest
from transport.node import TransportNode
from tests.support.coordinator import generate_on
from tests.support.inprocess import Mesh
from tests.support.waiting import eventually
from tests.support.repo import ROOT


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


async def test_half_precision_activations_on_the_wire_halve_the_bytes_and_keep_greedy_tokens(tiny, monkeypatch):
    """``meshd join --wire-dtype float16``: a stage sends float16 hidden states; the next one computes in
    its own dtype. Parity is a measured property of the model (36/36 prompts for SmolLM2, RESULTS.md),
    checked here on the test model. The bytes are counted on the encoded frames, not taken from stats."""
    import transport.peer as peer_mod
    from transport.stage_messages import StageForward
    from transport.wire_decode import _frame_len

    real_encode = peer_mod.encode
    frame_bytes = []

    def counting_encode(msg, **kw):
        frames = real_encode(msg, **kw)
        if isinstance(msg, StageForward) and msg.hidden is not None:
            ids = msg.token_ids  # token ids travel too (every stage's prefix cache keys on them)
            frame_bytes.append(sum(_frame_len(f) for f in frames[1:])  # the tensor frames after the header
                               - (ids.numel() * ids.element_size() if ids is not None else 0))
        return frames

    monkeypatch.setattr(peer_mod, "encode", counting_encode)
    prompt = list(range(7, 40))
    ref = generate(LocalPipeline.from_source(tiny, 1), prompt, 24).token_ids
    sent = {}
    for wire in (None, "float16"):
        frame_bytes.clear()
        async with Mesh(tiny, 2, activation_dtype=wire) as mesh:
            assert await mesh.run(prompt, 24, cuts=[11, 22]) == ref
        sent[wire] = sum(frame_bytes)
    assert sent[None] > 0 and sent["float16"] * 2 == sent[None]


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
        assert await eventually(lambda: all(svc.sequences() == [] for svc in mesh.services))
    assert got == refs


async def test_two_coordinators_at_once_never_touch_each_others_sequences(tiny):
    """Two people asking two devices at once: both answers equal the reference.

    Before home-wide sequence keys, both coordinators numbered sequences from 1
    and one's free (or prompt) landed in the other's cache.
    """
    prompts = [list(range(5, 45)), list(range(60, 100))]
    refs = [generate(LocalPipeline.from_source(tiny, 1), p, 16).token_ids for p in prompts]
    async with Mesh(tiny, 2) as mesh:
        other = PipelineCoordinator(mesh.nodes[-1], "coord2", mesh.dir.__getitem__, token_timeout_s=20)
        mesh.dir["coord2"] = (await other.start(), "")
        other.set_route(mesh.route)
        try:
            for _ in range(3):
                got = await asyncio.gather(
                    mesh.run(prompts[0], 16, chunks=3),
                    _collect(generate_on(other, "r1", prompts[1], 16, SamplingSpec(), chunks=3)))
                assert got == refs
        finally:
            await other.close()
        assert await eventually(lambda: all(svc.kv_tokens_in_use() == 0 for svc in mesh.services))


async def _collect(agen):
    return [t async for t in agen]


async def test_hanging_up_during_prefill_leaks_nothing_even_when_frees_overtake_chunks(tiny):
    """A client that hangs up while its prompt is still in flight leaves no cache behind.

    Frees go straight to every stage and can overtake prompt chunks still queued
    upstream; the stage's tombstone keeps a late chunk from re-creating the sequence.
    """
    async with Mesh(tiny, 3, max_kv_tokens=4096) as mesh:
        for i in range(12):  # more hang-ups than the cache could hold leaked sequences
            agen = generate_on(mesh.coord, f"h{i}", list(range(3, 400)), 200, SamplingSpec(), chunks=8)
            task = asyncio.ensure_future(agen.__anext__())
            await asyncio.sleep(0.005 * (i % 4))  # sleep-ok: hang-ups at different points of the prompt
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await agen.aclose()
        assert await eventually(lambda: all(svc.kv_tokens_in_use() == 0 for svc in mesh.services), 10)
        ref = generate(LocalPipeline.from_source(tiny, 1), list(range(5, 45)), 8).token_ids
        assert await mesh.run(list(range(5, 45)), 8, rid="after") == ref  # still serving


async def test_a_late_chunk_for_a_freed_sequence_is_dropped_not_recreated(tiny):
    from transport.stage_messages import FreeSequence, StageForward

    async with Mesh(tiny, 2) as mesh:
        last = mesh.services[1]
        await last.handle(FreeSequence(1, "coord/x/1"), None)
        hidden = torch.zeros(4, tiny.config.hidden_size)
        await last.handle(StageForward("r", 1, "coord/x/1", 0, hidden=hidden, capacity=64), None)
        assert last.sequences() == [] and last.stats.late_dropped == 1


async def test_any_stage_failure_reaches_the_coordinator_at_once_and_frees_the_sequence(tiny):
    """An out-of-vocabulary token id used to raise outside the error path: a 30 s hang."""
    async with Mesh(tiny, 2) as mesh:
        mesh.coord.token_timeout_s = 60
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(PipelineError, match="bad_input"):
            await mesh.run([1, 2, tiny.config.vocab_size + 5], 4)
        assert loop.time() - t0 < 30
        assert await eventually(lambda: all(svc.kv_tokens_in_use() == 0 for svc in mesh.services))
        assert len(await mesh.run(list(range(5, 15)), 4, rid="r2")) == 4  # still serving


async def test_a_full_cache_is_a_busy_error_not_a_failure(tiny):
    from meshd.pipeline.coordinator.failures import PipelineBusy

    async with Mesh(tiny, 2, max_kv_tokens=64) as mesh:
        with pytest.raises(PipelineBusy, match="retry"):
            await mesh.run(list(range(5, 100)), 4)
        assert len(await mesh.run(list(range(5, 15)), 4, rid="r2")) == 4


async def test_a_request_replays_on_the_new_plan_when_stages_move_under_it(tiny):
    """The stages moved to plan 2 before the coordinator knew: the request pauses, then completes."""
    prompt = list(range(5, 25))
    ref = generate(LocalPipeline.from_source(tiny, 1), prompt, 6).token_ids
    async with Mesh(tiny, 2) as mesh:
        new = Route(2, mesh.route.stages)
        for s in mesh.services:
            await s.deploy(new)
        running = asyncio.create_task(mesh.run(prompt, 6))
        await eventually(lambda: mesh.coord.waiting_on == "dev0", 10,
                         "the request waiting for its first stage to serve plan 1")
        assert not running.done()  # paused, not failed
        mesh.coord.set_route(new)
        assert await asyncio.wait_for(running, 30) == ref


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.9, top_k=50, seed=11)])
async def test_an_answer_survives_a_device_leaving_mid_decode(tiny, sampling):
    """3 devices; the middle one leaves after 5 tokens; the answer continues on 2 devices.

    Greedy and seeded sampling both give exactly the uninterrupted answer: the
    coordinator re-prefills prompt + generated tokens and the new last stage
    skips the random draws the earlier tokens spent.
    """
    prompt = list(range(5, 40))
    ref = generate(LocalPipeline.from_source(tiny, 1), prompt, 24, sampling).token_ids
    async with Mesh(tiny, 3) as mesh:
        got = []
        async for tok in generate_on(mesh.coord, "r", prompt, 24, SamplingSpec(sampling), chunks=2):
            got.append(tok)
            if len(got) == 5:  # dev1 leaves; the leader re-plans over dev0 and dev2
                await mesh.drop_middle()
        assert got == ref
        assert mesh.coord.resumes == 1


async def test_a_device_restarting_on_a_new_port_is_found_again(tiny):
    prompt = list(range(5, 25))
    ref = generate(LocalPipeline.from_source(tiny, 1), prompt, 6).token_ids
    async with Mesh(tiny, 2) as mesh:
        assert await mesh.run(prompt, 6, rid="before") == ref
        old = mesh.services[1]
        await old.close()
        node = TransportNode("dev1b", curve=False)
        mesh.nodes.append(node)
        fresh = StageService(node, "dev1", tiny, mesh.dir.__getitem__)
        mesh.dir["dev1"] = (await fresh.start(), "")  # same node id, new port
        mesh.services[1] = fresh
        await fresh.deploy(mesh.route)
        mesh.coord.stage_restarted("dev1")
        assert await mesh.run(prompt, 6, rid="after") == ref


async def test_when_no_plan_can_serve_the_request_fails_naming_the_device(tiny):
    async with Mesh(tiny, 2) as mesh:
        mesh.coord.token_timeout_s = 1.5
        mesh.coord.resume_timeout_s = 2.0
        mesh.services[0].send_timeout_s = 1.0  # how long a stage may block on a dead successor
        await mesh.services[1].server.close()  # device 1 disappears and nobody re-plans
        with pytest.raises(PipelineError, match="dev1") as err:
            await mesh.run(list(range(5, 15)), 4)
        assert "retry" in str(err.value)
        assert await eventually(lambda: mesh.services[0].sequences() == [])  # its cache was freed


async def test_engine_streams_text_through_the_mesh_and_maps_errors(tiny):
    from meshd.engine.base import GenerationRequest
    from meshd.engine.options import RequestOptions
    from meshd.engine.errors import NoPlan
    from meshd.pipeline.engine import PipelineEngine

    class Tok:  # the tiny model has no tokenizer: ids are their own text
        eos_ids = ()

        def decode(self, ids):
            return " ".join(map(str, ids))

    tiny.__dict__["tokenizer"] = Tok()
    async with Mesh(tiny, 2) as mesh:
        engine = PipelineEngine(tiny, mesh.coord)
        greedy = RequestOptions(sampling=SamplingSpec(SamplingParams(temperature=0.0)))
        req = GenerationRequest("q1", list(range(5, 45)), max_tokens=12, options=greedy)
        ids = [t async for t in engine.token_ids(req)]
        assert ids == generate(LocalPipeline.from_source(tiny, 1), list(range(5, 45)), 12).token_ids
        mesh.coord.set_route(None)
        engine.wait_s = 0.5  # no plan arrives: a bounded wait, then 503 with a retry hint
        with pytest.raises(NoPlan) as err:
            [t async for t in engine.token_ids(GenerationRequest("q2", [1, 2, 3], max_tokens=2))]
        assert err.value.retry_after_s


async def test_last_stage_returns_only_the_requested_top_k_distribution(tiny):
    prompt = list(range(9, 30))
    ref = LocalPipeline.from_source(tiny, 1)
    ref.create("r", 64)
    logits = ref.prefill("r", prompt)[-1]
    want = torch.topk(torch.softmax(logits, -1), 5)
    async with Mesh(tiny, 2) as mesh:
        steps = [s async for s in mesh.coord.steps(StepsRequest("k", prompt, 3, SamplingSpec(), return_topk=5))]
        plain = [s async for s in mesh.coord.steps(StepsRequest("n", prompt, 1, SamplingSpec()))]
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
        await eventually(lambda: mesh.coord.waiting_on is not None, 10, "the wait for plan 2's stages under way")
        mesh.coord.set_route(Route(3, mesh.route.stages))  # membership noticed and re-planned
        with pytest.raises(Exception, match="re-planned"):
            await asyncio.wait_for(waiting, 10)


def test_daemon_cut_points_come_from_the_sequence_partitioner_table():
    import json

    from meshd.pipeline.serving import cut_table_for

    prof = json.loads((ROOT / "profiles" / "x86_64-2core-1thread.json").read_text())
    route = Route(4, (StageEndpoint("a", "", "", 0, 15), StageEndpoint("b", "", "", 15, 30)))
    table = cut_table_for(route, {"a": prof, "b": prof}, 30, "1gbit,1ms")
    cuts = table.lookup(2048)
    assert len(cuts) >= 3 and list(cuts) == sorted(cuts)
    assert cuts[0] > 2048 - cuts[-1]  # early chunks longer: later ones attend to more cached keys
    assert cut_table_for(route, {"a": prof}, 30, "1gbit,1ms") is None  # a member without a profile


def _slow_layers(stage, seconds, times=None):
    """Each layer of a prompt pass (more than one row) on ``stage`` takes ``seconds`` longer, as on a slow
    device (``times``: only the first that many such layers; None: all)."""
    import time as _time

    real, left = stage._layer, [times]

    def slow(kv, li, lw, h, *args):
        if h.shape[0] > 1 and (left[0] is None or left[0] > 0):
            left[0] = None if left[0] is None else left[0] - 1
            _time.sleep(seconds)  # sleep-ok: a layer of a prompt on a slow device (compute thread)
        return real(kv, li, lw, h, *args)

    stage._layer = slow


async def test_a_prompt_far_slower_than_the_token_timeout_is_waited_for_while_its_stages_advance(tiny):
    """The wait follows progress, not an assumed speed: a slow device is not a dead one.

    Before, the first token's wait grew by a constant per prompt token (itself a replacement for a
    fixed 30 s), so a device slower than the constant assumed — Home Assistant's first 2,900-token
    prompt on the recommended 1.5B model — timed out, replayed from scratch and timed out for ever.
    Here every prompt layer takes 0.3 of the token timeout, the prompt several timeouts, and no stage
    is ever silent for a whole timeout: the request completes with no replay.
    """
    prompt = list(range(5, 45))
    async with Mesh(tiny, 2, prefix_share=0, progress_every_s=0.02) as mesh:  # every prompt computed in full
        ref = await mesh.run(prompt, 4, rid="ref")
        mesh.coord.token_timeout_s = 0.5
        for svc in mesh.services:
            _slow_layers(svc.stage, 0.15)
        before, heard = mesh.coord.resumes, mesh.coord.flights.progress_heard
        async with asyncio.timeout(60):
            assert await mesh.run(prompt, 4, rid="slow") == ref
        assert mesh.coord.resumes == before
        assert mesh.coord.flights.progress_heard > heard


async def test_a_stage_that_stops_advancing_is_given_up_on_and_the_request_replays(tiny):
    """The other half: a pass that computes nothing for longer than the token timeout (a stuck
    compute thread) sends no progress, so the coordinator stops waiting and replays the request."""
    prompt = list(range(5, 45))
    async with Mesh(tiny, 2, prefix_share=0, progress_every_s=0.02) as mesh:  # every prompt computed in full
        ref = await mesh.run(prompt, 4, rid="ref")
        mesh.coord.token_timeout_s = 0.4
        _slow_layers(mesh.services[0].stage, 1.5, times=1)  # one layer, once: silent for 1.5 s
        before = mesh.coord.resumes
        async with asyncio.timeout(60):
            assert await mesh.run(prompt, 4, rid="stuck") == ref
        assert mesh.coord.resumes > before


def test_only_a_route_with_a_stage_that_never_reports_progress_keeps_a_budget_per_prompt_token():
    """A release from before ``Cap.PROGRESS`` sends no word during a long prompt: for routes through
    one, the first token's wait still grows with the prompt, as those releases' own coordinators did."""
    from meshd.mesh.caps import OURS, PeerCaps
    from meshd.pipeline.coordinator.flights import LEGACY_PREFILL_S_PER_TOKEN
    from meshd.pipeline.coordinator.service import PipelineCoordinator
    from transport.node import TransportNode

    caps = {"new": OURS, "old": PeerCaps.of({"version": "0.2.0"})}
    coord = PipelineCoordinator(TransportNode("c", curve=False), "c", lambda n: ("", ""), token_timeout_s=30,
                                peer_caps=caps.__getitem__)
    ours = Route(1, (StageEndpoint("new", "", "", 0, 30),))
    mixed = Route(1, (StageEndpoint("new", "", "", 0, 15), StageEndpoint("old", "", "", 15, 30)))
    assert coord.wait_for(ours, 3000) == 30
    assert coord.wait_for(mixed, 3000) == 30 + 2999 * LEGACY_PREFILL_S_PER_TOKEN


async def test_progress_counts_only_from_a_stage_of_the_flights_own_route():
    """Any member may send a StageProgress; only the flight's own stages keep its wait going."""
    from meshd.pipeline.coordinator.failures import Interrupted
    from meshd.pipeline.coordinator.flights import FlightTable
    from meshd.pipeline.seqkey import SeqKeys
    from transport.stage_messages import StageProgress

    table = FlightTable(SeqKeys("coord"), links=None, send_timeout_s=1.0)
    flight = table.open("r", Route(1, (StageEndpoint("dev0", "", "", 0, 30),)))

    async def stranger_keeps_talking():
        while True:
            table.progressed(StageProgress("stranger", [flight.seq], 1))
            await asyncio.sleep(0.01)  # sleep-ok: a member talking every 10 ms, far inside the wait

    talk = asyncio.create_task(stranger_keeps_talking())
    try:
        with pytest.raises(Interrupted):
            async with asyncio.timeout(5):
                await table.next_result(flight, 0.2)
    finally:
        talk.cancel()
    table.progressed(StageProgress("dev0", [flight.seq], 1))
    assert flight.progress_at > 0



async def test_an_answer_replayed_past_a_block_boundary_goes_on_as_one_exact_device(real_source):
    """gguf mode, exact within the mode: a device leaves once prompt + answer cross a whole position
    block. The replay prefills the tokens decoded so far row by row, as they were decoded (a whole
    block's dense path would give them other bits), so every later step's probabilities are the
    uninterrupted answer's, bit for bit, and its tokens one device's."""
    from decoding.batch import EXACT_BLOCK
    from decoding.quant import native

    if not native.available()[0]:
        pytest.skip(f"integer kernels unavailable: {native.available()[1]}")
    tok = real_source.tokenizer
    prompt = tok.apply_chat([{"role": "user", "content": "Write a long story about a lighthouse keeper."}])
    assert len(prompt) < EXACT_BLOCK
    leave_after = EXACT_BLOCK + 24 - len(prompt)  # the replay prefills a whole block and more
    n = leave_after + 8

    async def steps(leave: bool) -> list:
        async with Mesh(real_source, 3, dtype=torch.float32, packed="gguf") as mesh:
            out = []
            async for step in mesh.coord.steps(StepsRequest("r", prompt, n, return_topk=4)):
                out.append((step.token, step.topk_probs))
                if leave and len(out) == leave_after:
                    await mesh.drop_middle()
            assert mesh.coord.resumes == int(leave)
            return out

    ref = generate(LocalPipeline.from_source(real_source, 1, torch.float32, packed="gguf"), prompt, n).token_ids
    uninterrupted, replayed = await steps(False), await steps(True)
    assert [t for t, _ in uninterrupted] == ref
    assert replayed == uninterrupted
