"""A benchmark's cold section that the prefix cache answered is refused, not printed as a prefill.

Real stage processes (the ones the benchmarks time), the embedded model, its own counters."""

import pytest

from bench._cold import CacheGuard, CacheHit, unseen
from decoding.sampling import SamplingSpec
from tests.support.coordinator import generate_on
from tests.support.proc_mesh import ProcessMesh

pytestmark = pytest.mark.slow


async def _answer(mesh, rid, ids, cuts=()):
    return [t async for t in generate_on(mesh.coord, rid, ids, 2, SamplingSpec(), (), cuts=list(cuts))]


async def test_a_cold_section_that_reused_a_cached_prompt_fails_the_run(real_source):
    ids = real_source.tokenizer.encode("The kitchen light turned on at 07:02. " * 12)
    async with ProcessMesh([(0, 15), (15, 30)]) as mesh:
        guard = CacheGuard(mesh.reused_tokens)
        async with guard.cold("first run of the prompt"):
            await _answer(mesh, "a", ids)
        with pytest.raises(CacheHit, match="reused .* cached prompt positions"):
            async with guard.cold("the same prompt again"):
                await _answer(mesh, "b", ids)
        # the same prompt made unseen (its first token replaced): cold again, same length
        fresh = unseen(ids, 1, real_source.config.vocab_size)
        assert len(fresh) == len(ids)
        async with guard.cold("the prompt made unseen"):
            await _answer(mesh, "c", fresh, cuts=[len(fresh) // 2])
        async with guard.warm("a warm request, where warm is the subject") as warm:
            await _answer(mesh, "d", ids)
    assert warm.reused_tokens > 0
    assert guard.summary()["cold_sections"] == 3 and guard.summary()["warm_reused_tokens"] == warm.reused_tokens


async def test_with_the_prefix_cache_off_the_same_prompt_stays_cold(real_source):
    ids = real_source.tokenizer.encode("The front door was locked at 22:15. " * 12)
    async with ProcessMesh([(0, 30)], prefix_cache=False) as mesh:
        guard = CacheGuard(mesh.reused_tokens)
        for rid in ("a", "b"):
            async with guard.cold(f"run {rid}"):
                await _answer(mesh, rid, ids)
    assert guard.summary()["cold_reused_tokens"] == 0
