"""A layer-range joiner fetches the layers of the plan it is in, never the whole file by a guess.

The race behind ``bench/share.py --quick`` moving the whole file (1.0005 of it, for a range worth
0.73): while a newcomer still loaded (it held the header only), the leader sent it the range of a
*prospective* plan, made with the shipped default profile for it since its own was not measured
yet. On a busy machine every measured member looked slow next to that default, the prospective plan
gave the newcomer every layer, and it fetched them all before the real plan gave it part of them.
Here the guessed plan is given to the gate directly, so the condition holds on every run.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from meshd.mesh.home_plan import Plan
from meshd.share.messages import ShareTarget
from partition.ids import NodeId, PlanVersion
from partition.stages import StageAssignment
from tests.support.logs import all_log_events
from tests.support.gguf import write_tiny_gguf
from tests.support.share_bus import Bus, close_all, shell
from tests.support.waiting import eventually

pytestmark = pytest.mark.timeout(120)

LAYERS = 5


def plan(*stages: tuple[str, int, int]) -> Plan:
    return Plan(PlanVersion(1), tuple(StageAssignment(NodeId(n), f, e) for n, f, e in stages), LAYERS,
                leader=NodeId("0a"))


@pytest.fixture
def no_local_model(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHD_HOME", str(tmp_path / "empty-meshd-home"))


async def a_home(tmp_path, replans: list | None = None):
    """A leader holding the file and a newcomer that has fetched the header only (still loading)."""
    bus = Bus()
    tiny = write_tiny_gguf(tmp_path / "tiny.gguf", layers=LAYERS)
    leader = await shell(bus, tmp_path, "0a", model=str(tiny),
                         replan_now=(lambda: replans.append(1)) if replans is not None else None)
    await leader.obtain_source()
    await eventually(lambda: leader.manifest is not None, timeout_s=30, what="the leader's manifest")
    joiner = await shell(bus, tmp_path, "fb")
    await asyncio.wait_for(joiner.obtain_source(), 60)
    await eventually(lambda: "fb" in leader.peers.peers and leader.peers.peers["fb"].holdings.header,
                     timeout_s=30, what="the newcomer's advert of its header")
    return bus, leader, joiner


def header_pieces(svc) -> set[int]:
    return set(svc.manifest.header.piece_range)


async def test_a_member_still_loading_gets_no_target_from_a_plan_that_guesses_it_takes_every_layer(
        tmp_path, no_local_model):
    replans: list = []
    bus, leader, joiner = await a_home(tmp_path, replans)
    try:
        assert joiner.held.entry.have == header_pieces(joiner) and joiner.own.target is None

        def guessed(ids):  # the planner, with the shipped default for the newcomer: it alone, every layer
            return plan(("fb", 0, LAYERS)) if "fb" in ids else plan(("0a", 0, LAYERS))
        current = guessed(["0a"])
        assert leader.gate(current, current, ["0a"], leader.identity, guessed) == current
        assert not [m for _, to, m in bus.sent if to == "fb" and isinstance(m, ShareTarget)]
        assert joiner.own.target is None and not joiner.own.running
        assert joiner.held.entry.have == header_pieces(joiner), "nothing beyond the header on a guess"

        # once it is loaded (and planned by its own profile) the plan it is a member of gives it [0, 2)
        informed = plan(("fb", 0, 2), ("0a", 2, LAYERS))
        assert leader.gate(informed, current, ["0a", "fb"], leader.identity, guessed) is None  # current serves
        assert leader.leader.waiting == {"fb": (0, 2)}
        await eventually(lambda: joiner.own.state == "done" and replans, timeout_s=30, what="the newcomer's fetch of [0, 2)")
        assert joiner.held.entry.have == set(joiner.own.pieces_for(0, 2))  # exactly its range and the header
        fetch = joiner.status()["fetch"]
        assert fetch["every_layer_fetches"] == 0 and joiner.status()["holds"]["layers"] == [[0, 2]]
        assert fetch["fetched_bytes_total"] == joiner.manifest.bytes_of(joiner.own.pieces_for(0, 2))  # once each
    finally:
        await close_all(bus)


async def test_a_narrower_target_replaces_a_whole_range_fetch_and_the_whole_range_is_never_silent(
        tmp_path, no_local_model):
    bus, leader, joiner = await a_home(tmp_path)
    lend = threading.Event()  # the leader lends nothing until it is set: the fetch is caught in flight
    asked = []
    honest = leader.endpoint.read_checked

    def held_back(i):
        asked.append(i)
        assert lend.wait(60), "the test never let the leader lend"
        return honest(i)
    leader.endpoint.read_checked = held_back
    try:
        with all_log_events() as logs:
            whole = joiner.own.set_target(0, LAYERS, why="the leader 0a")
            await eventually(lambda: asked, timeout_s=30, what="pieces of the whole range in flight")
            assert [e for e in logs if e["event"] == "share_fetch_every_layer"], "logged, with who asked"
            assert joiner.status()["fetch"]["every_layer_fetches"] == 1
            narrow = joiner.own.set_target(0, 2, why="the leader 0a")
            assert narrow is not whole
            await asyncio.gather(whole, return_exceptions=True)
            assert whole.cancelled()
            lend.set()
            await asyncio.wait_for(narrow, 60)
        assert joiner.held.entry.have == set(joiner.own.pieces_for(0, 2)), "only the newest target's pieces"
        assert joiner.own.target == (0, 2) and joiner.held.entry.target == (0, 2)
    finally:
        lend.set()
        await close_all(bus)
