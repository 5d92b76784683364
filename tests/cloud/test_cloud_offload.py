"""The home's half of cloud verification: which chunks go up, and a loop that loses nothing.

The verifier here is the real one (``meshd.cloud.verifier``) called in-process, with tiny
random-weight models of one vocabulary as the small and the big model, so the statistics
run in seconds; ``tests/cloud/test_cloud_service.py`` runs the same loop over CURVE sockets.
"""

import asyncio
import random
import struct

import pytest

from decoding.generate import generate
from decoding.offload.local import LocalDrafter
from decoding.offload.loop import VerifierUnavailable, draft_step
from decoding.offload.policy import OffloadPolicy, chunk_importance, p_conf, p_imp
from decoding.pipeline_local import LocalPipeline
from decoding.sampling import SamplingParams
from meshd.cloud.home import draft_seed
from meshd.cloud.verifier import Verifier, VerifierRefusal
from tests.support.stats import chi2_p_value
from tests.support.cloud import InProcess, first_two_law, offload_answer, tiny_pair
from tests.support.waiting import eventually


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_pair(tmp_path_factory)


def run(coro):
    return asyncio.run(coro)


_answer = offload_answer


# ------------------------------------------------------------------ the policy

def test_confidence_and_importance_filters_follow_their_logistics():
    assert p_conf(0.5, 0.8) == 1.0 and p_conf(0.8, 0.8) == 1.0
    assert p_conf(0.8001, 0.8) == pytest.approx(0.993, abs=1e-3) and p_conf(1.0, 0.8) == pytest.approx(0.0067, abs=1e-4)
    assert p_imp(0.05, 0.2) == 0.0 and p_imp(0.25, 0.2) == 1.0
    assert p_imp(0.15, 0.2) == pytest.approx(0.5)  # the middle of the ramp
    assert p_imp(0.1001, 0.2) == pytest.approx(0.0067, abs=1e-3)


def test_chunk_importance_averages_what_later_rows_pay_each_token():
    w = 4
    # Row r (the r-th token's own row) ends at that token: column w-1 is itself.
    rows = [[0.0, 0.0, 0.0, 0.4], [0.0, 0.0, 0.2, 0.3], [0.0, 0.1, 0.1, 0.5]]
    brute = []
    for j in range(3):
        seen = [rows[r][w - 1 - (r - j)] for r in range(j, 3)]
        brute.append(sum(seen) / len(seen))
    assert chunk_importance(rows, w) == pytest.approx(sum(brute) / 3)
    assert chunk_importance([], w) == 0.0


@pytest.mark.parametrize("budget", [0.1, 0.2, 0.5])
def test_the_budget_sets_the_share_of_chunks_offloaded(budget):
    rng, policy = random.Random(5), OffloadPolicy(budget)
    decisions = [policy.decide(rng.random(), rng.lognormvariate(-2, 0.4), 0, 100, rng) for _ in range(3000)]
    assert abs(sum(decisions) / len(decisions) - budget) < 0.05, policy.to_dict()


def test_budget_one_verifies_everything_budget_zero_nothing_and_the_tail_stays_local():
    rng = random.Random(0)
    everything, nothing, tail = OffloadPolicy(1.0), OffloadPolicy(0.0), OffloadPolicy(0.5)
    assert all(everything.decide(0.99, 0.0, 95, 100, rng) for _ in range(50))
    assert not any(nothing.decide(0.1, 9.0, 0, 100, rng) for _ in range(50))
    assert not any(tail.decide(0.1, 9.0, 80, 100, rng) for _ in range(50))  # the last 20 %
    with pytest.raises(ValueError):
        OffloadPolicy(1.5)


def test_a_draft_step_knows_whether_its_support_is_complete():
    assert draft_step(3, [3, 4], [0.7, 0.3]).exact
    full = draft_step(3, list(range(65)), [1 / 65] * 65)
    assert not full.exact and len(full.ids) == 64
    trimmed = draft_step(3, list(range(65)), [0.5, 0.5] + [0.0] * 63)
    assert trimmed.exact and trimmed.ids == (0, 1)


# ------------------------------------------------------------------ lossless verification

def test_budget_one_greedy_is_the_big_models_own_greedy_answer(pair):
    small, big = pair
    prompts = [[1, 2, 3], [17, 5, 99, 42, 8, 8, 150], list(range(40, 70))]

    async def main():
        v = Verifier(big, kv_budget_tokens=4096)
        v.start()
        try:
            for i, p in enumerate(prompts):
                want = generate(LocalPipeline([big]), p, 30).token_ids
                got, stats = await _answer(small, InProcess(v), p, 30, session=i)
                assert got == want
                assert stats.verified == stats.chunks and stats.corrected > 0  # they do disagree
        finally:
            await v.close()
    run(main())


def test_budget_zero_is_the_small_models_answer_and_sends_nothing(pair):
    small, big = pair
    p = [9, 8, 7, 6]

    async def main():
        v = Verifier(big)
        v.start()
        link = InProcess(v)
        try:
            got, stats = await _answer(small, link, p, 20, budget=0.0)
        finally:
            await v.close()
        assert got == generate(LocalPipeline([small]), p, 20).token_ids
        assert link.sent == [] and stats.offloaded == 0
    run(main())


def _first_two(small, big, sampling, n):
    counts: dict[tuple[int, int], int] = {}

    async def main():
        v = Verifier(big, kv_budget_tokens=8192)
        v.start()
        drafter = LocalDrafter(LocalPipeline([small]), SamplingParams(
            sampling.temperature, sampling.top_k, sampling.top_p, draft_seed(12345)))
        try:
            for i in range(n):
                s = SamplingParams(sampling.temperature, sampling.top_k, sampling.top_p, seed=i)
                got, _ = await _answer(small, InProcess(v), [5, 6, 7], 2, sampling=s, session=i,
                                       drafter=drafter, gamma=2, ahead=0)
                counts[tuple(got)] = counts.get(tuple(got), 0) + 1
        finally:
            drafter.close()
            await v.close()
    run(main())
    return counts


_target_two = first_two_law


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=1.0, top_k=5),  # q sent on its support
                                      SamplingParams(temperature=0.8, top_p=0.9)],  # drafts sent as candidates
                         ids=["top_k_rejection", "top_p_candidates"])
def test_budget_one_sampling_keeps_the_big_models_distribution(pair, sampling):
    small, big = pair
    law = _target_two(big, sampling)
    counts = _first_two(small, big, sampling, 1500)
    keys = sorted(law, key=law.get, reverse=True)
    assert set(counts) <= set(law)
    assert chi2_p_value([counts.get(k, 0) for k in keys], [law[k] for k in keys]) > 0.01


# ------------------------------------------------------------------ never stall, never lose a token

class Flaky(InProcess):
    """Answers the first ``good`` requests, then times out (the verifier gone)."""

    def __init__(self, verifier, good):
        super().__init__(verifier)
        self.good = good

    async def verify(self, req, timeout_s=None):
        if len(self.sent) >= self.good:
            self.sent.append(None)
            raise VerifierUnavailable("no verdict within 0.3s")
        return await super().verify(req, timeout_s)


def test_a_verifier_that_vanishes_mid_answer_leaves_a_complete_local_answer(pair):
    small, big = pair
    p = [11, 12, 13]

    async def main():
        v = Verifier(big)
        v.start()
        try:
            return await _answer(small, Flaky(v, good=3), p, 40)
        finally:
            await v.close()
    got, stats = run(main())
    assert len(got) == 40 and stats.verified == 3 and stats.local_fallbacks >= 1
    # Up to the verifier's departure the answer is the big model's.
    want = generate(LocalPipeline([big]), p, 40).token_ids
    assert got[:3] == want[:3]


def test_an_evicted_session_is_resent_and_the_answer_stays_exact(pair):
    small, big = pair
    p = list(range(20, 50))

    async def main():
        v = Verifier(big, kv_budget_tokens=120)  # room for one session (30 + 40 + a margin) at a time
        v.start()
        turns = asyncio.Lock()
        try:
            a = asyncio.create_task(_answer(small, InProcess(v, "home-a", turns), p, 40, session=1))
            b = asyncio.create_task(_answer(small, InProcess(v, "home-b", turns), p[::-1], 40, session=1))
            return await a, await b, v.stats
        finally:
            await v.close()
    (ga, sa), (gb, sb), vstats = run(main())
    assert ga == generate(LocalPipeline([big]), p, 40).token_ids
    assert gb == generate(LocalPipeline([big]), p[::-1], 40).token_ids
    assert vstats.evicted >= 1 and sa.resent + sb.resent >= 1


def test_the_verifier_refuses_malformed_requests_clearly_and_keeps_serving(pair):
    _, big = pair
    from transport.cloud_messages import CloudVerify

    pk = lambda xs: struct.pack(f"<{len(xs)}I", *xs)  # noqa: E731

    async def main():
        v = Verifier(big, max_queue=4)
        v.start()
        bad = [CloudVerify(1, 0, b"\x01\x02\x03", 1, open={}),  # not uint32s
               CloudVerify(1, 0, pk([1, 2]), 0, open={}),  # no drafts
               CloudVerify(1, 0, pk([1, 10 ** 6]), 1, open={}),  # beyond the vocabulary
               CloudVerify(1, 0, pk([1] * 600), 1, open={}),  # beyond the context
               CloudVerify(1, 0, pk([1, 2]), 1, q=[struct.pack("<If", 2, 2.0)], open={"temperature": 1.0}),
               CloudVerify(1, 0, pk([1, 2]), 1, open={"temperature": "hot"}),
               CloudVerify(1, 0, pk([1, 2]), 1, open={"nonsense": 1}),
               CloudVerify(7, 5, pk([1, 2]), 1)]  # never opened
        codes = []
        for m in bad:
            with pytest.raises(VerifierRefusal) as err:
                await v.submit("h", m)
            codes.append(err.value.code)
        ok = await v.submit("h", CloudVerify(2, 0, pk([1, 2, 3]), 1, open={}))
        # A full queue answers busy at once rather than hanging.
        v._queue.extend([object()] * 4)  # type: ignore[list-item]
        with pytest.raises(VerifierRefusal) as err:
            await v.submit("h", CloudVerify(3, 0, pk([1, 2]), 1, open={}))
        v._queue.clear()
        await v.close()
        return codes, ok, err.value.code
    codes, ok, busy = run(main())
    assert codes[:-1] == ["bad_request"] * 7 and codes[-1] == "evicted"
    assert 0 <= ok.accepted <= 1 and busy == "busy"


def test_a_session_reopened_or_closed_while_its_pass_runs_is_freed_once_the_pass_ends(pair):
    _, big = pair
    from transport.cloud_messages import CloudVerify

    pk = lambda xs: struct.pack(f"<{len(xs)}I", *xs)  # noqa: E731

    async def main():
        v = Verifier(big, chunk=8)  # a long prompt fills over many passes
        v.start()
        try:
            long = asyncio.create_task(v.submit("h", CloudVerify(1, 0, pk(list(range(3, 200))), 2,
                                                                 open={"capacity": 256})))
            await eventually(lambda: any(s.busy for s in v._sessions.values()), 30,  # a pass is running
                             "the long prompt's fill to start", longest_interval_s=0.001)
            again = await v.submit("h", CloudVerify(1, 0, pk([5, 6, 7]), 1, open={}))  # the home resends
            with pytest.raises(VerifierRefusal, match="newer request"):
                await long
            other = await v.submit("h2", CloudVerify(4, 0, pk([5, 6, 7]), 1, open={}))
            v.close_session("h", 1)
            v.close_session("h2", 4)
            return again, other, v.kv.reserved_tokens, v.stats.superseded
        finally:
            await v.close()
    again, other, reserved, superseded = run(main())
    assert again.session == 1 and other.session == 4
    assert reserved == 0 and superseded == 1
