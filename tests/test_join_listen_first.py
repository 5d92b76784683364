"""``meshd join --token``: the single-use token is only spent once the daemon can listen."""

from __future__ import annotations

import socket

import pytest

from meshd.commands.join import check_can_listen
from meshd.config import Config
from meshd.errors import MeshdError


def _busy_port() -> socket.socket:
    s = socket.create_server(("127.0.0.1", 0))
    return s


def test_a_busy_port_is_reported_with_the_flag_and_the_second_daemon_recipe(short_tmp):
    busy = _busy_port()
    try:
        cfg = Config(listen="127.0.0.1", port=busy.getsockname()[1], pairing_port=0,
                     socket=short_tmp / "s.sock")
        with pytest.raises(MeshdError, match=r"\(--port\).*--port 0 --pairing-port 0.*token was not used"):
            check_can_listen(cfg)
        cfg = Config(listen="127.0.0.1", port=0, pairing_port=0, socket=short_tmp / "s.sock",
                     http=f"127.0.0.1:{busy.getsockname()[1]}")
        with pytest.raises(MeshdError, match=r"\(--http\)") as refused:
            check_can_listen(cfg)
        # the hint names the one flag in the way, not the other ports
        assert "pick another --http port" in str(refused.value) and "--pairing-port" not in str(refused.value)
    finally:
        busy.close()


def test_a_socket_another_daemon_serves_is_reported(short_tmp):
    path = short_tmp / "s.sock"
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(str(path))
    srv.listen()
    try:
        with pytest.raises(MeshdError, match="already serving.*own --state-dir and --socket"):
            check_can_listen(Config(port=0, pairing_port=0, socket=path))
    finally:
        srv.close()


def test_free_ports_and_a_stale_socket_pass(short_tmp):
    path = short_tmp / "s.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    s.close()  # stale: nothing listens
    check_can_listen(Config(listen="127.0.0.1", port=0, pairing_port=0, socket=path))


@pytest.fixture
def short_tmp():
    import shutil
    import tempfile
    from pathlib import Path

    d = Path(tempfile.mkdtemp(prefix="meshd-j-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)
