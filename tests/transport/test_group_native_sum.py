"""The decode kernel's own exchange of a tensor group's partial sums (``group_sum.cpp`` through
``GroupLink.native_sum``): the same frames on the same sealed streams as the Python exchange, so members on
either path pair up and hold the same bits; a member that leaves, or an abort, ends its wait with GroupLost;
and a stream that holds what Python read early is left to Python."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from decoding.quant import native
from decoding.tensor_group import GroupLost
from tests.support.group_links import in_threads, make_group

OK, WHY = native.available()
pytestmark = pytest.mark.skipif(not OK, reason=f"integer kernels unavailable: {WHY}")


def kernel_sum(link, x: np.ndarray) -> None:
    """What a decode step does at a split product: the reducer ``native_sum`` hands out, on ``x`` — or the
    Python exchange when the links hold something Python read early."""
    handle = link.native_sum()
    if handle is None:
        link.sum_(x)
        return
    reduce, ctx = handle
    failed = reduce(ctx, x.ctypes.data, x.size)
    link.native_done(bool(failed))


@pytest.fixture
def group_of():
    """``group_of(n)``: n members' links in this process, closed after the test."""
    made = []

    def make(n: int):
        links, _ = make_group(n)
        made.extend(links)
        return links

    yield make
    for link in made:
        link.close()


def test_members_on_either_path_hold_the_same_bits_as_the_rank_order_sum(group_of):
    three = group_of(3)
    rng = np.random.default_rng(1)
    rounds = [[rng.standard_normal((3, 1536)).astype(np.float32) for _ in three] for _ in range(6)]
    native_members = {0, 2}  # member 1 sums in Python: its frames and theirs interleave on the same streams

    def step(link):
        got = []
        for i, xs in enumerate(rounds):
            x = xs[link.rank].copy()
            if link.rank in native_members and i % 3 != 2:  # every third round in Python on every member
                kernel_sum(link, x)
            else:
                link.sum_(x)
            got.append(x)
            # a gather through Python between the kernel's exchanges: one nonce sequence, one numbering
            link.gather_parts(np.full((1, 3), link.rank, np.float32))
        return got

    outs = in_threads(three, step)
    for xs, *got in zip(rounds, *outs):
        want = (xs[0] + xs[1]) + xs[2]
        assert all(np.array_equal(g, want) for g in got)
    # (a Python exchange or gather may read a next partial early: that exchange is then Python's too)
    assert three[0].native_exchanges > 0 and three[1].native_exchanges == 0 and three[2].native_exchanges > 0


def test_a_member_that_leaves_mid_wait_ends_the_kernels_wait(group_of):
    two = group_of(2)
    x = np.ones(1536, np.float32)
    done = threading.Event()
    caught: list[BaseException] = []

    def wait():
        try:
            kernel_sum(two[0], x)
        except BaseException as exc:  # noqa: BLE001 - checked below
            caught.append(exc)
        done.set()

    in_threads(two, lambda link: link.sum_(np.zeros(4, np.float32)))  # the streams are up; then member 1 goes
    t = threading.Thread(target=wait)
    t.start()
    two[1].close()
    assert done.wait(timeout=30)
    t.join()
    assert isinstance(caught[0], GroupLost) and "dropped its link" in str(caught[0])
    assert two[0].native_sum() is None  # the links are lost: nothing more goes through them


def test_a_member_that_leaves_after_its_partial_came_ends_the_kernels_wait(group_of):
    """Member 1's partial is in and member 2's is awaited when member 1 goes: its link is still watched."""
    three = group_of(3)
    in_threads(three, lambda link: link.sum_(np.zeros(4, np.float32)))  # the streams are up
    out: list = []
    waiting = [threading.Thread(target=lambda: out.append(pytest.raises(GroupLost, kernel_sum, three[0],
                                                                        np.ones(64, np.float32)))),
               threading.Thread(target=lambda: pytest.raises(GroupLost, three[1].sum_, np.ones(64, np.float32)))]
    for t in waiting:
        t.start()
    time.sleep(0.3)  # sleep-ok: member 1's partial has reached member 0 (member 2 never sends)
    three[1].close()
    for t in waiting:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in waiting)
    assert "member 1" in str(out[0].value) and three[0].native_exchanges == 1


def test_an_abort_from_another_thread_ends_the_kernels_wait(group_of):
    two = group_of(2)
    x = np.ones(1536, np.float32)
    out: list = []
    in_threads(two, lambda link: link.sum_(np.zeros(4, np.float32)))  # the streams are up
    t = threading.Thread(target=lambda: out.append(pytest.raises(GroupLost, kernel_sum, two[0], x)))
    t.start()
    time.sleep(0.2)  # sleep-ok: the kernel's wait under way (member 1 never sends), then the abort
    two[0].abort("this member left the group (a new plan)")
    t.join(timeout=30)
    assert not t.is_alive()
    assert "left the group" in str(out[0].value)
    assert two[0].native_exchanges == 1  # it was the kernel's wait that ended


def test_a_partial_read_early_by_python_is_taken_by_python_before_the_kernel_exchanges(group_of):
    two = group_of(2)
    in_threads(two, lambda link: link.sum_(np.zeros(4, np.float32)))  # the streams are up
    for link in two:
        link.begin_pass(1)

    sent, apart = threading.Event(), threading.Barrier(2, timeout=30)

    def step(link):
        if link.rank:  # two shares sent back to back: the first member's read takes both
            link.gather_parts(np.full((1, 2), 1.0, np.float32))
            link.gather_parts(np.full((1, 2), 2.0, np.float32))
            sent.set()  # (on loopback a send has reached the other socket when it returns)
            x = np.full(8, 5.0, np.float32)
            kernel_sum(link, x)
        else:
            assert sent.wait(timeout=30)
            first = link.gather_parts(np.zeros((1, 2), np.float32))
            kept_early = link.native_sum() is None  # the second share waits here, not on the stream
            second = link.gather_parts(np.zeros((1, 2), np.float32))
            x = np.full(8, 3.0, np.float32)
            kernel_sum(link, x)
        # nothing read early any more (the members apart between rounds): the kernel's on both
        apart.wait()
        before = link.native_exchanges
        y = np.full(8, float(link.rank), np.float32)
        kernel_sum(link, y)
        assert link.native_exchanges == before + 1
        return (first[1][0, 0], kept_early, second[1][0, 0], x, y) if link.rank == 0 else (x, y)

    lead, follower = in_threads(two, step)
    assert lead[:3] == (1.0, True, 2.0)
    assert np.array_equal(lead[3], np.full(8, 8.0, np.float32)) and np.array_equal(follower[0], lead[3])
    assert np.array_equal(lead[4], np.ones(8, np.float32)) and np.array_equal(follower[1], lead[4])
