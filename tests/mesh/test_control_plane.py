"""The control plane's shape: gossip answers every control message, and the package sits
below the floors it serves (nothing in ``meshd.mesh`` imports the pipeline, sharing, the
API or the daemon; only the CLI entry point imports the daemon)."""

import ast
from pathlib import Path

from meshd.mesh import control
from meshd.config import Config
from meshd.mesh.membership import Debouncer, Membership
from meshd.mesh.gossip import Gossip
from meshd.mesh.local import LocalMember
from meshd.mesh.planner import Planner
from meshd.mesh.view import MeshView
from meshd.state import StateDir
from transport.messages import Envelope
from transport.registry import registry

ROOT = Path(__file__).resolve().parents[2]
ABOVE = ("meshd.pipeline", "meshd.share", "meshd.api", "meshd.daemon", "meshd.model.host")


def _imported(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_the_control_plane_imports_nothing_above_it():
    for path in sorted((ROOT / "meshd" / "mesh").glob("*.py")):
        bad = [n for n in _imported(path) if n.startswith(ABOVE)]
        assert not bad, (path.name, bad)


def test_only_the_join_command_starts_the_daemon():
    importers = {str(p.relative_to(ROOT)) for p in (ROOT / "meshd").rglob("*.py")
                 if "meshd.daemon" in _imported(p)}
    assert importers == {"meshd/commands/join.py"}


class _Link:
    def __init__(self):
        self.sent, self.peers = [], {}

    def send(self, node_id, msg):
        self.sent.append((node_id, msg))
        return True

    def broadcast(self, msg, node_ids=None):
        return sum(self.send(n, msg) for n in node_ids or ())


def _gossip(tmp_path):
    cfg = Config(state_dir=tmp_path, model="none")
    local = LocalMember("a", 1000, "none", clock=lambda: 0.0)
    local.node_id = "a"
    view = MeshView(StateDir(tmp_path), local, Membership("a", 3.0, 6.0))
    view.by_key["key-b"] = "b"
    link = _Link()
    planner = Planner(cfg, view, link, Debouncer(0.01), clock=lambda: 0.0)
    cloud = type("NoCloud", (), {"share_for": lambda self, *a: None, "receive": lambda self, *a: None})()
    return Gossip(view, planner, link, cloud, clock=lambda: 0.0, extras=dict), link


def test_every_control_message_has_a_handler(tmp_path):
    gossip, _ = _gossip(tmp_path)
    ours = {cls for cls in registry().values() if cls.__module__ == control.__name__}
    assert ours <= gossip.handled_types


def test_a_message_no_handler_takes_goes_to_the_fallback_then_is_dropped(tmp_path):
    gossip, link = _gossip(tmp_path)
    taken = []
    gossip.fallback = lambda sender, msg: taken.append((sender, msg)) or True
    probe = registry()["Heartbeat"]("b", "probe", 0.0, 0, 0.0)  # the link's probe: not gossip
    gossip.on_message("key-b", Envelope(probe))
    assert taken == [("b", probe)]
    gossip.on_message("key-b", Envelope(control.ProfileRequest("b")))
    assert [type(m).__name__ for _, m in link.sent] == ["ProfileShare"] and len(taken) == 1
    gossip.on_message("key-unknown", Envelope(control.ProfileRequest("z")))  # not a member: dropped
    assert len(link.sent) == 1


def _planner_at(tmp_path, now):
    cfg = Config(state_dir=tmp_path, model="none")
    local = LocalMember("a", 1000, "none", clock=lambda: now[0])
    local.node_id = "a"
    view = MeshView(StateDir(tmp_path), local, Membership("a", 3.0, 6.0))
    return Planner(cfg, view, _Link(), Debouncer(0.01), clock=lambda: now[0]), view


def test_a_plan_waits_a_few_seconds_for_a_joining_members_profile_not_for_its_own_members(tmp_path):
    from meshd.mesh.planner import PROFILE_WAIT_S
    from partition.plan import Plan
    from partition.stages import StageAssignment

    now = [0.0]
    planner, view = _planner_at(tmp_path, now)
    view.membership.heartbeat("b", now[0], {"profile_digest": "d1"})
    view.membership.heartbeat("c", now[0], {"profile_digest": ""})  # shares no profile: nothing to wait for
    assert planner.profiles_awaited(["a", "b", "c"]) == ["b"]  # announced, asked for, not here yet
    view.profile_digests["b"] = "d1"  # its ProfileShare arrived
    assert planner.profiles_awaited(["a", "b", "c"]) == []

    now[0] = 10.0  # b re-measured: a new profile is waited for afresh, then guessed past the deadline
    view.membership.heartbeat("b", now[0], {"profile_digest": "d2"})
    assert planner.profiles_awaited(["a", "b"]) == ["b"]
    now[0] += PROFILE_WAIT_S
    assert planner.profiles_awaited(["a", "b"]) == []

    now[0] = 20.0  # a member of the current plan never holds up a re-plan (a loss, a conflict)
    view.membership.heartbeat("b", now[0], {"profile_digest": "d3"})
    view.plan = Plan(2, (StageAssignment("a", 0, 30),), 30, members=("a", "b"))
    assert planner.profiles_awaited(["a", "b"]) == []
