"""A tensor group's links in one process, and running every member's part in its own thread: what the
links' tests share."""

from __future__ import annotations

import threading

from transport.group_link import GroupLink, GroupPeer
from transport.keys import Keypair


def make_group(n: int):
    keys = [Keypair.generate() for _ in range(n)]
    links = [GroupLink(r, n, keys[r]) for r in range(n)]
    peers = [GroupPeer(r, links[r].endpoint, keys[r].public) for r in range(n)]
    for r, link in enumerate(links):
        link.admit([p for p in peers if p.rank != r])
    for r, link in enumerate(links):
        link.connect([p for p in peers if p.rank != r])
    return links, keys


def in_threads(links, fn):
    out: list = [None] * len(links)

    def run(r):
        try:
            out[r] = fn(links[r])
        except BaseException as exc:  # noqa: BLE001 - returned to the test
            out[r] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(links))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a member is still waiting"
    return out
