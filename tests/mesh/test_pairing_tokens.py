"""Home pairing: one-time, expiring invite tokens, mutual proof of the token."""

import asyncio
import json

import pytest
import zmq

from meshd.mesh.pairing import PairingError, PairingServer, Token, create_invite, join_with_token
from meshd.state import Member, StateDir


def keypair():
    pub, _ = zmq.curve_keypair()
    return pub.decode()


@pytest.fixture
def member(tmp_path):
    state = StateDir(tmp_path / "member").ensure()
    state.create_home("flat")
    state.add_members([Member("m1", "laptop", keypair())])
    return state


async def serve(state, admitted, clock=None):
    server = PairingServer(state, admitted.append, **({"clock": clock} if clock else {}))
    port = await server.start("127.0.0.1", 0)
    return server, port


def test_a_token_round_trips_through_its_text_form():
    t = Token(b"x" * 16, "m1", ("127.0.0.1", "192.0.2.2"), 7411)
    assert Token.decode(t.encode()) == t
    with pytest.raises(PairingError, match="not a meshd invite"):
        Token.decode("hello")
    with pytest.raises(PairingError, match="malformed"):
        Token.decode("meshd1-!!!!")


def test_the_state_keeps_only_a_hash_of_the_token(member):
    token, _ = create_invite(member, "m1", ["127.0.0.1"], 1, ttl_s=60)
    stored = json.dumps(member.invites())
    assert token.secret.hex() not in stored and token.encode() not in stored


async def test_a_valid_token_admits_the_device_and_returns_every_member(member):
    admitted = []
    server, port = await serve(member, admitted)
    token, _ = create_invite(member, "m1", ["127.0.0.1"], port, ttl_s=60)
    new_key = keypair()
    home, members = await join_with_token(Token.decode(token.encode()), "n2", "phone", new_key)
    await server.stop()
    assert home == member.home()
    assert {m.node_id for m in members} == {"m1", "n2"}
    assert admitted == [Member("n2", "phone", new_key)]
    assert member.members()["n2"].public_key == new_key


async def test_a_token_works_only_once(member):
    admitted = []
    server, port = await serve(member, admitted)
    token, _ = create_invite(member, "m1", ["127.0.0.1"], port, ttl_s=60)
    await join_with_token(token, "n2", "phone", keypair())
    with pytest.raises(PairingError, match="unknown, used or expired"):
        await join_with_token(token, "n3", "tv", keypair())
    await server.stop()
    assert [m.node_id for m in admitted] == ["n2"]


async def test_an_expired_token_is_refused(member):
    now = [1000.0]
    admitted = []
    server, port = await serve(member, admitted, clock=lambda: now[0])
    token, _ = create_invite(member, "m1", ["127.0.0.1"], port, ttl_s=60, now=1000.0)
    now[0] = 1061.0
    with pytest.raises(PairingError, match="expired"):
        await join_with_token(token, "n2", "phone", keypair())
    await server.stop()
    assert admitted == [] and "n2" not in member.members()


async def test_a_guessed_secret_with_a_real_token_id_is_refused(member):
    admitted = []
    server, port = await serve(member, admitted)
    token, _ = create_invite(member, "m1", ["127.0.0.1"], port, ttl_s=60)

    class Forged(Token):
        @property
        def token_id(self):  # the id is visible on the wire; the key is not
            return token.token_id

    forged = Forged(b"y" * 16, "m1", ("127.0.0.1",), port)
    with pytest.raises(PairingError, match="proof is wrong"):
        await join_with_token(forged, "evil", "evil", keypair())
    # the real token is still usable after a failed attempt
    await join_with_token(token, "n2", "phone", keypair())
    await server.stop()
    assert [m.node_id for m in admitted] == ["n2"]


async def test_garbage_on_the_pairing_port_does_not_stop_the_server(member):
    admitted = []
    server, port = await serve(member, admitted)
    for junk in (b"\x00\xff garbage\n", b"[1,2]\n", b'{"op":"hello","v":1}\n', b""):
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(junk)
        await w.drain()
        w.close()
    token, _ = create_invite(member, "m1", ["127.0.0.1"], port, ttl_s=60)
    await join_with_token(token, "n2", "phone", keypair())
    await server.stop()
    assert len(admitted) == 1


async def test_an_unreachable_inviter_is_a_clear_error():
    token = Token(b"z" * 16, "m1", ("127.0.0.1",), 1)
    with pytest.raises(PairingError, match="cannot reach"):
        await join_with_token(token, "n2", "phone", keypair())


def test_a_device_without_a_home_cannot_invite(tmp_path):
    with pytest.raises(PairingError, match="not in a home"):
        create_invite(StateDir(tmp_path).ensure(), "m1", [], 1, ttl_s=60)


def test_invite_without_a_running_daemon_uses_the_configured_port(tmp_path):
    from tests.support.daemons import run_cli

    state = StateDir(tmp_path / "s").ensure()
    state.create_home("flat")
    rc, out = run_cli("invite", "--state-dir", str(state.root), "--json")
    assert rc == 0
    body = json.loads(out.strip().splitlines()[-1])
    token = Token.decode(body["token"])
    assert token.pairing_port == 7411 and token.addresses
    assert token.node_id == state.node_id()
    assert len(state.invites()) == 1


def test_invite_prefers_the_running_daemons_ports_and_addresses(tmp_path):
    from tests.support.daemons import run_cli

    state = StateDir(tmp_path / "s").ensure()
    state.create_home("flat")
    (state.root / "daemon.json").write_text(json.dumps(
        {"pairing_port": 40123, "addresses": ["192.0.2.7"], "port": 1, "pid": 1}))
    rc, out = run_cli("invite", "--state-dir", str(state.root), "--json")
    token = Token.decode(json.loads(out.strip().splitlines()[-1])["token"])
    assert (token.pairing_port, token.addresses) == (40123, ("192.0.2.7",))
