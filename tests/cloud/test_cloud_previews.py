"""Previews of a verifier's verdicts (the early-exit edge–cloud paper): the home drafts ahead from them,
and nothing it commits changes.

Tiny random-weight models of one vocabulary for the exactness and the statistics (fast), and
the real embedded model over CURVE sockets for the protocol: a home that asks, one that
predates previews, a verifier without them, and a verifier that dies after a preview.
"""

import asyncio

import pytest
import torch

from decoding.exits.heads import ExitHeads
from decoding.exits.previews import Preview, PreviewExits
from decoding.generate import generate
from decoding.offload.local import LocalDrafter
from decoding.offload.loop import OffloadDecoder, PreviewSettings, VerifierUnavailable, VerifyResult, draft_step
from decoding.offload.policy import OffloadPolicy
from decoding.pipeline_local import LocalPipeline
from decoding.sampling import SamplingParams
from meshd.cloud.home import draft_seed
from meshd.cloud.verifier import Verifier
from tests.support.cloud import (InProcess, cut_home_model, first_two_law, offload_answer, paired_home,
                                 serve_verifier, tiny_pair)
from tests.support.stats import chi2_p_value

LOW = PreviewSettings(threshold=0.01, max_predrafts=2)  # a tiny model is never sure: take every preview


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """The tiny pair, and preview exits inside the big model."""
    small, big = tiny_pair(tmp_path_factory)
    cfg = big.config
    heads = ExitHeads([2, 4, 5], cfg.hidden_size, torch.arange(cfg.vocab_size - 11), num_layers=cfg.num_layers,
                      vocab_size=cfg.vocab_size)  # untrained: the logit lens, right now and then
    return small, big, PreviewExits(heads, big)


def run(coro):
    return asyncio.run(coro)


_answer = offload_answer


# ------------------------------------------------------------------ the exit's verdict

def test_an_exits_verdict_walks_the_drafts_as_the_final_verdict_does(pair):
    _, big, exits = pair
    hidden = torch.randn(4, big.config.hidden_size, generator=torch.Generator().manual_seed(0))
    z = torch.softmax(exits_logits(exits, 4, hidden), -1)
    assert bool((z.argmax(-1) < exits.other).all())  # seeded: every row's best is on the shortlist
    best = [exits.shortlist[i] for i in z.argmax(-1).tolist()]
    for accepted in range(4):
        wrong = (best[accepted] + 1) % big.config.vocab_size if accepted < 3 else None
        drafts = (best[:accepted] + [wrong] + [0, 0])[:3] if wrong is not None else best[:3]
        p = exits.verdict(4, hidden, drafts)
        assert (p.accepted, p.token, p.layer) == (accepted, best[accepted], 4)
        assert p.confidence == pytest.approx(float(z.max(-1).values[:accepted + 1].min()), abs=1e-6)
    with pytest.raises(ValueError, match="root's row"):
        exits.verdict(4, hidden, [1])


def exits_logits(exits, layer, hidden):
    from decoding.exits.heads import exit_logits

    h, j = exits.heads, exits.heads.layers.index(layer)
    with torch.no_grad():
        return exit_logits(hidden, h.w[j], h.b[j], h.other_w[j], h.other_b[j], exits.final_norm, exits.rows,
                           exits.eps)


# ------------------------------------------------------------------ lossless

@pytest.mark.parametrize("budget", [1.0, 0.4])
def test_previews_on_give_every_prompt_the_tokens_of_previews_off_and_pre_drafts_are_taken(pair, budget):
    small, big, exits = pair
    prompts = [[5, 6, 7], [100, 3, 17, 42], [9] * 6, [150, 151, 152, 7, 8]]

    async def main():
        v = Verifier(big, previews=exits)
        v.start()
        try:
            out = []
            for i, p in enumerate(prompts):
                off, _ = await _answer(small, InProcess(v), p, 40, budget, session=2 * i)
                on, stats = await _answer(small, InProcess(v), p, 40, budget, session=2 * i + 1, previews=LOW)
                out.append((off, on, stats))
            return out, v.stats
        finally:
            await v.close()
    results, vstats = run(main())
    for off, on, _ in results:
        assert on == off
    total = {k: sum(getattr(s, k) for *_, s in results) for k in ("previews", "predrafts", "predraft_hits")}
    if budget == 1.0:  # every chunk verified: previews came, and some pre-drafts were the verdict's, some not
        assert total["previews"] > 0 and vstats.previews >= total["previews"]
        assert 0 < total["predraft_hits"] < total["predrafts"]


def test_budget_one_sampling_with_previews_keeps_the_big_models_distribution(pair):
    small, big, exits = pair
    law = first_two_law(big, SamplingParams(temperature=1.0, top_k=5))
    counts: dict = {}

    async def main():
        v = Verifier(big, kv_budget_tokens=8192, previews=exits)
        v.start()
        drafter = LocalDrafter(LocalPipeline([small]), SamplingParams(1.0, 5, 1.0, draft_seed(12345)))
        used = 0
        try:
            for i in range(1200):
                s = SamplingParams(1.0, 5, 1.0, seed=i)
                got, stats = await _answer(small, InProcess(v), [5, 6, 7], 2, sampling=s, session=i, drafter=drafter,
                                           gamma=1, ahead=0, previews=LOW)
                counts[tuple(got)] = counts.get(tuple(got), 0) + 1
                used += stats.predrafts
        finally:
            drafter.close()
            await v.close()
        return used
    used = run(main())
    assert used > 100  # previews really steered the drafting
    keys = sorted(law, key=law.get, reverse=True)
    assert set(counts) <= set(law)
    assert chi2_p_value([counts.get(k, 0) for k in keys], [law[k] for k in keys]) > 0.01


# ------------------------------------------------------------------ a preview is only a hint

class Scripted:
    """A verifier that previews a verdict, then gives another (or none): what a home must survive."""

    def __init__(self, preview: Preview, verdict: VerifyResult | None):
        self.preview, self.verdict, self.sent = preview, verdict, []

    available = True

    def offers_previews(self):
        return True

    async def verify(self, req, timeout_s=None, on_preview=None):
        self.sent.append(req)
        if on_preview is not None and len(self.sent) == 1:
            on_preview(self.preview)
        await asyncio.sleep(0.05)  # sleep-ok: the verifier's last layers, while the home pre-drafts
        if self.verdict is None or len(self.sent) > 1:
            raise VerifierUnavailable("the verifier is gone")
        return self.verdict

    async def close_session(self, session):
        pass


class Counting:
    """A drafter that always proposes the last fed token + 1 (mod 200), and counts what it was fed."""

    def __init__(self):
        self.fed = []

    async def feed(self, tokens, at):
        self.fed.append((list(tokens), at))
        t = (tokens[-1] + 1) % 200
        return draft_step(t, [t], [1.0])


def test_a_wrong_preview_never_leaks_a_token_and_its_pre_draft_is_thrown_away():
    async def main():
        v = Scripted(Preview(layer=3, accepted=1, token=199, confidence=0.9), VerifyResult(2, 77))
        dec = OffloadDecoder(Counting(), v, OffloadPolicy(1.0), 1, seed=0, previews=PreviewSettings(0.5, 2))
        out = [t async for t in dec.run([10], 8)]
        return out, dec.stats
    out, stats = run(main())
    # The verdict: drafts 11, 12 accepted, then 77; the preview's 199 after 11 never appears.
    assert out[:3] == [11, 12, 77] and 199 not in out
    assert out[3:] == [78, 79, 80, 81, 82]  # drafting went on from the verdict's token
    assert stats.previews == 1 and stats.predrafts == 1 and stats.predraft_hits == 0


def test_a_right_preview_has_the_next_chunk_ready_when_the_verdict_comes():
    async def main():
        v = Scripted(Preview(layer=3, accepted=1, token=50, confidence=0.9), VerifyResult(1, 50))
        drafter = Counting()
        dec = OffloadDecoder(drafter, v, OffloadPolicy(1.0), 1, seed=0, ahead=0, previews=PreviewSettings(0.5, 2))
        out = [t async for t in dec.run([10], 6)]
        return out, dec.stats, drafter.fed
    out, stats, fed = run(main())
    assert out == [11, 50, 51, 52, 53, 54]
    assert stats.predraft_hits == 1 and stats.predraft_tokens == 4 and stats.predraft_rounds == 1
    # the pre-draft fed 50 right after 11 (position 2) while the verdict was out
    assert ([50], 2) in fed


def test_a_verifier_gone_after_a_preview_leaves_the_drafter_on_the_drafted_path():
    async def main():
        v = Scripted(Preview(layer=3, accepted=0, token=120, confidence=0.9), None)
        drafter = Counting()
        dec = OffloadDecoder(drafter, v, OffloadPolicy(1.0), 1, seed=0, previews=PreviewSettings(0.5, 2))
        out = [t async for t in dec.run([10], 12)]
        return out, dec.stats, drafter.fed
    out, stats, fed = run(main())
    assert out == list(range(11, 23))  # the drafts, committed locally: the preview's 120 nowhere
    assert stats.local_fallbacks >= 1 and stats.predrafts == 1
    # the pre-draft moved the drafter (120 at position 1); it was put back on the drafted path token by token
    # (a float drafter's rows are fed one at a time, as with previews off), before it drafted on
    moved = fed.index(([120], 1))
    back = fed.index(([11], 1), moved)
    assert fed[back:back + 12] == [([t], t - 10) for t in range(11, 23)]


def test_a_sampled_request_asks_a_verifier_without_previews_for_none(pair):
    small, big, _ = pair

    async def main():
        v = Verifier(big)
        v.start()
        link = InProcess(v)
        try:
            await _answer(small, link, [5, 6, 7], 8, sampling=SamplingParams(1.0, 5, 1.0, seed=3), previews=LOW)
        finally:
            await v.close()
        return link.sent
    sent = run(main())
    assert sent and all(m.previews == 0.0 for m in sent)


def test_previews_need_a_threshold_and_a_pre_draft():
    with pytest.raises(ValueError):
        PreviewSettings(threshold=0.0)
    with pytest.raises(ValueError):
        PreviewSettings(max_predrafts=0)


def test_a_greedy_answer_with_previews_equals_the_big_models_own(pair):
    small, big, exits = pair

    async def main():
        v = Verifier(big, previews=exits)
        v.start()
        try:
            return await _answer(small, InProcess(v), [33, 34, 35], 30, previews=LOW)
        finally:
            await v.close()
    got, stats = run(main())
    assert got == generate(LocalPipeline([big]), [33, 34, 35], 30).token_ids
    assert stats.previews > 0


# ------------------------------------------------------------------ over CURVE, the real model

@pytest.fixture(scope="module")
def drafter_stage(real_stage):
    return cut_home_model(real_stage)


class Recorded:
    """A home's link that notes where the last verdict left the answer (the context's length after it),
    and can close the verifier at its first preview."""

    def __init__(self, link, on_first_preview=None):
        self.link, self.on_first_preview, self.after_verdict, self.previews = link, on_first_preview, None, 0

    @property
    def available(self):
        return self.link.available

    def offers_previews(self):
        return self.link.offers_previews()

    async def verify(self, req, timeout_s=None, on_preview=None):
        def seen(p):
            self.previews += 1
            if self.previews == 1 and self.on_first_preview is not None:
                self.on_first_preview()
            if on_preview is not None:
                on_preview(p)
        res = await self.link.verify(req, timeout_s, seen)
        self.after_verdict = req.start + len(req.tokens) - req.drafts + res.accepted + 1
        return res

    async def close_session(self, session):
        await self.link.close_session(session)


@pytest.mark.slow
def test_a_home_pre_drafts_from_a_real_verifiers_previews_and_answers_with_the_big_models_tokens(
        real_source, real_stage, drafter_stage, tmp_path):
    tok = real_source.tokenizer
    prompt = tok.apply_chat([{"role": "user", "content": "Name three farm animals and what they eat."}])
    want = generate(LocalPipeline([real_stage]), prompt, 32, eos_ids=tok.eos_ids).token_ids

    async def main():
        svc = await serve_verifier(real_source, real_stage, tmp_path)
        node, link, _ = await paired_home(svc, real_source, tmp_path)
        drafter = LocalDrafter(LocalPipeline([drafter_stage]))
        try:
            assert await link.hello() == [23, 26, 29]  # the shipped exits of the embedded model
            off = OffloadDecoder(drafter, link, OffloadPolicy(0.5), 6, eos_ids=frozenset(tok.eos_ids), seed=0)
            half_off = [t async for t in off.run(prompt, 32)]
            half = OffloadDecoder(drafter, link, OffloadPolicy(0.5), 8, eos_ids=frozenset(tok.eos_ids), seed=0,
                                  previews=PreviewSettings(0.3, 2))
            half_on = [t async for t in half.run(prompt, 32)]
            dec = OffloadDecoder(drafter, link, OffloadPolicy(1.0), 7, eos_ids=frozenset(tok.eos_ids), seed=0,
                                 previews=PreviewSettings(0.3, 2))
            got = [t async for t in dec.run(prompt, 32)]
            return got, dec.stats, link.status(), svc.status(), half_off, half_on
        finally:
            drafter.close()
            await node.close()
            await svc.close()
    got, stats, link, server, half_off, half_on = run(main())
    assert got == want  # every chunk verified: the big model's own answer, as with previews off
    assert half_on == half_off  # half the chunks verified: previews on or off, the same tokens
    assert stats.previews > 0 and server["previews"] >= link["previews"] >= stats.previews
    assert stats.predraft_rounds > 0 and stats.to_dict()["predraft_hit_rate"] >= 0.0
    assert link["previews_at"] == [23, 26, 29]


@pytest.mark.slow
def test_a_home_that_predates_previews_never_gets_one_and_a_verifier_without_them_says_so(
        real_source, real_stage, tmp_path):
    import struct

    from transport.cloud_messages import CloudPreview, CloudVerdict, CloudVerify
    from transport.messages import ErrorReply

    tok = real_source.tokenizer
    prompt = tok.apply_chat([{"role": "user", "content": "Say hello."}])
    drafts = generate(LocalPipeline([real_stage]), prompt, 4).token_ids

    async def main():
        svc = await serve_verifier(real_source, real_stage, tmp_path)
        node, link, _ = await paired_home(svc, real_source, tmp_path)
        pushed = []
        link.peer.on_message = lambda env: pushed.append(env.message)  # what an older home's peer would see
        try:
            body = struct.pack(f"<{len(prompt) + 4}I", *prompt, *drafts)
            old = await link.peer.request(CloudVerify(1, 0, body, 4, None, {}), timeout=30)
            await asyncio.sleep(0.2)  # sleep-ok: a preview pushed late would arrive by now
            silent = list(pushed)
            new = await link.peer.request(CloudVerify(2, 0, body, 4, None, {}, 1), timeout=30)
            return old, silent, new, list(pushed)
        finally:
            await node.close()
            await svc.close()
    old, silent, new, pushed = run(main())
    assert isinstance(old, CloudVerdict) and silent == []
    assert isinstance(new, CloudVerdict) and (new.accepted, new.token) == (old.accepted, old.token)
    assert pushed and all(isinstance(m, CloudPreview) and m.session == 2 for m in pushed)

    async def without(previews):
        svc = await serve_verifier(real_source, real_stage, tmp_path / str(previews), previews=previews)
        node, link, _ = await paired_home(svc, real_source, tmp_path / str(previews))
        try:
            return await link.hello(), link.offers_previews()
        finally:
            await node.close()
            await svc.close()
    assert run(without(None)) == ([], False)

    async def predating():  # a verifier from before previews answers the hello with an error
        from transport.node import TransportNode

        async with TransportNode("old-verifier", curve=False) as server_node, \
                TransportNode("home", curve=False) as home_node:
            server = await server_node.serve(lambda msg, req: _unknown(msg), "tcp://127.0.0.1:0")
            peer = await home_node.connect(server.address, timeout=5.0)
            from meshd.cloud.link import CloudLink

            link = CloudLink(peer, server.address)
            return await link.hello(), link.offers_previews()

    async def _unknown(msg):
        return ErrorReply("unknown_type", f"a verifier does not handle {type(msg).__name__}")
    assert run(predating()) == ([], False)


@pytest.mark.slow
def test_a_verifier_that_dies_after_a_preview_leaves_the_home_drafting_normally(
        real_source, real_stage, drafter_stage, tmp_path):
    tok = real_source.tokenizer
    prompt = tok.apply_chat([{"role": "user", "content": "Describe a quiet morning in a small village."}])

    async def main():
        svc = await serve_verifier(real_source, real_stage, tmp_path)
        node, link, _ = await paired_home(svc, real_source, tmp_path, min_timeout_s=2.0)
        await link.hello()
        closing = []
        rec = Recorded(link, on_first_preview=lambda: closing.append(asyncio.ensure_future(svc.close())))
        drafter = LocalDrafter(LocalPipeline([drafter_stage]))
        try:
            dec = OffloadDecoder(drafter, rec, OffloadPolicy(1.0), 9, eos_ids=frozenset(), seed=0,
                                 previews=PreviewSettings(0.01, 2))
            out = [t async for t in dec.run(prompt, 40)]
            return out, dec.stats, rec.after_verdict
        finally:
            drafter.close()
            await asyncio.gather(*closing)
            await node.close()
            await svc.close()
    out, stats, after = run(main())
    assert len(out) == 40 and stats.previews >= 1 and stats.local_fallbacks >= 1
    # From the last verdict on, the answer is the home model's own greedy continuation: the pre-draft that
    # moved the drafter left no trace in its cache.
    done = (after or len(prompt)) - len(prompt)
    rest = generate(LocalPipeline([drafter_stage]), prompt + out[:done], 40 - done).token_ids
    assert out[done:] == rest


# ------------------------------------------------------------------ visible

def test_meshd_status_and_metrics_show_what_previews_did():
    from meshd.commands.status_extras import cloud_line
    from tests.support.api import STATUS, FakeEngine, ServerThread
    from tests.support.clients import metrics

    cloud = {"model": "qwen2.5-coder-1.5b-instruct", "budget": 1.0,
             "previews": {"max_predrafts": 2, "threshold": 0.6},
             "link": {"address": "tcp://10.0.0.9:5730", "state": "connected", "rounds": 40, "rtt_ms": 212.0,
                      "previews_at": [11, 15, 20, 24], "previews": 57},
             "totals": {"chunks": 40, "offloaded": 40, "accepted": 101, "drafted": 160, "local_fallbacks": 0,
                        "previews": 57, "predrafts": 22, "predraft_rounds": 20, "predraft_hits": 13,
                        "predraft_saved_s": 1.25, "predraft_hit_rate": 0.65}}
    line = cloud_line({"cloud": cloud})
    assert line.endswith("; previews: 57 received, 13 of 20 pre-drafted rounds hit, 1.2 s of drafting saved"), line
    with ServerThread(FakeEngine(), status={**STATUS, "stage": {"layers": [0, 28], "cloud": cloud}}) as srv:
        m = metrics(srv)
    assert m["meshd_cloud_previews_total"] == {(): 57.0}
    assert m["meshd_cloud_predraft_hits_total"] == {(): 13.0}
    assert m["meshd_cloud_predraft_rounds_total"] == {(): 20.0}
    assert m["meshd_cloud_predraft_hit_rate"] == {(): 0.65}
    assert m["meshd_cloud_predraft_saved_seconds_total"] == {(): 1.25}


@pytest.mark.slow
def test_a_gguf_verifier_checks_its_exits_on_the_heads_own_blocks_of_the_shortlist(real_source):
    """The check reads the shortlisted head rows in their quantized blocks (a fifth of the bytes), and gives
    the float rows' verdicts."""
    from decoding.exits.heads import exit_logits
    from meshd.model.heads import embedded_exits

    cfg = real_source.config
    stage = real_source.load_stage(0, cfg.num_layers, torch.float32, packed="gguf")
    heads = embedded_exits(num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size)
    exits = PreviewExits(heads, stage)
    assert not isinstance(exits.rows, torch.Tensor)  # the head's blocks, not widened rows
    hidden = torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(1)) * 4
    j = heads.layers.index(26)
    with torch.no_grad():
        args = (hidden, heads.w[j], heads.b[j], heads.other_w[j], heads.other_b[j], exits.final_norm)
        blocks = exit_logits(*args, exits.rows, exits.eps)
        floats = exit_logits(*args, heads.head_rows(stage.lm_head, torch.float32), exits.eps)
    assert torch.allclose(blocks, floats, atol=0.05 * float(floats.abs().max()))
    assert torch.equal(blocks.argmax(-1), floats.argmax(-1))
