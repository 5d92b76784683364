"""The plan's wire form: half-open ranges under an explicit name, readable by members on 0.2,
and the cut table the leader ships in a form that fits a message header."""

from __future__ import annotations

import dataclasses
import json

import pytest

from meshd.state import json_digest as meshd_json_digest
from partition.link import parse_link
from partition.cuttable import CutTable
from partition.plan import Plan
from partition.planner import make_plan
from partition.stages import RANGE_KEY, StageAssignment as Stage, range_from_wire, range_to_wire
from partition.synthetic import synthetic_profile
from transport.messages import PlanUpdate, decode, encode
from transport.wire import DEFAULT_LIMITS

# What a 0.2 leader broadcast for a two-stage plan (meshd/mesh/home_plan.py at 0.2.0: "last" is the exclusive end)
ASSIGNMENT_0_2 = {
    "a": {"stage": 0, "first": 0, "last": 12, "num_layers": 30, "predicted_bottleneck_s": 0.5,
          "reason": "compute: ...", "leader": "a", "members": ["a", "b"], "weights": "float32",
          "model": "smol.gguf@aa"},
    "b": {"stage": 1, "first": 12, "last": 30, "num_layers": 30, "predicted_bottleneck_s": 0.5,
          "reason": "compute: ...", "leader": "a", "members": ["a", "b"], "weights": "float32",
          "model": "smol.gguf@aa"},
}


def read_as_0_2(version: int, assignment: dict) -> tuple[tuple[str, int, int], ...]:
    """What meshd 0.2's ``Plan.from_assignment`` took from each row: node, ``first``, ``last`` (exclusive)."""
    rows = sorted(assignment.items(), key=lambda kv: int(kv[1]["stage"]))
    return tuple((str(n), int(d["first"]), int(d["last"])) for n, d in rows)


@pytest.fixture(scope="module")
def planned() -> Plan:
    profiles = [synthetic_profile(n, speed=s) for n, s in (("a", 1.0), ("b", 1.6))]
    plan = make_plan(profiles, parse_link("1gbit,0.5ms"), 2048, plan_seq_len=512)
    assert len(plan.stages) > 1 and plan.cut_table is not None
    return dataclasses.replace(plan, version=7, leader="a", members=("a", "b"), weights="float32")


def test_one_function_reads_every_spelling_a_layer_range_has_had():
    assert range_from_wire({RANGE_KEY: [3, 9]}) == (3, 9)
    assert range_from_wire({"first": 3, "last": 9}) == (3, 9)  # the wire before 0.3: exclusive "last"
    assert range_from_wire({"first_layer": 3, "end_layer": 9}) == (3, 9)  # plan files, schema 2
    assert range_from_wire({"first_layer": 3, "last_layer": 8}) == (3, 9)  # schema 1: inclusive
    assert range_to_wire(3, 9) == {RANGE_KEY: [3, 9], "first": 3, "last": 9}
    assert range_from_wire(range_to_wire(3, 9)) == (3, 9)


def test_a_plan_from_a_0_2_leader_is_read_and_carries_no_cut_table():
    plan = Plan.from_assignment(4, ASSIGNMENT_0_2)
    assert plan.stages == (Stage("a", 0, 12), Stage("b", 12, 30)) and plan.num_layers == 30
    assert plan.cut_table is None and plan.model == "smol.gguf@aa" and plan.weights == "float32"
    assert plan.members == ("a", "b") and plan.leader == "a" and plan.predicted_bottleneck_s == 0.5


def test_what_we_send_a_0_2_member_reads_as_the_same_half_open_stages(planned):
    rows = planned.to_assignment()
    assert read_as_0_2(planned.version, rows) == tuple((s.node_id, s.first, s.end) for s in planned.stages)
    for s in planned.stages:
        assert rows[s.node_id][RANGE_KEY] == [s.first, s.end]


def test_the_shipped_cut_table_arrives_exact_through_the_message_codec(planned):
    frames = encode(PlanUpdate(planned.version, planned.to_assignment()))
    assert len(frames[0]) < DEFAULT_LIMITS.max_header_bytes // 2  # room to spare under the header cap
    got = Plan.from_assignment(planned.version, decode(frames).message.assignment)
    assert got.cut_table == planned.cut_table
    assert got.stages == tuple(Stage(s.node_id, s.first, s.end) for s in planned.stages)
    assert got.digest() == planned.digest()
    assert sum("cut_table" in row for row in planned.to_assignment().values()) == 1  # not once per row


def test_a_cut_table_for_many_stages_still_fits_a_header():
    """Eight stages, up to 31 cuts per prompt length, as equal splits of every prompt: it ships."""
    cuts = tuple(tuple(y * j // k for j in range(1, k)) for y in range(2049) for k in [max(1, min(32, y // 8))])
    table = CutTable(2048, 32, 8, cuts, tuple(0.001 * y + 0.05 for y in range(2049)))
    stages = tuple(Stage(f"d{i}", 4 * i, 4 * i + 4) for i in range(8))
    rows = Plan(1, stages, 32, cut_table=table).to_assignment()
    assert len(encode(PlanUpdate(1, rows))[0]) < DEFAULT_LIMITS.max_header_bytes
    assert Plan.from_assignment(1, rows).cut_table == table


def test_a_cut_table_too_large_for_a_header_is_left_out_and_the_plan_still_goes():
    import random

    rng = random.Random(31)
    cuts = tuple(tuple(sorted(rng.sample(range(1, y), min(31, (y - 1) // 8)))) if y > 1 else ()
                 for y in range(2049))
    table = CutTable(2048, 32, 8, cuts, tuple(rng.uniform(0, 9) for _ in range(2049)))
    assert CutTable.from_wire(table.to_wire()) == table
    stages = tuple(Stage(f"d{i}", 4 * i, 4 * i + 4) for i in range(8))
    rows = Plan(1, stages, 32, cut_table=table).to_assignment()
    assert len(encode(PlanUpdate(1, rows))[0]) < DEFAULT_LIMITS.max_header_bytes
    assert Plan.from_assignment(1, rows).cut_table is None  # members build their own


@pytest.mark.parametrize("spoil", [
    lambda w: {**w, "cuts": b"not zlib"},
    lambda w: {**w, "width": w["width"] + 1},  # the matrix does not have that shape
    lambda w: {**w, "max_seq": 1 << 30},  # would make us allocate gigabytes
    lambda w: {k: v for k, v in w.items() if k != "latency_s"},
])
def test_an_unreadable_cut_table_is_dropped_and_the_plan_kept(planned, spoil):
    rows = planned.to_assignment()
    first = planned.stages[0].node_id
    rows[first] = {**rows[first], "cut_table": spoil(rows[first]["cut_table"])}
    got = Plan.from_assignment(planned.version, rows)
    assert got.cut_table is None and got.digest() == planned.digest()


def test_a_cut_table_with_cuts_outside_its_prompt_is_refused():
    bad = CutTable(4, 4, 1, ((), (), (1,), (2, 1), (1, 3)), (0.0, 0.1, 0.2, 0.3, 0.4))  # row 3 descends
    with pytest.raises(ValueError, match="row 3"):
        CutTable.from_wire(bad.to_wire())


def test_the_digest_is_the_one_members_of_every_version_compute(planned):
    """Stages and layer count only: mode, model, cut table and the planner's account are left out."""
    expect = meshd_json_digest([planned.num_layers, [[s.node_id, s.first, s.end] for s in planned.stages]])
    assert planned.digest() == expect
    bare = Plan(planned.version, tuple(Stage(s.node_id, s.first, s.end) for s in planned.stages),
                planned.num_layers)
    assert bare.digest() == planned.digest()
    assert dataclasses.replace(planned, cut_table=None, model="x", weights="").digest() == planned.digest()


def test_the_plan_file_round_trips_with_the_daemon_fields(planned):
    again = Plan.from_json(planned.to_json())
    assert again == planned
    assert json.loads(planned.to_json())["stages"][0]["end_layer"] == planned.stages[0].end
