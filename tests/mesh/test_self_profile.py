"""A daemon without a profile of its model times itself once, and is planned by what it measured."""

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from meshd.mesh.home_plan import MemberInput, plan_home, shipped_profiles_dir
from meshd.model.self_profile import describe, reference_for, settle
from meshd.state import StateDir
from partition import profile as pf

SHIPPED = shipped_profiles_dir() / "x86_64-2core-1thread.json"  # float32: the mode of a daemon that names none
SHIPPED_PACKED = shipped_profiles_dir() / "x86_64-2core-1thread-packed.json"
MODEL = json.loads(SHIPPED.read_text())["model"]["identity"]


class Timer:
    """Stands in for the one-layer timing: a fixed speed, and how often it was asked."""

    def __init__(self, speed: float):
        self.speed, self.calls = speed, 0

    def __call__(self, source, reference, threads=1):
        self.calls += 1
        return self.speed


def state_dir(tmp_path) -> StateDir:
    return StateDir(tmp_path / "state").ensure()


def run(state, timer, model=MODEL, **kw):
    args = dict(mode="quick", threads=2, on_cpu=True, reference_dirs=[shipped_profiles_dir()], estimate=timer)
    args.update(kw)
    return settle(state, SimpleNamespace(identity=model), **args)


def test_a_device_without_a_profile_measures_itself_and_keeps_the_result(tmp_path):
    state, timer = state_dir(tmp_path), Timer(0.5)
    got = run(state, timer)
    assert got.how == "measured" and timer.calls == 1
    assert got.path.parent == state.profiles_dir
    prof = pf.DeviceProfile.from_dict(got.profile)
    ref = pf.load(SHIPPED)
    assert prof.model.identity == MODEL and prof.threads == 2
    assert prof.q(128, 0) == pytest.approx(2 * ref.q(128, 0))  # half as fast: every latency doubled
    assert state.own_profile(MODEL) == got.profile
    assert describe(got.profile).startswith(f"0.50x {ref.device_id}")


def test_the_next_start_reuses_the_measurement(tmp_path):
    state, timer = state_dir(tmp_path), Timer(1.3)
    first = run(state, timer)
    again = run(state, timer)
    assert again.how == "reused" and again.profile == first.profile and timer.calls == 1


def test_an_installed_full_profile_wins_and_nothing_is_measured(tmp_path):
    state, timer = state_dir(tmp_path), Timer(0.5)
    shutil.copy(SHIPPED, state.profiles_dir / "mine.json")
    got = run(state, timer)
    assert got.how == "installed" and timer.calls == 0
    assert describe(got.profile).startswith("measured ")


def test_a_profile_of_another_model_is_not_used(tmp_path):
    state, timer = state_dir(tmp_path), Timer(0.8)
    other = json.loads(SHIPPED.read_text())
    other["model"]["identity"] = "other.gguf@0123"
    (state.profiles_dir / "other.json").write_text(json.dumps(other))
    assert state.own_profile() == other  # the newest of any model, as before
    got = run(state, timer)
    assert got.how == "measured" and got.profile["model"]["identity"] == MODEL


@pytest.mark.parametrize("kw, why", [
    (dict(mode="off"), "self-profiling is off"),
    (dict(on_cpu=False), "runs on a GPU"),
    (dict(model="unknown.gguf@feed"), "no shipped profile of this model"),
])
def test_without_a_way_to_measure_the_shipped_default_stays_and_says_why(tmp_path, kw, why):
    state, timer = state_dir(tmp_path), Timer(0.5)
    got = run(state, timer, **kw)
    assert got.profile is None and got.how.startswith("shipped default:") and why in got.how
    assert timer.calls == 0 and not list(state.profiles_dir.glob("*.json"))


def test_a_daemon_scales_the_reference_measured_in_its_own_numeric_mode(tmp_path):
    got = run(state_dir(tmp_path), Timer(0.5), weights="packed")
    assert got.profile["dtype"] == "packed"
    assert pf.DeviceProfile.from_dict(got.profile).q(128, 0) == pytest.approx(2 * pf.load(SHIPPED_PACKED).q(128, 0))
    assert reference_for(MODEL, [shipped_profiles_dir()], "float32") == SHIPPED


def test_only_full_profiles_serve_as_references(tmp_path):
    d = tmp_path / "refs"
    d.mkdir()
    scaled = json.loads(SHIPPED.read_text())
    scaled["scaled_from"] = {"device_id": "x", "speed_factor": 2.0}
    (d / "a.json").write_text(json.dumps(scaled))
    assert reference_for(MODEL, [d]) is None
    shutil.copy(SHIPPED, d / "b.json")
    assert reference_for(MODEL, [d]) == d / "b.json"


def test_a_slow_device_that_measured_itself_is_planned_by_its_speed(tmp_path):
    """The point of measuring: with the shipped profile for both, a device 4x slower would get
    half the layers and set the pace; measured, it gets a small share or none."""
    fast = run(state_dir(tmp_path / "a"), Timer(1.0)).profile
    slow = run(state_dir(tmp_path / "b"), Timer(0.25)).profile
    members = [MemberInput("fast", 8192, fast), MemberInput("slow", 8192, slow)]
    planned = plan_home(1, "fast", members, 30)
    stages, reason = planned.stages, planned.reason
    share = {s.node_id: s.end - s.first for s in stages}
    assert share.get("slow", 0) <= 8, (share, reason)
    assert share["fast"] >= 22
    equal = plan_home(1, "fast", [MemberInput("fast", 8192, None), MemberInput("slow", 8192, None)], 30)
    assert all(13 <= s.end - s.first <= 17 for s in equal.stages)  # both look alike: about half each


def test_the_real_one_layer_timing_gives_a_usable_profile(tmp_path, real_source):
    state = state_dir(tmp_path)
    got = settle(state, real_source, mode="quick", threads=1, on_cpu=True,
                 reference_dirs=[shipped_profiles_dir()])
    assert got.how == "measured"
    speed = got.profile["scaled_from"]["speed_factor"]
    assert 0.05 < speed < 20, speed  # any machine that runs the suite, loaded or not
    pf.DeviceProfile.from_dict(got.profile)  # a valid profile the planner can read
    assert Path(got.path).name.startswith("self-")


def _identities() -> list[str]:
    from meshd.model.store import CATALOG, DEFAULT_MODEL

    models = [(DEFAULT_MODEL.name, DEFAULT_MODEL.sha256)] + [(m.file_name, m.sha256) for m in CATALOG.values()]
    return [f"{name}@{sha[:16]}" for name, sha in models]


@pytest.mark.parametrize("identity", _identities())
def test_every_model_meshd_can_pull_has_a_shipped_profile_in_the_cpu_default_mode(identity):
    """Without one, a home of that model plans an equal split and no device can time itself
    against a reference (the recommended Home Assistant model was such a case)."""
    from meshd.mesh.home_plan import default_profile

    found = reference_for(identity, [shipped_profiles_dir()], "packed")
    assert found is not None, f"no profile of {identity} in profiles/: run `meshd profile --model ... --weights packed`"
    data = json.loads(found.read_text())
    assert data["dtype"] == "packed" and not data.get("scaled_from")
    assert default_profile("packed", identity)["model"]["identity"] == identity
