"""A home mid-upgrade: a daemon of this version and one of the last strict release (0.1) serve together.

The old one is the repository's own code at the commit before heartbeats became
extensible, taken with ``git archive`` into a temp dir (skipped where the clone
lacks that history). Before, the upgraded device's heartbeats carried a field the
old daemon refused, so the old one saw it as gone while it saw the old one ready.
"""

from __future__ import annotations

import shutil
import subprocess
import time

import pytest

from tests.support.daemons import summary

from tests.support.waiting import wait_until
from tests.support.daemons import GONE_AFTER_S, READY_WITHIN_S, all_ready
from tests.support.repo import ROOT

LAST_STRICT = "bd9841b"  # meshd 0.1.0: heartbeats refuse fields they lack


@pytest.fixture
def old_tree(tmp_path):
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", LAST_STRICT, "meshd", "transport",
                              "partition", "decoding", "profiles"], capture_output=True)
    if archive.returncode != 0:
        pytest.skip(f"this clone lacks commit {LAST_STRICT} (shallow?)")
    subprocess.run(["tar", "-x", "-C", str(tmp_path)], input=archive.stdout, check=True)
    return tmp_path


def test_a_member_upgraded_first_and_one_not_yet_upgraded_see_each_other_and_share_one_plan(mesh, old_tree):
    old = mesh.spawn("old", new_home="flat", prefix=["env", "--chdir", str(old_tree)])
    old.wait_serving()
    new = mesh.spawn("new", token=mesh.invite(old))
    new.wait_serving()
    wait_until(all_ready([old, new], ["old", "new"]), READY_WITHIN_S, what="old and new ready on both",
               explain=lambda: summary(old, new))
    versions = {m["name"]: m["version"] for m in new.status()["members"]}
    assert versions["old"] == "0.1.0" and versions["new"] != "0.1.0"

    # Still so a few heartbeat periods later (the old one would call the new one gone after GONE_AFTER_S).
    settle = time.monotonic() + GONE_AFTER_S + 1.0
    while time.monotonic() < settle:
        assert all_ready([old, new], ["old", "new"])(), summary(old, new)
        time.sleep(0.25)  # sleep-ok: the claim is about a span of time (longer than gone-after); sampled
    assert old.status()["plan"] == new.status()["plan"]
    assert [e for e in old.events() if e["event"] == "protocol_error"] == []  # nothing of ours refused
