"""The home drafts through its mesh for the cloud verifier: rollbacks reach every stage, a device
leaving is survived, and budget 1.0 still gives the big model's own greedy answer."""

import pytest
import torch

from decoding.generate import generate
from decoding.loader import open_model
from decoding.offload.local import LocalDrafter
from decoding.offload.loop import OffloadDecoder
from decoding.offload.policy import OffloadPolicy
from decoding.pipeline_local import LocalPipeline
from decoding.sampling import SamplingParams
from meshd.cloud.verifier import Verifier
from tests.support.models import build_tiny_checkpoint
from tests.support.cloud import InProcess
from tests.support.inprocess import Mesh
from tests.support.waiting import eventually


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    return open_model(tiny_llama[0])


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    path = tmp_path_factory.mktemp("big")
    build_tiny_checkpoint(path, "llama", seed=4)
    src = open_model(path)
    return src.load_stage(0, src.config.num_layers)


async def test_drafting_through_two_stages_equals_drafting_in_process_with_rollbacks(tiny):
    feeds = [(list(range(3, 20)), 0), ([7], 17), ([8], 18), ([9, 10], 19), ([11], 18), ([12], 19), ([4], 5)]
    local = LocalDrafter(LocalPipeline.from_source(tiny, 1))
    want = [local.feed_sync(t, at) for t, at in feeds]
    local.close()
    async with Mesh(tiny, 2) as mesh:
        d = mesh.coord.drafter("d1", 64, SamplingParams())
        try:
            got = [await d.feed(t, at) for t, at in feeds]
        finally:
            await d.close()
        for g, w in zip(got, want):
            assert g.token == w.token and g.ids[:5] == w.ids[:5]
            assert torch.allclose(torch.tensor(g.probs[:5]), torch.tensor(w.probs[:5]), atol=1e-4)
            assert torch.allclose(torch.tensor(g.attention), torch.tensor(w.attention), atol=1e-4)
        assert await eventually(lambda: all(not s.sequences() for s in mesh.services))  # closed: freed


async def test_budget_one_through_the_mesh_is_the_big_models_greedy_answer_even_when_a_device_leaves(tiny, big):
    prompt = list(range(30, 60))
    want = generate(LocalPipeline([big]), prompt, 40).token_ids
    v = Verifier(big)
    v.start()
    try:
        async with Mesh(tiny, 3) as mesh:
            d = mesh.coord.drafter("d2", 128, SamplingParams())
            dec = OffloadDecoder(d, InProcess(v), OffloadPolicy(1.0), 1, seed=0)
            got = []
            try:
                async for t in dec.run(prompt, 40):
                    got.append(t)
                    if len(got) == 10:  # the middle device leaves; the mesh re-plans over the other two
                        await mesh.drop_middle()  # dev1 leaves; the mesh re-plans over dev0 and dev2
            finally:
                await d.close()
            assert got == want
            assert mesh.coord.resumes >= 1
    finally:
        await v.close()
