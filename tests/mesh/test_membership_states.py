"""Membership state machine, driven by a fake clock."""

from meshd.mesh.membership import Change, Debouncer, Membership, PeerState, affects_plan


def make():
    return Membership("b-self", suspect_after_s=3.0, gone_after_s=6.0)


def test_a_discovered_peer_is_joining_until_its_first_heartbeat_makes_it_ready():
    m = make()
    assert m.observe("a", now=0.0) == [Change("a", None, PeerState.JOINING)]
    assert m.heartbeat("a", now=0.5) == [Change("a", PeerState.JOINING, PeerState.READY)]
    assert m.state_of("a") is PeerState.READY


def test_silence_makes_a_ready_peer_suspect_then_gone():
    m = make()
    m.heartbeat("a", now=0.0)
    assert m.tick(2.9) == []
    assert m.tick(3.1) == [Change("a", PeerState.READY, PeerState.SUSPECT)]
    assert m.tick(6.1) == [Change("a", PeerState.SUSPECT, PeerState.GONE)]
    assert m.tick(100.0) == []


def test_time_this_device_itself_was_stalled_is_not_a_peers_silence():
    m = make()
    m.heartbeat("a", now=0.0)
    # our own loop ran 10 s late: the peer's heartbeats wait unread, so it is neither suspect nor gone
    assert m.tick(10.5, stalled_s=10.0) == []
    assert m.tick(13.6) == [Change("a", PeerState.READY, PeerState.SUSPECT)]  # 3.1 s of silence we heard
    assert m.heartbeat("a", now=13.7) == [Change("a", PeerState.SUSPECT, PeerState.READY)]
    assert m.tick(19.0, stalled_s=0.0) == [Change("a", PeerState.READY, PeerState.SUSPECT)]  # excuse is spent


def test_a_stall_excuses_no_more_than_the_silence_a_heartbeat_read_before_the_tick_left():
    m = make()
    m.heartbeat("a", now=0.0)
    m.heartbeat("a", now=10.0)  # queued during our 10 s stall, read just before the late tick
    assert m.tick(10.1, stalled_s=10.0) == []
    assert m.tick(13.2) == [Change("a", PeerState.READY, PeerState.SUSPECT)]  # 3.1 s silent since


def test_a_heartbeat_brings_a_suspect_peer_back_to_ready():
    m = make()
    m.heartbeat("a", now=0.0)
    m.tick(4.0)
    assert m.heartbeat("a", now=4.5) == [Change("a", PeerState.SUSPECT, PeerState.READY)]


def test_a_joining_peer_that_never_answers_becomes_gone():
    m = make()
    m.observe("a", now=0.0)
    assert m.tick(5.0) == []
    assert m.tick(6.5) == [Change("a", PeerState.JOINING, PeerState.GONE)]


def test_a_gone_peer_seen_again_is_joining_again():
    m = make()
    m.heartbeat("a", now=0.0)
    m.leave("a", now=1.0)
    assert m.state_of("a") is PeerState.GONE
    assert m.observe("a", now=2.0) == [Change("a", PeerState.GONE, PeerState.JOINING)]


def test_self_is_never_tracked_and_is_always_among_ready_members():
    m = make()
    assert m.observe("b-self", 0.0) == [] and m.heartbeat("b-self", 0.0) == []
    assert m.ready_ids() == ["b-self"]


def test_the_leader_is_the_lowest_ready_node_id():
    m = make()
    m.heartbeat("a", now=0.0)
    m.heartbeat("c", now=0.0)
    assert m.leader() == "a"
    m.tick(7.0)  # both gone
    assert m.leader() == "b-self"


def test_a_suspect_member_stays_in_the_planned_set_until_it_is_gone():
    """A re-plan during a busy member's missed heartbeat must not drop it: its recovery would
    not trigger another re-plan (found as a two-daemon home serving on one device under load)."""
    m = make()
    m.heartbeat("a", now=0.0)
    m.heartbeat("c", now=0.0)
    m.heartbeat("a", now=2.5)
    m.tick(3.5)  # c missed its heartbeats: suspect, not gone
    assert m.state_of("c") is PeerState.SUSPECT
    assert m.ready_ids() == ["a", "b-self", "c"] and m.leader() == "a"
    m.tick(7.0)  # gone now: out
    assert "c" not in m.ready_ids()


def test_only_entering_or_leaving_the_active_set_affects_the_plan():
    R, S, G, J = PeerState.READY, PeerState.SUSPECT, PeerState.GONE, PeerState.JOINING
    assert affects_plan([Change("a", J, R)])
    assert affects_plan([Change("a", S, G)])
    assert affects_plan([Change("a", R, G)])
    assert not affects_plan([Change("a", R, S)])
    assert not affects_plan([Change("a", S, R)])
    assert not affects_plan([Change("a", None, J)])


def test_the_debouncer_fires_once_after_the_burst_settles():
    d = Debouncer(1.0)
    assert not d.due(0.0)
    d.poke(0.0)
    d.poke(0.5)
    assert not d.due(1.2)
    assert d.due(1.5)
    assert not d.due(3.0)


def test_the_debouncer_does_not_wait_forever_for_a_flapping_peer():
    d = Debouncer(1.0, max_delay_s=3.0)
    t = 0.0
    fired = False
    while t < 5.0 and not fired:
        d.poke(t)
        t += 0.5
        fired = d.due(t)
    assert fired and t <= 3.5
