"""The reference profiles travel with the package, and their absence is said, not an equal split in silence.

(tests/test_systemd_install.py builds the wheel itself and checks its ``meshd/profiles/``.)
"""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path

import pytest

from meshd.mesh import home_plan as plan_mod
from meshd.cli import main
from meshd.mesh.home_plan import MemberInput, plan_home, shipped_profiles_dir
from tests.support.logs import all_log_events

ROOT = Path(__file__).resolve().parents[2]


def test_the_package_data_ships_the_reviewed_profiles():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "profiles/*.json" in config["package-data"]["meshd"]
    assert any(pattern.startswith("meshd") for pattern in config["packages"]["find"]["include"])
    shipped = shipped_profiles_dir()
    assert shipped == ROOT / "meshd" / "profiles"
    assert os.readlink(ROOT / "meshd" / "profiles") == "../profiles"  # one set, measured and reviewed
    assert sorted(p.name for p in shipped.glob("*.json")) == sorted(p.name for p in (ROOT / "profiles").glob("*.json"))
    assert plan_mod.default_profile() is not None


def test_meshd_plan_finds_a_shipped_profile_by_name_from_anywhere(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # no profiles/ here: an installed meshd's situation
    assert main(["plan", "--profile", "x86_64-2core-1thread", "--profile",
                 "profiles/x86_64-2core-1thread.json@speed=0.5,id=slow", "--max-seq", "256", "--json"]) == 0
    captured = capsys.readouterr()
    assert {s["device"] for s in json.loads(captured.out.strip().splitlines()[-1])["stages"]} <= \
        {"x86_64-2core-1thread", "slow"}
    assert str(shipped_profiles_dir()) in captured.err


@pytest.fixture
def nothing_shipped(tmp_path, monkeypatch):
    empty = tmp_path / "profiles"
    empty.mkdir()
    monkeypatch.setattr(plan_mod, "shipped_profiles_dir", lambda: empty)
    monkeypatch.setattr(plan_mod, "_said_none_shipped", set())
    return empty


def test_without_shipped_profiles_meshd_plan_says_the_installation_is_incomplete(nothing_shipped, capsys):
    assert main(["plan", "--profile", "x86_64-2core-1thread"]) == 1
    err = capsys.readouterr().err
    assert "incomplete" in err and str(nothing_shipped) in err and "\n" not in err.strip()


def test_without_shipped_profiles_the_daemon_says_so_once_and_its_plan_says_why(nothing_shipped):
    members = [MemberInput("a", 4000), MemberInput("b", 4000)]
    with all_log_events() as logs:
        plans = [plan_home(v, "a", members, 30) for v in (1, 2)]
    said = [e for e in logs if e["event"] == "shipped_profiles_missing"]
    assert len(said) == 1 and said[0]["path"] == str(nothing_shipped)
    assert all(p.reason.startswith("equal split") and "none shipped" in p.reason for p in plans)
