"""A stage process 50x slower than this CPU: its prompt takes many token timeouts, and the request
completes with no replay, because the coordinator waits on the stage's progress, not on a speed.

The stage process slows itself layer by layer (``stage_proc --slow-layers 50``: each layer of every
pass sleeps 49 times the CPU time it computed for), over real sockets with CURVE on; the coordinator knows
nothing of it.
"""

import asyncio
import json

import pytest

from decoding.sampling import SamplingSpec
from tests.support.coordinator import generate_on
from tests.support.proc_mesh import ProcessMesh
from tests.support.repo import ROOT

pytestmark = pytest.mark.slow


async def test_a_prompt_on_a_stage_slowed_50x_completes_with_no_replay(real_source):
    tok = real_source.tokenizer
    home = [json.loads(line) for line in (ROOT / "bench" / "prompts" / "home.jsonl").read_text().splitlines()]
    ids = tok.apply_chat([{"role": "system", "content": " ".join(p["prompt"] for p in home[:3])},
                          {"role": "user", "content": home[4]["prompt"]}])
    async with ProcessMesh([(0, 15), (15, 30)], curve=True) as fast:
        want = [t async for t in generate_on(fast.coord, "ref", ids, 3, SamplingSpec(), tok.eos_ids)]
    async with ProcessMesh([(0, 15), (15, 30)], curve=True, slow_layers=50, progress_every_s=0.25,
                           prefix_cache=False) as mesh:
        mesh.coord.token_timeout_s = 3.0  # a small fraction of what the slowed prompt takes
        async with asyncio.timeout(600):
            got = [t async for t in generate_on(mesh.coord, "slowed", ids, 3, SamplingSpec(), tok.eos_ids)]
        assert got == want
        assert mesh.coord.resumes == 0, "the slowed prompt was replayed"
        assert mesh.coord.flights.progress_heard >= 5  # it was waited for on the stages' word
