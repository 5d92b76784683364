"""Re-planning: the plan the coordinator computes over the ready members."""

from __future__ import annotations

import dataclasses

import pytest

from meshd.mesh import home_plan as plan_mod
from meshd.mesh.home_plan import MemberInput, equal_split, plan_home
from partition.plan import Plan
from partition.stages import StageAssignment as Stage
from tests.support.logs import all_log_events


def test_equal_split_tiles_the_layers_in_node_id_order():
    assert equal_split(["b", "a", "c"], 10) == [Stage("a", 0, 4), Stage("b", 4, 7), Stage("c", 7, 10)]
    assert equal_split(["a", "b", "c"], 2) == [Stage("a", 0, 1), Stage("b", 1, 2)]


def test_without_any_profile_the_plan_is_an_equal_split_and_says_so(monkeypatch):
    monkeypatch.setattr(plan_mod, "default_profile", lambda weights="", model="": None)
    p = plan_home(3, "a", [MemberInput("a", 1000), MemberInput("b", 1000)], 30)
    assert p.stages == (Stage("a", 0, 15), Stage("b", 15, 30))
    assert p.version == 3 and p.leader == "a" and p.members == ("a", "b")
    assert p.reason.startswith("equal split")


def test_with_profiles_the_partition_planner_decides_and_predicts_the_bottleneck():
    if plan_mod.default_profile() is None:
        pytest.skip("no shipped profile in profiles/")
    members = [MemberInput(n, 8000) for n in ("a", "b")]
    p = plan_home(1, "a", members, plan_mod.default_profile()["model"]["num_layers"])
    assert p.predicted_bottleneck_s and p.predicted_bottleneck_s > 0
    assert not p.reason.startswith("equal split")
    p.check()


def test_the_plan_reason_explains_its_bottleneck_in_words():
    """Not a bare code word ("link"): the kind, then the planner's explanation of it."""
    if plan_mod.default_profile() is None:
        pytest.skip("no shipped profile in profiles/")
    members = [MemberInput(n, 8000) for n in ("a", "b")]
    p = plan_home(1, "a", members, plan_mod.default_profile()["model"]["num_layers"])
    kind, _, words = p.reason.partition(": ")
    assert kind in ("compute", "memory", "link") and "layers" in words and " s" in words


def test_a_member_without_a_profile_is_planned_with_the_shipped_profile_of_its_own_model(tmp_path, monkeypatch):
    """Another model's profile has other layer times and another layer count: the planner would
    refuse it and the home would fall back to an equal split."""
    import json

    shipped = [p for p in sorted(plan_mod.shipped_profiles_dir().glob("*.json"))]
    if not shipped:
        pytest.skip("no shipped profile in profiles/")
    ours = json.loads(shipped[0].read_text())
    other = json.loads(shipped[0].read_text())
    other["model"] = {**other["model"], "identity": "other.gguf@0123456789abcdef", "num_layers": 24}
    other["device_id"] = "aaa-first-by-name"
    (tmp_path / "aaa.json").write_text(json.dumps(other))
    (tmp_path / "zzz.json").write_text(json.dumps(ours))
    monkeypatch.setattr(plan_mod, "shipped_profiles_dir", lambda: tmp_path)
    mode = ours.get("dtype", "")
    assert plan_mod.default_profile(mode, "other.gguf@0123456789abcdef")["model"]["num_layers"] == 24
    assert plan_mod.default_profile(mode, ours["model"]["identity"])["device_id"] == ours["device_id"]
    p = plan_home(1, "a", [MemberInput("a", 8000), MemberInput("b", 8000)], ours["model"]["num_layers"],
                  mode, ours["model"]["identity"])
    assert not p.reason.startswith("equal split"), p.reason


def test_a_member_that_would_slow_prompts_down_is_left_out_and_the_plan_says_why():
    if plan_mod.default_profile() is None:
        pytest.skip("no shipped profile in profiles/")
    from partition import profile as pf
    from partition.scaling import scale

    base = pf.DeviceProfile.from_dict(plan_mod.default_profile())
    slow = scale(base, 0.3).to_dict()  # a device 3.3x slower than the others
    members = [MemberInput("a", 8000), MemberInput("b", 8000, slow)]
    p = plan_home(1, "a", members, base.num_layers)
    assert [s.node_id for s in p.stages] == ["a"]
    assert "b left out" in p.reason and "predicted" in p.reason
    p.check()


def test_a_planner_failure_falls_back_to_an_equal_split():
    bad = {"schema": "nope"}
    p = plan_home(1, "a", [MemberInput("a", 1000, bad), MemberInput("b", 1000, bad)], 30)
    assert p.reason.startswith("equal split: planner failed")
    assert [s.node_id for s in p.stages] == ["a", "b"]


def test_a_plan_survives_the_plan_update_message_form():
    p = Plan(7, (Stage("x", 0, 10), Stage("y", 10, 30)), 30, 0.25, "compute", "x", ("x", "y"))
    assert Plan.from_assignment(7, p.to_assignment()) == p


def test_a_plan_names_the_numeric_mode_every_member_computes_in():
    p = plan_home(3, "a", [MemberInput("a", 4000), MemberInput("b", 4000)], 30, weights="packed")
    assert p.weights == "packed" and p.to_status()["weights"] == "packed"
    assert Plan.from_assignment(3, p.to_assignment()).weights == "packed"
    # the digest stays that of the stages alone: daemons too old to carry a mode agree on it
    assert dataclasses.replace(p, weights="").digest() == p.digest()
    assert Plan.from_assignment(3, {k: {kk: vv for kk, vv in v.items() if kk != "weights"}
                                    for k, v in p.to_assignment().items()}).weights == ""  # an older leader


def test_the_daemon_plan_is_made_of_the_partition_packages_half_open_stages():
    import meshd.mesh.home_plan
    import partition.stages

    assert meshd.mesh.home_plan.StageAssignment is partition.stages.StageAssignment  # one stage type
    assert not hasattr(meshd.mesh.home_plan, "Stage")
    p = Plan(2, (Stage("x", 0, 10), Stage("y", 10, 30)), 30)
    assert p.layers_of("y") == (10, 30) and p.layers_of("z") is None
    assert p.layer_ranges == [(0, 10), (10, 30)]
    assert p.to_assignment()["y"]["last"] == 30  # the wire's "last" is the exclusive end
    assert p.to_status()["stages"][1]["layers"] == [10, 30]
    with pytest.raises(Exception):
        p.stages[0].end = 11  # frozen


@pytest.mark.parametrize("assignment", [
    {"n": {"stage": 0, "first": 0, "last": 10, "num_layers": 30}},  # does not reach the end
    {"n": {"stage": 0, "first": 1, "last": 30, "num_layers": 30}},  # does not start at 0
    {"n": {"stage": 0, "first": 0, "last": 20, "num_layers": 30},
     "m": {"stage": 1, "first": 15, "last": 30, "num_layers": 30}},  # overlap
    {"n": {"stage": 0}},  # missing fields
    {},  # no stages
])
def test_a_malformed_or_gappy_plan_is_rejected(assignment):
    with pytest.raises(ValueError):
        Plan.from_assignment(1, assignment)


def test_only_members_with_the_home_model_loaded_are_planned_and_the_rest_say_why():
    from meshd.mesh.home_plan import plannable_members

    smol, qwen = ("smol.gguf@aa", 30), ("qwen.gguf@bb", 24)
    facts = {"a": ("loaded", *smol), "b": ("loaded", *smol), "c": ("loaded", *qwen),
             "d": ("loading", "", 0), "e": ("failed", "", 0)}
    members, model, layers, excluded = plannable_members(facts)
    assert (members, model, layers) == (["a", "b"], "smol.gguf@aa", 30)
    assert excluded["c"] == "holds qwen, the home serves smol"
    assert excluded["d"] == "model loading" and excluded["e"] == "model failed"


def test_the_home_model_is_the_most_common_then_the_lowest_node_ids_and_never_none():
    from meshd.mesh.home_plan import plannable_members

    tie = {"b": ("loaded", "x@1", 30), "a": ("loaded", "y@2", 30)}
    assert plannable_members(tie)[1] == "y@2"  # tie: the lowest node id's model
    with_none = {"a": ("none", "", 0), "b": ("none", "", 0), "c": ("loaded", "x@1", 30)}
    assert plannable_members(with_none)[0] == ["c"]  # a real model beats control-plane-only members
    assert plannable_members({"a": ("none", "", 0)})[0] == ["a"]  # a control-plane-only home still plans
    assert plannable_members({"a": ("loading", "", 0)})[0] == []  # nobody can serve yet: no plan


# -- two plans under one version ---------------------------------------------------------------


class _RecordingLink:
    def __init__(self):
        self.sent: list[tuple[str, object]] = []
        self.peers: dict[str, object] = {}

    def send(self, node_id, msg):
        self.sent.append((node_id, msg))
        return True

    def broadcast(self, msg, node_ids=None):
        return sum(self.send(n, msg) for n in node_ids or ())


class _Mesh:
    """The control plane's objects wired in memory: ready peers, a recording link, no sockets."""

    def __init__(self, tmp_path, node_id, peers, plan_version=0):
        from meshd.config import Config
        from meshd.mesh.membership import Debouncer, Membership
        from meshd.mesh.gossip import Gossip
        from meshd.mesh.local import LocalMember
        from meshd.mesh.planner import Planner
        from meshd.mesh.view import MeshView
        from meshd.state import StateDir

        cfg = Config(state_dir=tmp_path / node_id, model="none", replan_debounce_s=0.01)
        local = LocalMember(node_id, cfg.memory_budget_mb, "none", clock=lambda: 0.0)
        local.node_id = node_id
        self.view = MeshView(StateDir(tmp_path / node_id), local, Membership(node_id, 3.0, 6.0))
        self.link = _RecordingLink()
        self.planner = Planner(cfg, self.view, self.link, Debouncer(0.01), clock=lambda: 0.0)
        cloud = type("NoCloud", (), {"share_for": lambda self, *a: None})()
        self.gossip = Gossip(self.view, self.planner, self.link, cloud, clock=lambda: 0.0, extras=dict)
        for n, key in peers.items():
            self.view.by_key[key] = n
            self.link.peers[n] = key
            self.view.membership.heartbeat(
                n, 0.0, {"load_state": "none", "plan_version": plan_version, "memory_budget_mb": 1000})

    plan = property(lambda self: self.view.plan)
    conflict = property(lambda self: self.planner.conflict)
    membership = property(lambda self: self.view.membership)


def _daemon(tmp_path, node_id, peers, plan_version=0):
    return _Mesh(tmp_path, node_id, peers, plan_version)


def _heartbeat_from(node_id, plan):
    from meshd.mesh import control
    from transport.messages import Envelope

    return Envelope(control.MeshHeartbeat(
        node_id=node_id, name=node_id, memory_budget_mb=1000, plan_version=plan.version,
        members_digest="", profile_digest="", timestamp=0.0, load_state="none",
        plan_digest=plan.digest()))


def test_the_leader_replans_above_a_member_serving_another_plan_under_its_version(tmp_path):
    # c joined and, lowest id, led at once (v2 over a, b, c) while b, the old leader,
    # had issued its own v2 over a and b: each side would serve its plan forever.
    theirs = Plan(2, (Stage("a", 0, 15), Stage("b", 15, 30)), 30, leader="b", members=("a", "b"))
    c = _daemon(tmp_path, "0c", {"a": "key-a", "b": "key-b"}, plan_version=1)  # the lowest id: the leader
    c.planner.maybe_replan()  # its own v2
    assert c.plan.version == 2 and c.membership.leader() == "0c"
    c.link.sent.clear()
    c.planner.maybe_replan()  # nothing changed: the version stays (requests on it are not failed as stale)
    assert c.plan.version == 2 and not c.link.sent

    c.gossip.on_message("key-a", _heartbeat_from("a", theirs))
    assert c.conflict
    c.planner.maybe_replan()

    assert c.plan.version == 3 and c.plan.leader == "0c"
    updates = [(n, m) for n, m in c.link.sent if type(m).__name__ == "PlanUpdate"]
    assert {n for n, _ in updates} == {"a", "b"} and all(m.plan_version == 3 for _, m in updates)
    assert not c.conflict


def test_a_member_that_is_not_the_leader_notes_the_conflict_and_leaves_it_to_the_leader(tmp_path):
    ours = Plan(2, (Stage("a", 0, 15), Stage("b", 15, 30)), 30, leader="a")
    leaders = Plan(2, (Stage("a", 0, 10), Stage("b", 10, 20), Stage("0c", 20, 30)), 30, leader="0c")
    b = _daemon(tmp_path, "b", {"a": "key-a", "0c": "key-c"})
    b.planner.adopt(ours)

    from transport.messages import PlanUpdate, Envelope

    b.gossip.on_message("key-c", Envelope(PlanUpdate(2, leaders.to_assignment())))
    assert b.conflict and b.plan == ours  # an equal version is never adopted
    b.planner.maybe_replan()
    assert b.plan == ours and not [m for _, m in b.link.sent if type(m).__name__ == "PlanUpdate"]

    b.gossip.on_message("key-c", Envelope(PlanUpdate(3, leaders.to_assignment())))
    assert b.plan.version == 3 and b.plan.stages == leaders.stages and not b.conflict


def test_members_holding_the_same_plan_see_no_conflict(tmp_path):
    plan = Plan(2, (Stage("a", 0, 15), Stage("b", 15, 30)), 30, leader="a", members=("a", "b"))
    a = _daemon(tmp_path, "a", {"b": "key-b"})
    a.planner.adopt(plan)
    # the digest covers what a stage checks: the stages and the layer count
    same_stages = Plan(2, plan.stages, 30, reason="other words", leader="a", members=("a", "b", "z"))
    a.gossip.on_message("key-b", _heartbeat_from("b", same_stages))
    assert not a.conflict
    assert Plan(2, plan.stages, 31).digest() != plan.digest()


def test_a_heartbeat_from_a_newer_member_with_fields_this_version_lacks_keeps_it_alive(tmp_path):
    import msgpack
    
    from meshd.mesh import control
    from transport.messages import decode, encode

    a = _daemon(tmp_path, "a", {"b": "key-b"})
    frames = encode(control.MeshHeartbeat(
        node_id="b", name="b", memory_budget_mb=1000, plan_version=0, members_digest="",
        profile_digest="", timestamp=0.0, load_state="none", uptime_s=42.0, version="9.9"))
    header = msgpack.unpackb(frames[0])
    header["fields"]["from_the_future"] = [1, 2, 3]
    env = decode([msgpack.packb(header), *frames[1:]])
    with all_log_events() as logs:
        for _ in range(3):
            a.gossip.on_message("key-b", env)
    assert a.membership.peers["b"].info["uptime_s"] == 42.0  # the rest of it was taken
    said = [e for e in logs if e["event"] == "peer_fields_unknown"]
    assert len(said) == 1 and said[0]["fields"] == ["from_the_future"] and said[0]["peer_version"] == "9.9"


def test_a_plan_echoed_back_with_its_predicted_timings_is_no_conflict(tmp_path):
    import dataclasses

    from transport.messages import Envelope, PlanUpdate

    a = _daemon(tmp_path, "a", {"b": "key-b"})
    planned = Plan(2, (Stage("a", 0, 15, compute_s=0.4), Stage("b", 15, 30, compute_s=0.5)), 30, leader="a")
    a.planner.adopt(planned)
    echoed = Plan.from_assignment(2, planned.to_assignment())  # timings do not travel
    assert echoed.stages != planned.stages and echoed.digest() == planned.digest()
    a.gossip.on_message("key-b", Envelope(PlanUpdate(2, echoed.to_assignment())))
    a.gossip.on_message("key-b", _heartbeat_from("b", echoed))
    older = dataclasses.replace(_heartbeat_from("b", echoed).message, plan_digest="")  # a 0.1 member
    a.gossip.on_message("key-b", Envelope(older))
    assert not a.conflict


def test_heartbeats_carry_the_plan_digest_only_to_members_that_decode_it(tmp_path):
    import msgpack

    from transport.messages import encode

    a = _daemon(tmp_path, "a", {"old": "key-old", "new": "key-new", "quiet": "key-quiet"})
    a.membership.peers["old"].info["version"] = "0.1.0"
    a.membership.peers["new"].info["version"] = "0.2.0"
    a.planner.adopt(Plan(1, (Stage("a", 0, 30),), 30, leader="a"))
    a.gossip.send_heartbeat()
    sent = {n: m for n, m in a.link.sent}
    assert sent["new"].plan_digest == a.plan.digest()
    for n in ("old", "quiet"):  # a 0.1 daemon, and one not heard from yet
        assert "plan_digest" not in msgpack.unpackb(encode(sent[n])[0])["fields"]


def test_heartbeats_announce_one_capability_set_and_peers_decide_from_it(tmp_path):
    """A member's set says what it decodes; one without a set (an older release) has none of it."""
    from meshd.mesh.caps import OURS, Cap, PeerCaps
    from transport.messages import Envelope

    a = _daemon(tmp_path, "a", {"b": "key-b", "old": "key-old", "quiet": "key-quiet"})
    assert a.gossip.heartbeat().caps == OURS.to_wire() and a.view.caps_of("a") == OURS
    theirs = dataclasses.replace(a.gossip.heartbeat(), node_id="b", name="b", caps=["layouts", "from_the_future"])
    a.gossip.on_message("key-b", Envelope(theirs))
    assert a.view.caps_of("b") == PeerCaps(frozenset({Cap.LAYOUTS, Cap.HEARTBEAT_FIELDS}))
    a.membership.peers["old"].info["version"] = "0.2.0"  # extensible heartbeats, no set: nothing more
    assert a.view.caps_of("old") == PeerCaps(frozenset({Cap.HEARTBEAT_FIELDS}))
    assert a.view.caps_of("quiet") == PeerCaps()  # not heard from: not even new heartbeat fields

    a.planner.config.layout = "replicas"
    assert a.planner.layout_for(["a", "b"]) == "replicas"
    assert a.planner.layout_for(["a", "b", "old"]) == "pipeline"  # it follows one pipeline only

    a.gossip.send_heartbeat()
    sent = {n: m for n, m in a.link.sent}
    assert sent["b"].caps == sent["old"].caps == OURS.to_wire() and sent["quiet"].caps is None


def test_a_conflict_is_settled_even_while_a_new_plan_waits_for_members_to_fetch_layers(tmp_path):
    class FetchingStill:  # meshd.share: the better plan waits; the current one can serve
        def gate(self, plan, current, ready, model, plan_over):
            return None

    c = _daemon(tmp_path, "0c", {"a": "key-a"}, plan_version=1)
    ours = Plan(2, (Stage("0c", 0, 30),), 30, leader="0c")
    c.planner.adopt(ours)
    c.planner.sharing = FetchingStill()
    c.planner.maybe_replan()
    assert c.plan == ours  # no conflict: waiting is fine

    c.gossip.on_message("key-a", _heartbeat_from("a", Plan(2, (Stage("a", 0, 30),), 30, leader="a")))
    c.planner.maybe_replan()
    assert c.plan.version == 3 and c.plan.stages == ours.stages and not c.conflict
    assert [m.plan_version for n, m in c.link.sent if type(m).__name__ == "PlanUpdate"] == [3]


def test_the_leader_prices_the_link_it_is_told_and_a_wired_lan_lets_a_tensor_group_form():
    """Over the default link (a Wi-Fi hop) the split's 57 round trips a token lose; told the members share
    a wired gigabit LAN, the same home of two 1.5B devices is split layer by layer, and the plan says why."""
    import json

    from meshd.mesh.home_plan import shipped_profiles_dir

    prof = json.loads((shipped_profiles_dir() / "x86_64-2core-1thread-packed-qwen2.5-coder-1.5b.json").read_text())
    members = [MemberInput("a", 8000, prof), MemberInput("b", 8000, prof)]
    layers = prof["model"]["num_layers"]
    wifi = plan_home(1, "a", members, layers, weights="gguf", layout="auto", tensor=True)
    wired = plan_home(1, "a", members, layers, weights="gguf", layout="auto", tensor=True, link="1gbit,0.3ms")
    assert not any(s.group for s in wifi.stages)
    (stage,) = wired.stages
    assert stage.group == ("a", "b") and "0.3 ms RTT" in wired.reason and "1000 Mbit/s" in wired.reason


def test_a_link_the_config_cannot_read_is_refused_at_start_up():
    from meshd.config import Config, ConfigError

    assert Config(link=" 1Gbit,0.3ms ").validate().link == "1gbit,0.3ms"
    with pytest.raises(ConfigError, match="link"):
        Config(link="fast").validate()
