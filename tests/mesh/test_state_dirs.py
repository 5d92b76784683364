"""One state directory every command agrees on, and none created by mistake.

The daemon and the commands run beside it (``meshd apikey``, ``meshd invite``,
``meshd status``) resolve the state directory the same way: ``--state-dir``,
else ``$MESHD_HOME`` (state and model cache in one place, what the systemd
unit sets), else ``$STATE_DIRECTORY``, else ``~/.local/state/meshd``. A path
that holds no home is an error before anything is written there or anywhere
else, so a typo never yields a key the daemon does not read, a stray node id,
or advice to create a second home. ``meshd join --setup-only`` does the first
run's step (create or join the home) and exits, as the systemd install needs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshd.apikeys import ApiKeyStore
from meshd.config import load_config
from meshd.paths import default_state_dir, legacy_state_dir_note
from meshd.state import StateDir
from tests.support.daemons import run_cli


@pytest.fixture
def clean_env(tmp_path, monkeypatch):
    """No meshd or systemd variables from the caller; $HOME is a fresh directory (the default state dir)."""
    import os

    for key in list(os.environ):
        if key.startswith("MESHD_") or key in ("STATE_DIRECTORY", "RUNTIME_DIRECTORY"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("HOME", str(tmp_path / "user-home"))
    return tmp_path / "user-home" / ".local" / "state" / "meshd"


def a_home(root: Path) -> StateDir:
    state = StateDir(root).ensure()
    state.create_home("flat")
    return state


def test_meshd_home_is_the_state_dir_before_systemds_and_the_users_default():
    assert default_state_dir({"MESHD_HOME": "/var/lib/meshd", "STATE_DIRECTORY": "/elsewhere",
                              "HOME": "/h"}) == Path("/var/lib/meshd")
    assert default_state_dir({"STATE_DIRECTORY": "/var/lib/meshd:/x", "HOME": "/h"}) == Path("/var/lib/meshd")
    assert default_state_dir({"HOME": "/h"}) == Path("/h/.local/state/meshd")
    # a flag or MESHD_STATE_DIR still names it outright
    assert load_config(None, {"MESHD_STATE_DIR": "/x", "MESHD_HOME": "/y"}).resolved_state_dir(
        {"MESHD_HOME": "/y"}) == Path("/x")


def test_an_upgrade_keeps_a_home_that_earlier_releases_kept_in_the_users_state_dir(tmp_path, clean_env):
    """Earlier releases read $MESHD_HOME as the model cache only: a home created then is in
    ~/.local/state/meshd, and must not be abandoned for an empty $MESHD_HOME (a new node id)."""
    env = {"MESHD_HOME": str(tmp_path / "cache"), "HOME": str(tmp_path / "user-home")}
    (tmp_path / "cache" / "models").mkdir(parents=True)
    assert default_state_dir(env) == tmp_path / "cache" and legacy_state_dir_note(env) is None
    a_home(clean_env)
    assert default_state_dir(env) == clean_env
    assert "mv " in legacy_state_dir_note(env) and str(clean_env) in legacy_state_dir_note(env)
    a_home(tmp_path / "cache")  # moved (or a home made in $MESHD_HOME): that one wins
    assert default_state_dir(env) == tmp_path / "cache" and legacy_state_dir_note(env) is None


def test_a_key_created_with_meshd_home_is_where_the_daemon_with_that_home_reads(tmp_path, clean_env,
                                                                              monkeypatch):
    home = a_home(tmp_path / "var-lib-meshd")
    monkeypatch.setenv("MESHD_HOME", str(home.root))
    rc, out = run_cli("apikey", "create", "ha", "--json")
    assert rc == 0
    key = json.loads(out.strip().splitlines()[-1])["key"]
    # what the daemon's key check reads: ApiKeyStore(<its resolved state dir>), here under systemd too
    daemon_env = {"MESHD_HOME": str(home.root), "STATE_DIRECTORY": str(home.root)}
    assert ApiKeyStore(load_config(None, daemon_env).resolved_state_dir(daemon_env)).check(key).name == "ha"
    assert not clean_env.exists()


@pytest.mark.parametrize("action", [["create", "ha"], ["list"], ["revoke", "ha"]])
def test_apikey_on_a_mistyped_state_dir_fails_and_creates_nothing(tmp_path, clean_env, capsys, action):
    typo = tmp_path / "var-lib-mehsd"
    rc, out = run_cli("apikey", *action, "--state-dir", str(typo))
    err = capsys.readouterr().err
    assert rc == 1 and "meshd-" not in out
    assert f"no meshd state directory at {typo}" in err and "MESHD_HOME" in err
    assert not typo.exists() and not clean_env.exists()


def test_apikey_in_a_directory_without_a_home_fails_and_writes_no_key(tmp_path, clean_env, capsys):
    bare = tmp_path / "bare"
    bare.mkdir()
    rc, _ = run_cli("apikey", "create", "ha", "--state-dir", str(bare))
    assert rc == 1 and "holds no home" in capsys.readouterr().err
    assert list(bare.iterdir()) == []


def test_invite_on_a_missing_state_dir_fails_without_touching_it_or_the_default(tmp_path, clean_env, capsys):
    missing = tmp_path / "nope"
    rc, out = run_cli("invite", "--state-dir", str(missing))
    err = capsys.readouterr().err
    assert rc == 1 and out == ""
    assert f"no meshd state directory at {missing}" in err and "--new-home" not in err
    assert not missing.exists() and not clean_env.exists()


def test_invite_in_a_directory_without_a_home_says_how_a_device_enters_one(tmp_path, clean_env, capsys):
    bare = tmp_path / "bare"
    bare.mkdir()
    rc, _ = run_cli("invite", "--state-dir", str(bare))
    err = capsys.readouterr().err
    assert rc == 1 and "--token" in err
    assert err.index("--token") < err.index("--new-home")  # joining first; a new home only on a first device
    assert list(bare.iterdir()) == []  # no node id, no invites file


def test_invite_with_meshd_home_uses_that_home_and_not_the_default(tmp_path, clean_env, monkeypatch):
    home = a_home(tmp_path / "h")
    monkeypatch.setenv("MESHD_HOME", str(home.root))
    rc, out = run_cli("invite", "--json")
    assert rc == 0 and json.loads(out.strip().splitlines()[-1])["token"].startswith("meshd1-")
    assert len(home.invites()) == 1 and not clean_env.exists()


def test_status_by_state_dir_finds_the_daemon_it_records_or_says_none_runs(mesh, tmp_path, clean_env, capsys):
    rc, _ = run_cli("status", "--state-dir", str(tmp_path / "nope"))
    assert rc == 1 and "no meshd state directory" in capsys.readouterr().err
    idle = a_home(tmp_path / "idle")
    rc, _ = run_cli("status", "--state-dir", str(idle.root))
    assert rc == 1 and "no meshd daemon is running with state directory" in capsys.readouterr().err

    d = mesh.spawn("hub", new_home="flat")
    d.wait_serving()
    rc, out = run_cli("status", "--json", "--state-dir", str(d.state_dir))
    assert rc == 0 and json.loads(out)["node_id"] == d.node_id()


def test_join_setup_only_creates_or_joins_the_home_and_exits(mesh, tmp_path, clean_env):
    first = tmp_path / "first"
    rc, _ = run_cli("join", "--setup-only", "--new-home", "flat", "--state-dir", str(first), "--model", "none")
    assert rc == 0 and StateDir(first).home().name == "flat"
    assert not (first / "daemon.json").exists()  # it never served
    rc, _ = run_cli("join", "--setup-only", "--state-dir", str(first), "--model", "none")
    assert rc == 0  # re-run on a device in a home: a check, nothing more

    d = mesh.spawn("hub", new_home="flat")
    d.wait_serving()
    newcomer = tmp_path / "newcomer"
    rc, _ = run_cli("join", "--setup-only", "--token", mesh.invite(d), "--state-dir", str(newcomer),
                    "--name", "newcomer", "--model", "none")
    assert rc == 0
    joined = StateDir(newcomer)
    assert joined.home().name == "flat" and d.node_id() in joined.members()
    assert joined.node_id() in StateDir(d.state_dir).members()  # the member admitted it
