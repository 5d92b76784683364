"""CURVE keys, the allow-list, and admission: only allow-listed peers reach a stage."""

from __future__ import annotations

import asyncio
import os
import stat

import pytest
import zmq
import zmq.asyncio

from transport.auth import CurveAuthenticator
from transport.errors import AuthenticationRefused, KeyStoreError, TransportError, TransportTimeout
from transport.keys import AllowList, Keypair, fingerprint, load_or_create_keypair
from transport.link import StageServer
from transport.peer import Peer
from transport.messages import Ack, encode
from transport.node import TransportNode
from tests.support.logs import all_log_events
from tests.support.waiting import eventually
from tests.support.repo import ROOT
from transport.stage_messages import FreeSequence

pytestmark = pytest.mark.timeout(60)


# ------------------------------------------------------------------ key store


def test_keypair_is_created_once_and_kept_private(tmp_path):
    kp = load_or_create_keypair(tmp_path)
    again = load_or_create_keypair(tmp_path)
    assert kp == again and len(kp.public) == 40 and len(kp.secret) == 40
    keys = tmp_path / "keys"
    assert stat.S_IMODE(keys.stat().st_mode) == 0o700
    assert stat.S_IMODE((keys / "node.key_secret").stat().st_mode) == 0o600
    assert kp.secret.decode() not in repr(kp)
    # readable with pyzmq's own certificate loader
    assert zmq.auth.load_certificate(keys / "node.key")[0] == kp.public


def test_secret_key_readable_by_others_is_refused(tmp_path):
    load_or_create_keypair(tmp_path)
    os.chmod(tmp_path / "keys" / "node.key_secret", 0o644)
    with pytest.raises(KeyStoreError, match="readable by others"):
        load_or_create_keypair(tmp_path)


def test_fingerprint_is_short_stable_and_distinct():
    a, b = Keypair.generate(), Keypair.generate()
    assert fingerprint(a.public) == fingerprint(a.public.decode()) == a.fingerprint
    assert fingerprint(a.public) != fingerprint(b.public)
    assert len(a.fingerprint) == 19 and a.fingerprint.count("-") == 3
    with pytest.raises(KeyStoreError):
        fingerprint("not a key")


def test_allow_list_add_contains_remove_and_persist(tmp_path):
    al = AllowList.for_state_dir(tmp_path)
    a, b = Keypair.generate(), Keypair.generate()
    assert a.public not in al and len(al) == 0
    al.add(a.public, "laptop")
    assert a.public in al and a.public.decode() in al and b.public not in al
    assert al.name_of(a.public) == "laptop"
    reopened = AllowList.for_state_dir(tmp_path)
    assert reopened.keys() == [a.public]
    assert reopened.remove(a.public) and not reopened.remove(a.public)
    assert a.public not in al  # the first instance sees the other's change
    with pytest.raises(KeyStoreError):
        al.add(b"short")
    assert "garbage" not in al


def test_corrupt_allow_list_is_an_error_not_an_open_door(tmp_path):
    al = AllowList.for_state_dir(tmp_path)
    al.add(Keypair.generate().public)
    al.path.write_text("{not json")
    with pytest.raises(KeyStoreError, match="cannot read allow-list"):
        al.keys()


# ------------------------------------------------------------------ admission


class Stage:
    def __init__(self):
        self.calls = []

    async def __call__(self, msg, req):
        self.calls.append(req)
        return Ack(detail=req.peer_key)


@pytest.fixture
async def home(tmp_path):
    """A CURVE-protected stage server and the pieces to attack it."""
    node = TransportNode("stage", state_dir=tmp_path / "stage")
    await node.start()
    stage = Stage()
    server = await node.serve(stage)
    yield node, server, stage
    await node.close()


async def _curve_peer(node_server_key, address, keypair, ctx, **kw):
    peer = Peer(node_id="p", context=ctx, keypair=keypair, server_key=node_server_key, **kw)
    return await peer.connect(address)


@pytest.fixture
async def ctx():
    c = zmq.asyncio.Context()
    yield c
    c.destroy(linger=0)


async def test_allow_listed_peer_is_admitted_and_identified_by_its_key(home, ctx):
    node, server, stage = home
    member = Keypair.generate()
    node.admit(member.public, "laptop")
    peer = await _curve_peer(node.public_key, server.address, member, ctx, timeout=5)
    try:
        reply = await peer.request(FreeSequence(1, f"s{1}"))
        assert reply.detail == member.public.decode()  # the key ZAP vouched for
        assert stage.calls[0].peer_key == member.public.decode()
    finally:
        await peer.close()


async def test_unknown_key_is_refused_logged_and_never_reaches_the_stage(home, ctx):
    node, server, stage = home
    member, stranger = Keypair.generate(), Keypair.generate()
    node.admit(member.public)
    with all_log_events() as logs:
        bad = await _curve_peer(node.public_key, server.address, stranger, ctx, timeout=2)
        try:
            with pytest.raises((AuthenticationRefused, TransportTimeout)) as e:
                await bad.request(FreeSequence(1, f"s{1}"))
            assert isinstance(e.value, AuthenticationRefused), e.value
            with pytest.raises(AuthenticationRefused, match="refused our key"):
                await bad.send(FreeSequence(1, f"s{2}"))
        finally:
            await bad.close()
    refused = [e for e in logs if e["event"] == "peer_refused"]
    assert refused and refused[0]["fingerprint"] == stranger.fingerprint
    assert stage.calls == [] and server.stats["received"] == 0
    assert node.authenticator.refused >= 1
    # the server keeps serving its members
    good = await _curve_peer(node.public_key, server.address, member, ctx, timeout=5)
    try:
        assert isinstance(await good.request(FreeSequence(1, f"s{3}")), Ack)
    finally:
        await good.close()


async def test_plaintext_peer_cannot_get_a_frame_to_the_stage_and_is_logged(home, ctx):
    node, server, stage = home
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    with all_log_events() as logs:
        raw.connect(server.address)
        for i in range(3):
            await raw.send_multipart(encode(FreeSequence(1, f"s{i}"), call_id=i + 1))
        await eventually(lambda: any(e["event"] == "handshake_failed" for e in logs), 10,
                         "the plaintext handshake to fail and be logged")
        assert await raw.poll(200) == 0  # no reply either
    raw.close(linger=0)
    failed = [e for e in logs if e["event"] == "handshake_failed" and e["role"] == "server"]
    assert failed, logs
    assert stage.calls == [] and server.stats["received"] == 0


async def test_client_with_the_wrong_server_key_gets_nothing_through(home, ctx):
    node, server, stage = home
    member, impostor_server = Keypair.generate(), Keypair.generate()
    node.admit(member.public)
    peer = await _curve_peer(impostor_server.public, server.address, member, ctx, timeout=0.3)
    try:
        with pytest.raises(TransportTimeout):
            await peer.request(FreeSequence(1, f"s{1}"))
    finally:
        await peer.close()
    assert stage.calls == []


async def test_member_admitted_while_running_gets_in_without_restart(home, ctx):
    node, server, stage = home
    newcomer = Keypair.generate()
    peer = await _curve_peer(node.public_key, server.address, newcomer, ctx, timeout=0.5)
    try:
        with pytest.raises((AuthenticationRefused, TransportTimeout)):
            await peer.request(FreeSequence(1, f"s{1}"))
        # e.g. `meshd pair` writing the allow-list file from another process
        AllowList.for_state_dir(node_state_dir(node)).add(newcomer.public, "new")
        deadline = asyncio.get_running_loop().time() + 20
        while True:  # the Peer retries the handshake and is now admitted
            try:
                assert isinstance(await peer.request(FreeSequence(1, f"s{2}"), timeout=0.5), Ack)
                break
            except (AuthenticationRefused, TransportTimeout):
                if asyncio.get_running_loop().time() > deadline:
                    pytest.fail("newcomer never admitted")
                await asyncio.sleep(0.05)  # sleep-ok: the retry interval of a loop with a deadline
        assert len(stage.calls) == 1
    finally:
        await peer.close()


def node_state_dir(node: TransportNode):
    return node.allowlist.path.parent.parent


async def test_curve_server_refuses_to_start_without_an_authenticator(ctx):
    server = StageServer(Stage(), context=ctx, keypair=Keypair.generate())
    with pytest.raises(TransportError, match="needs a CurveAuthenticator"):
        await server.start()
    await server.close()


async def test_one_authenticator_per_context(ctx):
    a = CurveAuthenticator(ctx, lambda k: True).start()
    try:
        with pytest.raises(TransportError, match="already has"):
            CurveAuthenticator(ctx, lambda k: True).start()
    finally:
        a.stop()


async def test_curve_is_on_by_default_and_needs_a_state_dir():
    with pytest.raises(TransportError, match="state_dir"):
        TransportNode("x")
    plain = TransportNode("x", curve=False)
    assert plain.keypair is None
    await plain.close()


def test_allocator_tuning_is_applied_in_its_own_process():
    """Opt-in and process-wide, so it is exercised in a child, not in pytest.

    The child configures logging as every meshd process does (``transport`` only
    gets loggers; unconfigured structlog would print its log line on stdout).
    """
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c",
         "from meshd import log; log.configure(); "
         "from transport.tuning import tune_allocator_for_large_messages as t; print(t())"],
        capture_output=True, text=True, timeout=60,
        cwd=str(ROOT),
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() in ("True", "False")


async def test_nodes_link_up_end_to_end_with_curve_and_without(tmp_path):
    async with TransportNode("a", state_dir=tmp_path / "a") as a, TransportNode("b", state_dir=tmp_path / "b") as b:
        a.admit(b.public_key, "b")
        server = await a.serve(Stage())
        peer = await b.connect(server.address, a.public_key, timeout=5)
        assert (await peer.request(FreeSequence(1, f"s{1}"))).detail == b.public_key.decode()
    async with TransportNode("c", curve=False) as c, TransportNode("d", curve=False) as d:
        server = await c.serve(Stage())
        peer = await d.connect(server.address, timeout=5)
        assert (await peer.request(FreeSequence(1, f"s{1}"))).detail == ""


async def test_a_node_forgets_the_peers_their_owners_closed(tmp_path):
    """A home that pairs and unpairs a cloud verifier many times must not accumulate dead links."""
    async with TransportNode("a", state_dir=tmp_path / "a") as a, TransportNode("b", state_dir=tmp_path / "b") as b:
        a.admit(b.public_key, "b")
        server = await a.serve(Stage())
        for _ in range(3):
            peer = await b.connect(server.address, a.public_key, timeout=5)
            assert not peer.closed
            assert (await peer.request(FreeSequence(1, "s1"))).detail == b.public_key.decode()
            await peer.close()
            assert peer.closed
        live = await b.connect(server.address, a.public_key, timeout=5)
        assert b._peers == [live]


async def test_a_node_closed_before_does_not_break_curve_for_the_next_one(tmp_path):
    """Regression: terminating a context right after stopping its ZAP handler left a stale
    event-loop reader, and every later CURVE node in the same loop timed out on handshakes."""
    from transport.keys import AllowList, load_or_create_keypair
    from transport.messages import Hello, HelloReply
    from transport.node import TransportNode

    async def handler(msg, req):
        return HelloReply("server", 1, "")

    for round_ in range(3):
        a, b = tmp_path / f"a{round_}", tmp_path / f"b{round_}"
        ka, kb = load_or_create_keypair(a), load_or_create_keypair(b)
        for d in (a, b):
            allow = AllowList.for_state_dir(d)
            allow.add(ka.public)
            allow.add(kb.public)
        server_node, client_node = TransportNode("s", state_dir=a), TransportNode("c", state_dir=b)
        await server_node.start()
        await client_node.start()
        server = await server_node.serve(handler)
        peer = await client_node.connect(server.address, server_key=ka.public)
        assert isinstance(await peer.request(Hello("c", 1, ""), timeout=5), HelloReply)
        await client_node.close()
        await server_node.close()
