"""Devices that mDNS finds but the mesh does not admit, and why ``meshd status`` says so."""

from __future__ import annotations

import pytest

from meshd.state import StateDir
from tests.support.daemons import states
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow


def test_an_unpaired_device_is_discovered_but_never_admitted(mesh):
    a = mesh.spawn("a", new_home="flat")
    other = mesh.spawn("other", new_home="next-door")
    a.wait_serving()
    # "rogue" copied the home id (it is not secret) and a's key, but was never given
    # a token: its own key is on nobody's allow-list.
    rogue = mesh.spawn("rogue", start=False)
    a_state = StateDir(a.state_dir)
    rogue_state = StateDir(rogue.state_dir).ensure()
    rogue_state.set_home(a_state.home())
    rogue_state.add_members(list(a_state.members().values()))
    rogue.start()  # plain `meshd join`: it already "has" a home
    rogue_id = rogue.wait_serving()["node_id"]

    other_id = other.wait_serving()["node_id"]

    def a_explains_both():
        na = {d["node_id"]: d["reason"] for d in a.status()["not_admitted"]}
        return na.get(rogue_id) == "unpaired key" and na.get(other_id) == "another home"

    wait_until(a_explains_both, 10, what="a to list rogue (unpaired) and other (another home)")
    # ...and the transport refused rogue's key when it tried to talk to a.
    wait_until(lambda: any(e["event"] == "peer_refused" for e in a.events()), 10,
               what="a's transport refusing rogue's key")
    s = a.status()
    assert [m["name"] for m in s["members"]] == ["a"]
    assert rogue_id not in {st["node_id"] for st in s["plan"]["stages"]}
    assert states(rogue.status())["a"] != "ready"  # a never answers rogue's heartbeats
