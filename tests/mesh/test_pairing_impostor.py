"""Pairing admits new devices; it never lets a token holder take over a member (issue #10).

The attack: ``meshd join --token`` from a fresh state directory whose ``node_id``
file holds an existing member's node id. Before the fix the member swapped that
node id's key for the impostor's, so the impostor received the member's layers
and activations while the real device stayed "gone".
"""

import asyncio
import threading

import pytest
import zmq

from meshd.errors import MeshdError
from meshd.mesh.pairing import PairingError, PairingServer, create_invite, join_with_token
from meshd.state import Member, MemberConflict, StateDir, StateError
from tests.support.logs import all_log_events


def keypair():
    pub, _ = zmq.curve_keypair()
    return pub.decode()


LAPTOP_KEY = keypair()


@pytest.fixture
def member(tmp_path):
    state = StateDir(tmp_path / "member").ensure()
    state.create_home("flat")
    state.add_members([Member("m1", "laptop", LAPTOP_KEY)])
    return state


async def serve(state, admitted):
    server = PairingServer(state, admitted.append)
    return server, await server.start("127.0.0.1", 0)


def assert_laptop_untouched(state: StateDir, impostor_key: str) -> None:
    assert state.members()["m1"] == Member("m1", "laptop", LAPTOP_KEY)
    allow = state.allow_list()
    assert LAPTOP_KEY in allow and impostor_key not in allow


# --------------------------------------------------------------------------- pairing


async def test_an_impostor_with_a_members_node_id_is_refused_and_the_key_is_kept(member):
    admitted = []
    server, port = await serve(member, admitted)
    token, _ = create_invite(member, "m1", ["127.0.0.1"], port, ttl_s=60)
    evil_key = keypair()
    with all_log_events() as logs:
        with pytest.raises(PairingError, match="node id m1 already belongs to member 'laptop'") as err:
            await join_with_token(token, "m1", "evil", evil_key)
    assert "\n" not in str(err.value)  # the joiner prints it as one line
    assert admitted == []
    assert_laptop_untouched(member, evil_key)
    conflict = [e for e in logs if e["event"] == "pairing_identity_conflict"]
    assert len(conflict) == 1 and conflict[0]["log_level"] == "warning"
    assert conflict[0]["node_id"] == "m1" and conflict[0]["member_name"] == "laptop"
    # The refusal does not consume the token (see meshd/mesh/pairing.py): the holder
    # can still add one *new* device with it, which is all the token ever allowed.
    new_key = keypair()
    await join_with_token(token, "n2", "phone", new_key)
    await server.stop()
    assert admitted == [Member("n2", "phone", new_key)]
    assert_laptop_untouched(member, evil_key)


async def test_the_inviting_member_itself_cannot_be_impersonated(member):
    own = Member(member.node_id(), "hub", keypair())
    member.add_members([own])
    server, port = await serve(member, [])
    token, _ = create_invite(member, own.node_id, ["127.0.0.1"], port, ttl_s=60)
    with pytest.raises(PairingError, match=f"node id {own.node_id} already belongs to member 'hub'"):
        await join_with_token(token, own.node_id, "evil", keypair())
    await server.stop()
    assert member.members()[own.node_id] == own


async def test_a_members_key_under_a_new_node_id_is_refused(member):
    server, port = await serve(member, [])
    token, _ = create_invite(member, "m1", ["127.0.0.1"], port, ttl_s=60)
    with pytest.raises(PairingError, match="already belongs to member 'laptop'"):
        await join_with_token(token, "n9", "evil", LAPTOP_KEY)
    await server.stop()
    assert set(member.members()) == {"m1"}


async def test_re_pairing_the_same_node_id_with_the_same_key_is_idempotent(member):
    admitted = []
    server, port = await serve(member, admitted)
    key = keypair()
    for _ in range(2):
        token, _ = create_invite(member, "m1", ["127.0.0.1"], port, ttl_s=60)
        home, members = await join_with_token(token, "n2", "phone", key)
        assert {m.node_id for m in members} == {"m1", "n2"}
    await server.stop()
    assert admitted == [Member("n2", "phone", key)] * 2
    assert member.members()["n2"].public_key == key
    assert member.invites() == []  # a successful (re-)pairing consumes its token


async def test_a_malformed_key_is_refused_with_a_reply(member):
    server, port = await serve(member, [])
    token, _ = create_invite(member, "m1", ["127.0.0.1"], port, ttl_s=60)
    with pytest.raises(PairingError, match="unusable public key"):
        await join_with_token(token, "n2", "phone", "~" * 40)
    await server.stop()
    assert set(member.members()) == {"m1"}


# --------------------------------------------------------------------------- the CLI


def test_meshd_join_token_as_an_impostor_prints_one_line_and_fails(member, tmp_path, capsys):
    from tests.support.daemons import run_cli

    loop = asyncio.new_event_loop()
    server = PairingServer(member, lambda m: None)
    port = loop.run_until_complete(server.start("127.0.0.1", 0))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        token, _ = create_invite(member, "m1", ["127.0.0.1"], port, ttl_s=60)
        impostor = StateDir(tmp_path / "impostor").ensure()
        (impostor.root / "node_id").write_text("m1\n")
        capsys.readouterr()
        rc, _ = run_cli("join", "--token", token.encode(), "--state-dir", str(impostor.root),
                        "--name", "evil", "--log-level", "error")
        err = capsys.readouterr().err.strip().splitlines()
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
    assert rc == 1
    assert len(err) == 1 and err[0].startswith("meshd: error: refused by the inviting device: node id m1")
    assert impostor.home() is None
    assert_laptop_untouched(member, impostor.keypair().public.decode())


# --------------------------------------------------------------------------- the state


def test_add_members_never_swaps_a_members_key(member):
    evil_key = keypair()
    with pytest.raises(MemberConflict, match="node id m1 already belongs") as err:
        member.add_members([Member("m1", "laptop", evil_key)])
    assert isinstance(err.value, StateError) and isinstance(err.value, MeshdError)
    assert err.value.existing.public_key == LAPTOP_KEY and err.value.offered.public_key == evil_key
    assert_laptop_untouched(member, evil_key)


def test_add_members_is_all_or_nothing(member):
    fine = Member("n2", "phone", keypair())
    with pytest.raises(MemberConflict):
        member.add_members([fine, Member("m1", "evil", keypair())])
    assert set(member.members()) == {"m1"} and fine.public_key not in member.allow_list()
    with pytest.raises(MemberConflict, match="one key cannot join under a second node id"):
        member.add_members([Member("n3", "tv", LAPTOP_KEY)])
    with pytest.raises(MemberConflict):  # nor within one batch
        member.add_members([Member("n4", "a", fine.public_key), Member("n4", "a", keypair())])
    assert set(member.members()) == {"m1"}


def test_add_members_keeps_same_key_updates_idempotent(member):
    assert member.add_members([Member("m1", "laptop", LAPTOP_KEY)]) == []
    renamed = Member("m1", "work laptop", LAPTOP_KEY)
    assert member.add_members([renamed]) == [renamed]
    assert member.members()["m1"] == renamed and LAPTOP_KEY in member.allow_list()


def test_a_malformed_key_is_a_state_error(member):
    with pytest.raises(StateError, match="member n2"):
        member.add_members([Member("n2", "x", "not a key")])
