"""The sealed stream a tensor group's partial sums travel on: only the group's keys open it, nothing on
the wire is readable or can be altered unnoticed, and a prompt's megabytes cross while both members send."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from decoding.tensor_group import GroupLost
from tests.support.group_links import in_threads, make_group
from transport import group_stream
from transport.group_link import GroupLink, GroupPeer
from transport.keys import Keypair


def stream_pair():
    """Member 1's stream to member 0 and member 0's end of it, over loopback."""
    kx = [group_stream.kx_keypair() for _ in range(2)]
    listener = group_stream.listen("127.0.0.1")
    listener.settimeout(10)
    accepted: list = []
    t = threading.Thread(target=lambda: accepted.append(group_stream.accept(listener, kx[0], {1: kx[1][0]}, 7, 10)))
    t.start()
    dialled = group_stream.dial(listener.getsockname()[:2], 1, 7, 0, kx[1], kx[0][0], 10)
    t.join(timeout=30)
    listener.close()
    assert accepted and accepted[0] is not None
    return dialled, accepted[0]


def wait_frames(stream, timeout_s: float = 10.0):
    import select
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        select.select([stream.sock], [], [], 0.1)
        frames = stream.receive()
        if frames:
            return frames
    raise AssertionError("no frame arrived")


def test_a_frame_arrives_as_sent_and_travels_sealed():
    out, into = stream_pair()
    try:
        payload = np.arange(1536, dtype=np.float32)
        out.seal(1, 3, 4, payload.data)
        wire = bytes(out._out)  # what an eavesdropper on the LAN sees
        assert payload.tobytes()[:64] not in wire
        assert out.flush()
        [(kind, number_pass, number, got)] = wait_frames(into)
        assert (kind, number_pass, number) == (1, 3, 4)
        assert np.array_equal(np.frombuffer(got, np.float32), payload)
    finally:
        out.close()
        into.close()


def test_an_altered_frame_ends_the_stream():
    out, into = stream_pair()
    try:
        out.seal(1, 1, 1, np.ones(64, np.float32).data)
        frame = bytearray(out._out)
        frame[-5] ^= 0x01  # one bit flipped in flight
        out.sock.sendall(bytes(frame))
        with pytest.raises(GroupLost, match="failed authentication"):
            wait_frames(into)
    finally:
        out.close()
        into.close()


def test_a_caller_without_the_keys_is_turned_away():
    kx = [group_stream.kx_keypair() for _ in range(2)]
    listener = group_stream.listen("127.0.0.1")
    listener.settimeout(10)
    try:
        impostor = group_stream.kx_keypair()  # says it is member 1, but never sent its key over CurveZMQ
        got: list = []
        t = threading.Thread(target=lambda: got.append(group_stream.accept(listener, kx[0], {1: kx[1][0]}, 7, 5)))
        t.start()
        with pytest.raises(GroupLost):
            group_stream.dial(listener.getsockname()[:2], 1, 7, 0, impostor, kx[0][0], 5)
        t.join(timeout=30)
        assert got == [None]
    finally:
        listener.close()


def test_a_stranger_on_the_stream_port_does_not_stop_the_group():
    links, _ = make_group(2)
    try:
        stranger = socket.create_connection(("127.0.0.1", links[0].data_port))
        stranger.sendall(b"\x01\x00\x00\x00\x00\x00" + bytes(24) + b"\x10\x00\x00\x00" + bytes(16))
        xs = [np.full(8, r + 1.0, np.float32) for r in range(2)]
        out = in_threads(links, lambda link: link.sum_(xs[link.rank]))
        assert out == [None, None]
        assert all(np.array_equal(x, np.full(8, 3.0, np.float32)) for x in xs)
        stranger.close()
    finally:
        for link in links:
            link.close()


def test_a_prompts_megabytes_cross_while_both_members_send():
    """Both members send first; with 16 MB each way neither may wait for the other to read."""
    links, _ = make_group(2)
    try:
        rng = np.random.default_rng(1)
        xs = [rng.standard_normal((1024, 4096)).astype(np.float32) for _ in range(2)]
        want = xs[0] + xs[1]
        out = in_threads(links, lambda link: link.sum_(xs[link.rank]))
        assert out == [None, None]
        assert all(np.array_equal(x, want) for x in xs)
    finally:
        for link in links:
            link.close()


def test_a_member_reached_elsewhere_than_its_group_address_is_dialled_there():
    """A member behind something that forwards (a test bed's delay) names its stream's address itself;
    a wrong one fails to form the stream instead of reaching someone else."""
    keys = [Keypair.generate() for _ in range(2)]
    links = [GroupLink(r, 2, keys[r]) for r in range(2)]
    try:
        closed = group_stream.listen("127.0.0.1")
        dead = closed.getsockname()[1]
        closed.close()
        peers = [GroupPeer(0, links[0].endpoint, keys[0].public, f"127.0.0.1:{dead}"),
                 GroupPeer(1, links[1].endpoint, keys[1].public)]
        links[0].admit([peers[1]])
        links[1].admit([peers[0]])
        links[0].connect([peers[1]])
        links[1].connect([peers[0]])
        out = in_threads(links[1:], lambda link: link.sum_(np.ones(4, np.float32)))
        assert isinstance(out[0], GroupLost) and "refused" in str(out[0])
    finally:
        for link in links:
            link.close()


def test_a_partial_of_the_next_pass_read_with_the_awaited_one_is_kept_not_taken_for_a_lost_step(monkeypatch):
    """A member that reads late finds the first member's last partial of this pass and its first of the
    next in one read: the first is this exchange's, the second waits for its pass."""
    links, _ = make_group(2)
    real = group_stream.SealedStream.receive
    late = {"once": True}

    def receive(stream):
        if threading.current_thread().name == "late-member" and late["once"]:
            late["once"] = False
            time.sleep(0.3)  # sleep-ok: both of the first member's partials arrive before this member reads
        return real(stream)

    try:
        in_threads(links, lambda link: link.sum_(np.ones(4, np.float32)))  # the streams are open
        monkeypatch.setattr(group_stream.SealedStream, "receive", receive)
        sums: list = [None, None]

        def member(rank):
            link = links[rank]
            link.begin_pass(2)
            x = np.full(4, rank + 1.0, np.float32)
            link.sum_(x)
            link.begin_pass(3)
            y = np.full(4, 10.0 * (rank + 1), np.float32)
            link.sum_(y)
            sums[rank] = (x, y)

        threads = [threading.Thread(target=member, args=(0,)), threading.Thread(target=member, args=(1,), name="late-member")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not late["once"], "the late read did not happen"
        for x, y in sums:
            assert np.array_equal(x, np.full(4, 3.0, np.float32)) and np.array_equal(y, np.full(4, 30.0, np.float32))
    finally:
        for link in links:
            link.close()


def test_a_member_that_reaches_its_first_exchange_late_is_waited_for():
    """Three members: the last dials the middle one, which is still loading; it answers when it gets there."""
    links, _ = make_group(3)

    def member(link):
        if link.rank == 1:
            time.sleep(1.0)  # sleep-ok: this member is still loading its share when the others first exchange
        x = np.full(4, link.rank + 1.0, np.float32)
        link.sum_(x)
        return x

    try:
        out = in_threads(links, member)
        assert all(np.array_equal(x, np.full(4, 6.0, np.float32)) for x in out)
    finally:
        for link in links:
            link.close()


def test_a_stranger_that_connects_and_says_nothing_delays_the_group_only_briefly():
    links, _ = make_group(2)
    quiet = socket.create_connection(("127.0.0.1", links[0].data_port))
    try:
        out = in_threads(links, lambda link: link.sum_(np.ones(4, np.float32)))
        assert out == [None, None]
    finally:
        quiet.close()
        for link in links:
            link.close()
