"""The verifier as a home meets it: a CURVE endpoint, pairing with a token, a link that times out.

Real sockets on loopback, the real embedded model on both sides (the protocol and the
losslessness do not care that the two models are the same; the benchmark uses a real pair).
"""

import asyncio
import struct

import pytest

from decoding.generate import generate
from decoding.offload.local import LocalDrafter
from decoding.offload.loop import OffloadDecoder
from decoding.offload.policy import OffloadPolicy
from decoding.pipeline_local import LocalPipeline
from decoding.speculative.draft_model import tokenizer_fingerprint
from meshd.cloud.link import CloudLink
from meshd.cloud.pairing import create_cloud_invite, pair_with_cloud
from meshd.mesh.pairing import PairingError
from meshd.state import StateDir
from transport.cloud_messages import CloudVerify
from transport.errors import AuthenticationRefused, RemoteError, TransportTimeout
from transport.node import TransportNode
from tests.support.cloud import cut_home_model, paired_home, serve_verifier
from tests.support.waiting import eventually

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def drafter_stage(real_stage):
    return cut_home_model(real_stage)


def test_a_paired_home_gets_the_big_models_greedy_answer_over_curve(real_source, real_stage, drafter_stage,
                                                                    tmp_path):
    tok = real_source.tokenizer
    prompt = tok.apply_chat([{"role": "user", "content": "Name three farm animals."}])
    want = generate(LocalPipeline([real_stage]), prompt, 24, eos_ids=tok.eos_ids).token_ids

    async def main():
        svc = await serve_verifier(real_source, real_stage, tmp_path)
        node, link, info = await paired_home(svc, real_source, tmp_path)
        drafter = LocalDrafter(LocalPipeline([drafter_stage]))
        try:
            dec = OffloadDecoder(drafter, link, OffloadPolicy(1.0), 7, eos_ids=frozenset(tok.eos_ids), seed=0)
            got = [t async for t in dec.run(prompt, 24)]
            return got, dec.stats, link.status(), svc.status(), info
        finally:
            drafter.close()
            await node.close()
            await svc.close()
    got, stats, link, server, info = asyncio.run(main())
    assert got == want
    assert stats.verified == stats.chunks and stats.accepted > 0
    assert link["state"] == "connected" and link["uplink_bytes_per_round"] <= 50 + 4 * 8  # a few uncached tokens
    assert server["verified"] >= stats.verified and server["homes_admitted"] == 1
    assert info["model"] and info["address"].startswith("tcp://127.0.0.1:")


def test_an_unpaired_home_is_refused_at_the_handshake_and_a_token_pairs_once(real_source, real_stage, tmp_path):
    async def main():
        svc = await serve_verifier(real_source, real_stage, tmp_path)
        stranger = StateDir(tmp_path / "stranger").ensure()
        node = TransportNode("stranger", keypair=stranger.keypair(), allowlist=stranger.allow_list())
        await node.start()
        try:
            peer = await node.connect(svc.address, server_key=svc.state.keypair().public, timeout=3.0)
            with pytest.raises((AuthenticationRefused, TransportTimeout)):
                await peer.request(CloudVerify(1, 0, struct.pack("<2I", 1, 2), 1, open={}), timeout=3.0)
            assert svc.verifier.stats.requests == 0  # not a byte of work got through
            token, _ = create_cloud_invite(svc.state, ["127.0.0.1"], svc.pairing_port, 60)
            fp = tokenizer_fingerprint(real_source.tokenizer)
            with pytest.raises(PairingError, match="tokenizer"):
                await pair_with_cloud("127.0.0.1", token, "h1", "x", [stranger.keypair().public.decode()], "other")
            await pair_with_cloud("127.0.0.1", token, "h1", "x", [stranger.keypair().public.decode()], fp)
            with pytest.raises(PairingError, match="unknown, used or expired"):
                await pair_with_cloud("127.0.0.1", token, "h1", "x", [stranger.keypair().public.decode()], fp)
        finally:
            await node.close()
            await svc.close()
    asyncio.run(main())


def test_a_paired_member_vouches_for_a_device_that_joined_the_home_later_and_no_one_else_can(
        real_source, real_stage, tmp_path):
    from meshd.cloud.home import CloudHome
    from meshd.cloud.pairing import MAX_KEYS
    from transport.keys import Keypair

    async def main():
        svc = await serve_verifier(real_source, real_stage, tmp_path)
        node, link, info = await paired_home(svc, real_source, tmp_path)
        newcomer = StateDir(tmp_path / "newcomer").ensure()
        new_key = newcomer.keypair().public.decode()
        nodes = [node]
        try:
            late = TransportNode("late", keypair=newcomer.keypair(), allowlist=newcomer.allow_list())
            await late.start()
            nodes.append(late)
            late_peer = await late.connect(info["address"], server_key=info["server_key"], timeout=3.0)
            with pytest.raises((AuthenticationRefused, TransportTimeout)):  # not admitted yet
                await late_peer.request(CloudVerify(5, 0, struct.pack("<2I", 1, 2), 1, open={}), timeout=3.0)

            home = CloudHome(link)
            own = StateDir(tmp_path / "home").keypair().public.decode()
            assert await home.admit([own, new_key], 10) == 1
            assert await home.admit([own, new_key], 10) == 0  # idempotent
            with pytest.raises(RemoteError) as err:
                await home.admit(["not a key"], 10)
            refusals = [err.value.code]
            too_many = [Keypair.generate().public.decode() for _ in range(MAX_KEYS)]
            with pytest.raises(RemoteError) as err:
                await home.admit(too_many, 10)
            refusals.append(err.value.code)

            # The newcomer now passes the handshake (ZeroMQ retries it) and gets verdicts ...
            late_link = CloudLink(await late.connect(info["address"], server_key=info["server_key"], timeout=5.0),
                                  info["address"])
            verdict = await late_link.peer.request(CloudVerify(6, 0, struct.pack("<2I", 1, 2), 1, open={}),
                                                   timeout=60)
            # ... but vouching is for members of a paired home: a key admitted otherwise cannot.
            svc.state.allow_list().add(Keypair.generate().public, "operator")
            outsider = StateDir(tmp_path / "outsider").ensure()
            svc.state.allow_list().add(outsider.keypair().public, "operator")
            out_node = TransportNode("out", keypair=outsider.keypair(), allowlist=outsider.allow_list())
            await out_node.start()
            nodes.append(out_node)
            with pytest.raises(RemoteError) as err:
                await CloudHome(CloudLink(await out_node.connect(info["address"], server_key=info["server_key"],
                                                                 timeout=5.0))).admit([Keypair.generate().public.decode()], 10)
            refusals.append(err.value.code)
            # Nor can another paired home take this home's keys over (or claim the operator's).
            other_node, other_link, _ = await paired_home(svc, real_source, tmp_path, name="other")
            nodes.append(other_node)
            for victim in (own, outsider.keypair().public.decode()):
                with pytest.raises(RemoteError) as err:
                    await CloudHome(other_link).admit([victim], 10)
                refusals.append(err.value.code)
            labels = {svc.state.allow_list().name_of(k) for k in (own, new_key)}
            return verdict, refusals, labels
        finally:
            for n in nodes:
                await n.close()
            await svc.close()
    verdict, refusals, labels = asyncio.run(main())
    assert verdict.session == 6
    assert refusals == ["bad_request", "bad_request", "forbidden", "forbidden", "forbidden"]
    assert len(labels) == 1 and labels.pop().startswith("home ")  # admitted under the same home


def test_malformed_and_oversized_requests_get_clear_errors_and_others_are_still_served(real_source, real_stage,
                                                                                      tmp_path):
    async def main():
        svc = await serve_verifier(real_source, real_stage, tmp_path)
        node, link, _ = await paired_home(svc, real_source, tmp_path)
        peer = link.peer
        pk = lambda xs: struct.pack(f"<{len(xs)}I", *xs)  # noqa: E731
        try:
            errors = []
            for msg in (CloudVerify(1, 0, b"\x00" * 7, 1, open={}),
                        CloudVerify(1, 0, pk([1] * 9000), 1, open={}),
                        CloudVerify(1, 0, pk([1, 2]), 99, open={})):
                with pytest.raises(RemoteError) as err:
                    await peer.request(msg, timeout=10)
                errors.append(err.value.code)
            with pytest.raises(RemoteError) as err:  # over the link's size limit: refused before decoding
                await peer.request(CloudVerify(1, 0, b"\x00" * (600 * 1024), 1), timeout=10)
            errors.append(err.value.code)
            ok = await peer.request(CloudVerify(2, 0, pk([1, 2, 3]), 1, open={}), timeout=30)
            return errors, ok
        finally:
            await node.close()
            await svc.close()
    errors, ok = asyncio.run(main())
    assert errors[:3] == ["bad_request"] * 3 and errors[3] == "protocol"
    assert ok.session == 2


def test_the_verifier_dying_mid_answer_leaves_a_complete_answer_and_the_link_comes_back_with_it(
        real_source, real_stage, drafter_stage, tmp_path):
    tok = real_source.tokenizer
    prompt = tok.apply_chat([{"role": "user", "content": "Describe a quiet morning in a small village."}])

    async def main():
        svc = await serve_verifier(real_source, real_stage, tmp_path)
        port = svc.port
        node, link, _ = await paired_home(svc, real_source, tmp_path, min_timeout_s=2.0)
        drafter = LocalDrafter(LocalPipeline([drafter_stage]))
        dec = OffloadDecoder(drafter, link, OffloadPolicy(1.0), 9, eos_ids=frozenset(), seed=0)
        out = []
        try:
            async for t in dec.run(prompt, 60):
                out.append(t)
                if len(out) == 12:
                    await svc.close()  # the cloud goes away mid-answer
            down = link.status()
            # It restarts (same state, same port); once the backoff has passed the link finds it again.
            svc = await serve_verifier(real_source, real_stage, tmp_path, port=port)
            await eventually(lambda: link.available, 60, "the link to retry and find the cloud again")
            dec2 = OffloadDecoder(drafter, link, OffloadPolicy(1.0), 10, eos_ids=frozenset(), seed=0)
            again = [t async for t in dec2.run(prompt, 16)]
            return out, dec.stats, down, again, dec2.stats, link.status()
        finally:
            drafter.close()
            await node.close()
            await svc.close()
    out, stats, down, again, stats2, up = asyncio.run(main())
    assert len(out) == 60  # finished, locally, without an error
    assert stats.verified >= 1 and stats.local_fallbacks >= 1
    assert down["state"] != "connected" and down["last_error"]
    assert len(again) == 16 and stats2.verified == stats2.chunks and up["state"] == "connected"
