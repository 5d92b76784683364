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
