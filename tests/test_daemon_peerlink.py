"""The daemon's control link: authenticated senders, and recovery after a refused key."""

from __future__ import annotations

import asyncio

from meshd import control
from meshd.peerlink import PeerLink
from meshd.state import Member, StateDir


def _state(tmp_path, name):
    st = StateDir(tmp_path / name).ensure()
    return st, st.keypair().public.decode()


async def _until(pred, timeout=10.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while not pred():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def test_a_sender_refused_before_its_key_was_known_gets_through_once_it_is(tmp_path):
    a_state, a_key = _state(tmp_path, "a")
    b_state, b_key = _state(tmp_path, "b")
    b_state.add_members([Member("a", "a", a_key)])  # b trusts a; a has not heard of b yet
    got: list[tuple[str, object]] = []
    a = PeerLink("a", a_state.root, lambda key, env: got.append((key, env.message)), send_timeout_s=0.2)
    b = PeerLink("b", b_state.root, lambda key, env: None, send_timeout_s=0.2)
    port = await a.start("127.0.0.1", 0)
    await b.start("127.0.0.1", 0)
    try:
        await b.connect("a", a_key, "127.0.0.1", port)
        bye = control.Bye("b", "hello")

        async def keep_sending():
            while True:
                b.send("a", bye)
                await asyncio.sleep(0.1)

        sender = asyncio.create_task(keep_sending())
        await asyncio.sleep(1.0)
        assert got == []  # refused by ZAP: b's key is not on a's allow-list
        a_state.add_members([Member("b", "b", b_key)])  # the key arrives (e.g. by gossip)
        await _until(lambda: got)
        sender.cancel()
        key, msg = got[0]
        assert key == b_key  # the sender is the key ZAP vouched for
        assert msg == bye
    finally:
        await b.stop()
        await a.stop()
