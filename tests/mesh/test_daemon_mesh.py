"""Three real daemons find each other over mDNS, pair with tokens, and track liveness."""

from __future__ import annotations

import pytest

from meshd.state import StateDir

from tests.support.daemons import kill_hard, meshd_status_json, states, summary

from tests.support.waiting import wait_until
from tests.support.daemons import GONE_AFTER_S, READY_WITHIN_S, all_ready

pytestmark = pytest.mark.slow


def test_three_paired_daemons_become_ready_and_a_killed_one_is_gone_and_replanned(mesh):
    a = mesh.spawn("a", new_home="flat")
    a.wait_serving()
    b = mesh.spawn("b", token=mesh.invite(a))
    c = mesh.spawn("c", token=mesh.invite(a))
    for p in (b, c):
        p.wait_serving()
    names = ["a", "b", "c"]
    wait_until(all_ready([a, b, c], names), READY_WITHIN_S, what="a, b and c ready on every daemon",
               explain=lambda: summary(a, b, c))

    # The real CLI, as a user runs it, lists all three on each daemon.
    for p in (a, b, c):
        s = meshd_status_json(p)
        assert {m["name"] for m in s["members"]} == set(names)
        assert all(m["state"] == "ready" for m in s["members"])
        assert s["interfaces"] == [{"name": "lo", "addresses": ["127.0.0.1"]}]
        ours = {q.node_id() for q in (a, b, c)}  # (other meshd homes may share this host's mDNS)
        assert [d for d in s["not_admitted"] if d["node_id"] in ours] == []
        layers = sorted(tuple(m["layers"]) for m in s["members"] if m["layers"])
        assert layers[0][0] == 0 and layers[-1][1] == s["plan"]["num_layers"]

    # c was invited by a; b learned c's key from a over the transport (gossip), and
    # vice versa, so every member's allow-list holds every key.
    for p in (a, b, c):
        assert set(StateDir(p.state_dir).members()) == {q.node_id() for q in (a, b, c)}

    version_before = a.status()["plan"]["version"]
    c_id = c.node_id()
    kill_hard(c)  # no goodbye: only the missing heartbeats tell

    def c_gone_and_replanned():
        for p in (a, b):
            s = p.status()
            if states(s)["c"] != "gone":
                return False
            plan = s["plan"]
            if plan["version"] <= version_before or c_id in {st["node_id"] for st in plan["stages"]}:
                return False
        return a.status()["plan"] == b.status()["plan"]  # one plan, from one coordinator

    # gone_after + debounce (0.5 s) + heartbeat periods of slack (both cores may be busy)
    wait_until(c_gone_and_replanned, GONE_AFTER_S + 0.5 + 6.0, what="c gone and re-planned without it",
               explain=lambda: summary(a, b))
    events = [e["event"] for e in a.events()]
    assert "replan" in events or "replan" in [e["event"] for e in b.events()]
    # every daemon log line is JSON and names the node
    assert all(e.get("node") == a.node_id() for e in a.events() if e["event"] != "home_created")
