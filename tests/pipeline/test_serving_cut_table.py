"""A member cuts prompts with the cut table its leader shipped, and builds one itself only
for a plan without one (a leader on meshd 0.2), saying so once."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from meshd.pipeline import serving
from meshd.pipeline.serving import ServingRole, route_from_plan
from meshd.mesh.home_plan import shipped_profiles_dir
from partition.cuttable import CutTable
from partition.plan import Plan
from partition.stages import StageAssignment as Stage
from tests.support.logs import all_log_events

SHIPPED = json.loads((shipped_profiles_dir() / "x86_64-2core-1thread.json").read_text())
STAGES = (Stage("a", 0, 15), Stage("b", 15, 30))


class Stub:
    """Coordinator and stage service stand-ins: they record, and deploy at once."""

    def __init__(self):
        self.round_cost = SimpleNamespace(prior=lambda slope: None)
        self.routes = []
        self.mode = ""

    def set_route(self, route):
        self.routes.append(route)

    def set_routes(self, routes):
        self.routes.append(routes[0] if routes else None)

    async def deploy(self, route):
        pass


def role() -> ServingRole:
    source = SimpleNamespace(config=SimpleNamespace(num_layers=30), identity="other.gguf@2")  # another model: no warm-up
    stub = Stub()
    return ServingRole(source, stub, stub, lambda nid: ("", ""), lambda: {"a": SHIPPED, "b": SHIPPED},
                       "100mbit,2ms")


def table_cutting_at(prompt_len: int, cuts: tuple[int, ...]) -> CutTable:
    rows = tuple(cuts if y == prompt_len else () for y in range(prompt_len + 1))
    return CutTable(prompt_len, 4, 1, rows, tuple(0.0 for _ in rows))


async def test_a_shipped_cut_table_is_used_as_it_came(monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("a member rebuilt the table its leader shipped")

    monkeypatch.setattr(serving, "cut_table_for", never)
    r = role()
    shipped = Plan(3, STAGES, 30, leader="a", model="m@1", cut_table=table_cutting_at(600, (250, 400)))
    await r.adopt(Plan.from_assignment(3, shipped.to_assignment()))
    assert r.cuts(600, route_from_plan(shipped, r.directory)) == [250, 400]


async def test_a_plan_without_a_table_gets_one_built_here_and_it_is_said_once():
    r = role()
    with all_log_events() as logs:
        for version in (4, 5):  # from a 0.2 leader: first/last rows, no cut table
            await r.adopt(Plan.from_assignment(version, {
                "a": {"stage": 0, "first": 0, "last": 15, "num_layers": 30, "leader": "a", "model": "m@1"},
                "b": {"stage": 1, "first": 15, "last": 30, "num_layers": 30, "leader": "a", "model": "m@1"}}))
    said = [e for e in logs if e["event"] == "cut_table_built_here"]
    assert len(said) == 1 and said[0]["plan_version"] == 4
    route = route_from_plan(Plan(5, STAGES, 30), r.directory)
    expect = serving.cut_table_for(route, {"a": SHIPPED, "b": SHIPPED}, 30, "100mbit,2ms")
    assert r.cuts(2000, route) == list(expect.lookup(2000)) and r.cut_table_errors == 0
