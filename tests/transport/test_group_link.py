"""A tensor-parallel group's links: sums in rank order, gathers to the first member, commands in order,
only the group's keys admitted, and a member that goes away ends the others' wait at once."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import zmq

from decoding.tensor_group import GroupLost
from tests.support.waiting import wait_until
from tests.support.group_links import in_threads, make_group
from transport.group_link import GroupLink, GroupPeer
from transport.keys import Keypair


def test_a_group_forms_whatever_order_its_members_admit_each_other_in():
    """A member's first handshakes are refused until the other has read the plan and admitted its key:
    the link waits for the handshake to pass instead of giving up."""
    keys = [Keypair.generate() for _ in range(2)]
    links = [GroupLink(r, 2, keys[r]) for r in range(2)]
    peers = [GroupPeer(r, links[r].endpoint, keys[r].public) for r in range(2)]
    try:
        t = threading.Thread(target=links[0].connect, args=([peers[1]],))
        t.start()  # member 0 dials before member 1 knows its key: refused (libzmq never redials by itself)
        time.sleep(0.5)  # sleep-ok: long enough for the refusal to land before member 1 admits the key
        links[1].connect([peers[0]])
        t.join(timeout=60)
        assert not t.is_alive()
        out = in_threads(links, lambda link: link.sum_(np.full(4, link.rank + 1.0, np.float32)))
        assert out == [None, None]
    finally:
        for link in links:
            link.close()


def test_a_group_that_never_forms_says_who_is_missing():
    keys = [Keypair.generate() for _ in range(2)]
    lonely = GroupLink(0, 2, keys[0])
    try:
        with pytest.raises(GroupLost, match="member 1"):
            lonely.connect([GroupPeer(1, "tcp://127.0.0.1:9", keys[1].public)], timeout_s=0.5)
    finally:
        lonely.close()


@pytest.fixture
def three():
    links, keys = make_group(3)
    yield links, keys
    for link in links:
        link.close()


def test_every_member_gets_the_sum_in_rank_order(three):
    links, _ = three
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal(1536).astype(np.float32) for _ in links]
    want = (xs[0] + xs[1]) + xs[2]

    def step(link):
        got = []
        for _ in range(5):  # several exchanges back to back: each pairs with its own number
            x = xs[link.rank].copy()
            link.sum_(x)
            got.append(x)
        return got

    for got in in_threads(links, step):
        assert all(np.array_equal(g, want) for g in got)  # bit for bit, on every member


def test_a_gather_reaches_the_first_member_in_rank_order(three):
    links, _ = three
    shares = [np.full((2, r + 1), r, np.float32) for r in range(3)]
    out = in_threads(links, lambda link: link.gather(shares[link.rank]))
    assert np.array_equal(out[0], np.concatenate(shares, axis=-1))
    assert np.array_equal(out[2], shares[2])


def test_commands_arrive_in_order_between_exchanges(three):
    links, _ = three
    for c in (b"create", b"forward", b"free"):
        links[0].send_command(c)
    assert [links[1].next_command(timeout_s=10) for _ in range(3)] == [b"create", b"forward", b"free"]
    assert links[2].next_command(timeout_s=10) == b"create"
    assert links[1].next_command(timeout_s=0.05) is None  # sleep-ok: a bounded wait that expects nothing


def test_a_key_outside_the_group_is_refused(three):
    links, keys = three
    stranger = Keypair.generate()
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.curve_serverkey, s.curve_publickey, s.curve_secretkey = keys[0].public, stranger.public, stranger.secret
    s.routing_id = b"\x01\x00"
    monitor = s.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH)
    s.connect(links[0].endpoint)
    s.send_multipart([b"\x02" + bytes(8), b"intruder"])
    assert monitor.poll(10_000), "the handshake was not refused"
    assert links[0].next_command(timeout_s=0.2) is None  # sleep-ok: nothing from the stranger got through
    s.close(linger=0)
    monitor.close(linger=0)
    ctx.term()


def test_a_member_that_leaves_ends_the_others_wait():
    links, _ = make_group(2)
    try:
        caught: list = []

        def wait_for_partner():
            try:
                links[0].sum_(np.ones(8, np.float32))
            except GroupLost as exc:
                caught.append(exc)

        # the pair exchange once, so the link is up, then one member goes
        out = in_threads(links, lambda link: link.sum_(np.ones(8, np.float32)))
        assert out == [None, None]
        t = threading.Thread(target=wait_for_partner)
        t.start()
        links[1].close()
        wait_until(lambda: not t.is_alive(), timeout_s=30, what="the survivor's wait to end")
        assert caught and "dropped its link" in str(caught[0])
    finally:
        links[0].close()
