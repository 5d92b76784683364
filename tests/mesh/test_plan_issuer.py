"""The leader's plans go out with their cut table, built off the event loop; a newer decision wins."""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import pytest

from meshd import plan as plan_mod
from meshd.plan import MemberInput, PlanIssuer
from partition.cuttable import CutTable
from partition.plan import Plan, StageAssignment as Stage

TABLE = CutTable(1, 2, 1, ((), ()), (0.0, 0.1))
MEMBERS = [MemberInput("a", 4000), MemberInput("b", 4000)]


def two_stage(version: int, split: int = 15, model: str = "m@1") -> Plan:
    return Plan(version, (Stage("a", 0, split), Stage("b", split, 30)), 30, leader="a", members=("a", "b"),
                model=model)


@pytest.fixture
def slow_table(monkeypatch):
    """The table build, held in its thread until the test lets it finish."""
    release, started = threading.Event(), threading.Event()

    def build(plan, members):
        started.set()
        assert release.wait(30)
        return TABLE

    monkeypatch.setattr(plan_mod, "home_cut_table", build)
    return release, started


async def wait_until(predicate, timeout_s: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def test_a_plan_goes_out_once_its_table_is_built_and_the_loop_runs_meanwhile(slow_table):
    release, started = slow_table
    sent: list[Plan] = []
    issuer = PlanIssuer(sent.append)
    issuer.issue(two_stage(2), MEMBERS)
    await wait_until(started.is_set)
    for _ in range(5):
        await asyncio.sleep(0)  # the loop is free while the table is built
    assert sent == [] and issuer.waiting_for(two_stage(2)) and not issuer.waiting_for(two_stage(2, 10))
    issuer.issue(two_stage(2), MEMBERS)  # decided again: nothing new
    release.set()
    await wait_until(lambda: sent)
    assert sent == [dataclasses.replace(two_stage(2), cut_table=TABLE)]
    assert issuer.pending is None


async def test_a_newer_decision_replaces_one_still_being_finished(slow_table):
    release, started = slow_table
    sent: list[Plan] = []
    issuer = PlanIssuer(sent.append)
    issuer.issue(two_stage(2), MEMBERS)
    await wait_until(started.is_set)
    issuer.issue(two_stage(2, 10), MEMBERS)
    release.set()
    await wait_until(lambda: sent)
    await asyncio.sleep(0.05)
    assert [p.stages[0].end for p in sent] == [10]


async def test_a_withdrawn_plan_never_goes_out(slow_table):
    release, started = slow_table
    sent: list[Plan] = []
    issuer = PlanIssuer(sent.append)
    issuer.issue(two_stage(2), MEMBERS)
    await wait_until(started.is_set)
    issuer.withdraw()
    release.set()
    await asyncio.sleep(0.1)
    assert sent == [] and issuer.pending is None


@pytest.mark.parametrize("plan", [
    Plan(2, (Stage("a", 0, 30),), 30, model="m@1"),  # one stage: prompts are never cut
    two_stage(2, model=""),  # a home serving no model
    Plan(2, two_stage(2).stages, 30, model="m@1", cut_table=TABLE),  # already has one
])
async def test_a_plan_that_needs_no_table_goes_out_at_once(plan, monkeypatch):
    monkeypatch.setattr(plan_mod, "home_cut_table", lambda *a: pytest.fail("built a table it needs not"))
    sent: list[Plan] = []
    PlanIssuer(sent.append).issue(plan, MEMBERS)
    assert sent == [plan]
