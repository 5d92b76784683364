"""The leader's plans go out with their cut table, built off the event loop; a newer decision wins."""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import pytest

from meshd.mesh import home_plan as plan_mod
from meshd.mesh.home_plan import MemberInput, PlanIssuer
from partition.cuttable import CutTable
from partition.plan import Plan
from partition.stages import StageAssignment as Stage
from tests.support.waiting import eventually

TABLE = CutTable(1, 2, 1, ((), ()), (0.0, 0.1))
MEMBERS = [MemberInput("a", 4000), MemberInput("b", 4000)]


def two_stage(version: int, split: int = 15, model: str = "m@1") -> Plan:
    return Plan(version, (Stage("a", 0, split), Stage("b", split, 30)), 30, leader="a", members=("a", "b"),
                model=model)


class SlowTable:
    """The table build, held in its thread until the test releases it; counts the builds done."""

    def __init__(self):
        self.release, self.started = threading.Event(), threading.Event()
        self.done = 0

    def __call__(self, plan, members):
        self.started.set()
        assert self.release.wait(30)
        self.done += 1
        return TABLE


@pytest.fixture
def slow_table(monkeypatch) -> SlowTable:
    table = SlowTable()
    monkeypatch.setattr(plan_mod, "home_cut_table", table)
    return table


async def issuing(plan: Plan, table: SlowTable) -> tuple[PlanIssuer, list[Plan]]:
    """An issuer given ``plan``, once its table is being built."""
    sent: list[Plan] = []
    issuer = PlanIssuer(sent.append)
    issuer.issue(plan, MEMBERS)
    await eventually(table.started.is_set, 30, "the table being built")
    return issuer, sent


async def test_a_plan_goes_out_once_its_table_is_built_and_the_loop_runs_meanwhile(slow_table):
    issuer, sent = await issuing(two_stage(2), slow_table)
    for _ in range(5):
        await asyncio.sleep(0)  # sleep-ok: yields the loop, which must stay free while the table is built
    assert sent == [] and issuer.waiting_for(two_stage(2)) and not issuer.waiting_for(two_stage(2, 10))
    issuer.issue(two_stage(2), MEMBERS)  # decided again: nothing new
    slow_table.release.set()
    await eventually(lambda: sent, 30, "the plan sent")
    assert sent == [dataclasses.replace(two_stage(2), cut_table=TABLE)]
    assert issuer.pending is None and slow_table.done == 1


async def test_a_newer_decision_replaces_one_still_being_finished(slow_table):
    issuer, sent = await issuing(two_stage(2), slow_table)
    issuer.issue(two_stage(2, 10), MEMBERS)
    slow_table.release.set()
    await eventually(lambda: slow_table.done == 2 and sent, 30, "both tables built and one plan sent")
    await asyncio.sleep(0)  # sleep-ok: one turn of the loop, for anything the table's completion schedules
    assert [p.stages[0].end for p in sent] == [10]


async def test_a_withdrawn_plan_never_goes_out(slow_table):
    issuer, sent = await issuing(two_stage(2), slow_table)
    issuer.withdraw()
    slow_table.release.set()
    await eventually(lambda: slow_table.done == 1, 30, "the table built")
    for _ in range(5):
        await asyncio.sleep(0)  # sleep-ok: one turn of the loop, for anything the table's completion schedules
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
