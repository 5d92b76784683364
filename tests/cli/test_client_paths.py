"""The socket path both the daemon and its clients resolve."""

from pathlib import Path

import pytest

from meshd.paths import check_socket_path, default_socket_path


def test_explicit_override_wins():
    env = {"MESHD_SOCKET": "/tmp/x.sock", "RUNTIME_DIRECTORY": "/run/meshd"}
    assert default_socket_path(env) == Path("/tmp/x.sock")


def test_systemd_runtime_directory_is_used_first_of_several():
    env = {"RUNTIME_DIRECTORY": "/run/meshd:/run/other", "XDG_RUNTIME_DIR": "/run/user/1000"}
    assert default_socket_path(env) == Path("/run/meshd/meshd.sock")


def test_user_daemon_uses_xdg_runtime_dir():
    assert default_socket_path({"XDG_RUNTIME_DIR": "/run/user/1000"}) == Path(
        "/run/user/1000/meshd/meshd.sock"
    )


def test_falls_back_to_local_state_without_runtime_dirs():
    assert default_socket_path({"HOME": "/home/ann"}) == Path(
        "/home/ann/.local/state/meshd/meshd.sock"
    )


def test_overlong_socket_path_is_refused_with_its_length():
    with pytest.raises(ValueError, match="kernel limit"):
        check_socket_path("/tmp/" + "a" * 200)
