"""A PlanUpdate between this meshd and one on 0.2, both ways, through each side's real code.

The 0.2 side is the repository's own code at the last 0.2 commit before the wire named
its ranges ``layers_v2`` and leaders shipped cut tables, taken with ``git archive``
(skipped where the clone lacks that history). It decodes our frames with its strict
decoder and reads the plan with its ``Plan.from_assignment``; it sends one of its own,
which we read.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest

from partition.link import parse_link
from partition.plan import Plan
from partition.planner import make_plan
from partition.synthetic import synthetic_profile
from transport.messages import PlanUpdate, decode, encode

ROOT = Path(__file__).resolve().parents[2]
LAST_0_2 = "10984ed"  # meshd 0.2.0: stage rows say first/last (exclusive), no cut table

OLD_SIDE = r"""
import json, sys, msgpack
from meshd.plan import Plan
from partition.plan import StageAssignment
from transport.messages import PlanUpdate, decode, encode
ours = decode(msgpack.unpackb(open(sys.argv[1], "rb").read())).message
plan = Plan.from_assignment(ours.plan_version, ours.assignment)
theirs = Plan(9, (StageAssignment("x", 0, 11), StageAssignment("y", 11, 30)), 30, 0.4, "compute: x", "x",
              ("x", "y"), "float32", "smol.gguf@aa")
open(sys.argv[2], "wb").write(msgpack.packb(encode(PlanUpdate(9, theirs.to_assignment()))))
print(json.dumps({"stages": [[s.node_id, s.first, s.end] for s in plan.stages], "digest": plan.digest(),
                  "model": plan.model, "members": list(plan.members)}))
"""


@pytest.fixture(scope="module")
def old_tree(tmp_path_factory):
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", LAST_0_2, "meshd", "transport", "partition",
                              "decoding"], capture_output=True)
    if archive.returncode != 0:
        pytest.skip(f"this clone lacks commit {LAST_0_2} (shallow?)")
    tree = tmp_path_factory.mktemp("meshd-0.2")
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    return tree


def test_a_0_2_member_reads_our_plan_and_we_read_its(old_tree, tmp_path):
    profiles = [synthetic_profile("a", speed=1.0), synthetic_profile("b", speed=1.6)]
    plan = make_plan(profiles, parse_link("1gbit,0.5ms"), 2048, plan_seq_len=512)
    plan = dataclasses.replace(plan, version=7, leader="a", members=("a", "b"), weights="float32")
    assert len(plan.stages) == 2 and plan.cut_table is not None
    (tmp_path / "ours").write_bytes(msgpack.packb(encode(PlanUpdate(7, plan.to_assignment()))))

    env = {**os.environ, "PYTHONPATH": str(old_tree)}
    out = subprocess.run([sys.executable, "-c", OLD_SIDE, str(tmp_path / "ours"), str(tmp_path / "theirs")],
                         capture_output=True, text=True, cwd=old_tree, env=env, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    read = json.loads(out.stdout.strip().splitlines()[-1])
    assert read["stages"] == [[s.node_id, s.first, s.end] for s in plan.stages]  # the same half-open ranges
    assert read["digest"] == plan.digest() and read["members"] == ["a", "b"] and read["model"] == plan.model

    theirs = decode(msgpack.unpackb((tmp_path / "theirs").read_bytes())).message
    got = Plan.from_assignment(theirs.plan_version, theirs.assignment)
    assert [(s.node_id, s.first, s.end) for s in got.stages] == [("x", 0, 11), ("y", 11, 30)]
    assert got.cut_table is None and got.model == "smol.gguf@aa" and got.members == ("x", "y")
