"""Stages in separate OS processes, CURVE on, each pinned to a core: output equals the reference."""

import json

import pytest

from decoding.generate import generate
from decoding.pipeline_local import LocalPipeline, even_split
from decoding.sampling import SamplingSpec
from tests.support.coordinator import generate_on
from tests.support.proc_mesh import ProcessMesh
from tests.support.repo import ROOT

pytestmark = pytest.mark.slow

PROMPTS = [json.loads(line) for line in
           (ROOT / "bench" / "prompts" / "home.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("stages", [2, 3, 4])
async def test_real_model_mesh_is_token_identical_to_single_device(real_source, real_stage, stages):
    tok = real_source.tokenizer
    picks = [PROMPTS[0], PROMPTS[8]] if stages == 2 else [PROMPTS[1 + stages]]
    ref_pipe = LocalPipeline([real_stage])
    async with ProcessMesh(even_split(30, stages), curve=True) as mesh:
        for p in picks:
            ids = tok.apply_chat([{"role": "user", "content": p["prompt"]}])
            want = generate(ref_pipe, ids, 24, eos_ids=tok.eos_ids).token_ids
            got = [t async for t in generate_on(mesh.coord, p["id"], ids, 24, SamplingSpec(), tok.eos_ids,
                                                cuts=[len(ids) // 3, 2 * len(ids) // 3])]
            got = [t for t in got if t not in tok.eos_ids]
            assert got == want, p["id"]


@pytest.mark.parametrize("attention", ["split", "whole"])
async def test_two_stage_processes_as_one_tensor_group_answer_people_at_once_as_the_in_process_group(
        real_source, attention):
    """The harness benchmarks seat their processes in a group with: the route's one stage held by both,
    requests batched through the group, each answer equal to its prompt decoded alone by the same split."""
    import asyncio

    import torch

    from decoding.quant import native
    from tests.support.tensor_group import run_group_many

    ok, why = native.available()
    if not ok:
        pytest.skip(f"integer kernels unavailable: {why}")
    tok = real_source.tokenizer
    prompts = [tok.apply_chat([{"role": "user", "content": p["prompt"]}]) for p in PROMPTS[:3]]
    whole = real_source.load_stage(0, 30, torch.float32, packed="gguf")
    want = [tokens for _, tokens in run_group_many(whole, 2, [torch.tensor(p) for p in prompts], 12, (1.0, 1.0),
                                                    attention=attention)[0]]
    async with ProcessMesh([(0, 30)] * 2, weights="gguf", tensor=attention, heads="none") as mesh:
        assert [len(r.stages) for r in mesh.routes] == [1] and len(mesh.route.stages[0].group) == 2

        async def answer(i, ids):
            return [t async for t in generate_on(mesh.coord, f"g{i}", ids, 12, SamplingSpec())]
        got = await asyncio.gather(*(answer(i, p) for i, p in enumerate(prompts)))
    assert got == want
