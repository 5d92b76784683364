"""The daemon's control link: authenticated senders, and recovery after a refused key."""

from __future__ import annotations

import asyncio

from meshd.mesh import control
from meshd.mesh.peerlink import PeerLink
from meshd.state import Member, StateDir
from tests.support.logs import all_log_events
from tests.support.waiting import eventually


def _state(tmp_path, name):
    st = StateDir(tmp_path / name).ensure()
    return st, st.keypair().public.decode()


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
                await asyncio.sleep(0.1)  # sleep-ok: a member resending, as gossip does

        with all_log_events() as logs:
            sender = asyncio.create_task(keep_sending())
            await eventually(lambda: any(e["event"] == "peer_refused" for e in logs), 10, "a to refuse b's key")
            assert got == []  # refused by ZAP: b's key is not on a's allow-list
            a_state.add_members([Member("b", "b", b_key)])  # the key arrives (e.g. by gossip)
            await eventually(lambda: got, 10, "b's message through once its key is known")
        sender.cancel()
        key, msg = got[0]
        assert key == b_key  # the sender is the key ZAP vouched for
        assert msg == bye
    finally:
        await b.stop()
        await a.stop()


# --------------------------------------------------------------------------- round-trip probes


def test_probes_are_due_at_once_for_a_new_link_then_every_interval_and_never_twice_at_once():
    from meshd.mesh.peerlink import LinkProbes

    p = LinkProbes(interval_s=5.0, timeout_s=2.0)
    assert p.due(["b", "c"], 100.0) == ["b", "c"]
    assert p.due(["b", "c"], 110.0) == []  # both still in flight: a slow peer never piles up probes
    p.record("b", 100.01, 0.01, started=100.0)
    assert p.due(["b", "c"], 104.0) == []  # b's interval has not passed
    assert p.due(["b", "c"], 105.0) == ["b"]
    assert p.due(["b", "c", "d"], 105.0) == ["d"]  # a member linked later is probed at once


def test_a_measured_round_trip_is_reported_while_fresh_then_the_peer_shows_unreachable():
    from meshd.mesh.peerlink import LinkProbes

    p = LinkProbes(interval_s=5.0, timeout_s=2.0)  # stale after 3 intervals + a timeout = 17 s
    p.due(["b"], 0.0)
    p.record("b", 0.002, 0.002, started=0.0)
    s = p.status(3.0)["b"]
    assert s["rtt_s"] == 0.002 and s["reachable"] and s["failures"] == 0
    assert abs(s["age_s"] - 2.998) < 1e-9
    # the peer vanishes mid-probe and its probes stop being answered (no record at all)
    assert p.status(17.0)["b"]["rtt_s"] == 0.002
    late = p.status(17.01)["b"]
    assert late["rtt_s"] is None and late["reachable"] is False and late["age_s"] > 17


def test_two_failed_probes_in_a_row_make_a_peer_unreachable_and_an_answer_brings_it_back():
    from meshd.mesh.peerlink import UNREACHABLE_AFTER, LinkProbes

    assert UNREACHABLE_AFTER == 2
    p = LinkProbes(interval_s=1.0, timeout_s=0.5)
    p.due(["b"], 0.0)
    p.record("b", 0.1, 0.1, started=0.0)
    p.due(["b"], 1.0)
    p.record("b", 1.5, None, "no reply to Heartbeat within 0.5s", started=1.0)
    assert p.status(1.5)["b"]["rtt_s"] == 0.1  # one lost probe on a busy machine is not an outage
    p.due(["b"], 2.0)
    p.record("b", 2.5, None, started=2.0)
    s = p.status(2.5)["b"]
    assert s["rtt_s"] is None and not s["reachable"] and s["failures"] == 2 and s["last_error"]
    p.due(["b"], 3.0)
    p.record("b", 3.004, 0.004, started=3.0)
    assert p.status(3.1)["b"] == {"rtt_s": 0.004, "age_s": 0.096, "reachable": True, "failures": 0,
                                  "probes": 4}


def test_a_forgotten_link_drops_its_entry_and_a_stale_probes_late_answer():
    from meshd.mesh.peerlink import LinkProbes

    p = LinkProbes(interval_s=1.0, timeout_s=0.5)
    p.due(["b"], 0.0)
    p.forget("b")  # disconnected while the probe ran
    p.record("b", 0.3, 0.3, started=0.0)
    assert p.status(0.3) == {}
    p.due(["b"], 0.5)  # relinked: a fresh probe
    p.record("b", 0.6, 0.3, started=0.0)  # the old probe's answer does not count for the new link
    assert p.status(0.6)["b"]["rtt_s"] is None and p.due(["b"], 0.7) == []


async def test_peerlinks_measure_the_round_trip_and_a_stopped_peer_turns_unreachable(tmp_path):
    a_state, a_key = _state(tmp_path, "a")
    b_state, b_key = _state(tmp_path, "b")
    a_state.add_members([Member("b", "b", b_key)])
    b_state.add_members([Member("a", "a", a_key)])
    passed_on: list[object] = []
    a = PeerLink("a", a_state.root, lambda key, env: None, send_timeout_s=0.2,
                 probe_interval_s=0.2, probe_timeout_s=0.2)
    b = PeerLink("b", b_state.root, lambda key, env: passed_on.append(env.message), send_timeout_s=0.2)
    await a.start("127.0.0.1", 0)
    port = await b.start("127.0.0.1", 0)
    try:
        await a.connect("b", b_key, "127.0.0.1", port)

        def measured():
            a.probe_due()
            return (a.link_status().get("b") or {}).get("rtt_s") is not None

        await eventually(measured, 10, "a to measure its round trip to b")
        s = a.link_status()["b"]
        assert 0 < s["rtt_s"] < 1.0 and s["reachable"] and s["age_s"] < 1.0
        assert passed_on == []  # probes are answered by the link; the daemon never sees them
        await b.stop()

        def unreachable():
            a.probe_due()
            return a.link_status()["b"]["reachable"] is False

        await eventually(unreachable, 10, "b, stopped, to turn unreachable")
        s = a.link_status()["b"]
        assert s["rtt_s"] is None and s["failures"] >= 2
        await a.disconnect("b")
        assert a.link_status() == {}
    finally:
        await b.stop()
        await a.stop()
