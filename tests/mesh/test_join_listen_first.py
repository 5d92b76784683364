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
        with pytest.raises(MeshdError, match=r"\(--http\)") as info:
            check_can_listen(cfg)
        # An API port's clash is about that port: the second-daemon recipe for other ports does not help.
        assert "give --http another port" in str(info.value) and "--pairing-port" not in str(info.value)
    finally:
        busy.close()


def test_an_api_port_in_use_at_start_names_its_own_flag_and_ollamas_port(short_tmp):
    import asyncio
    import errno

    from meshd.api.listen import ApiStartError
    from meshd.api.server import create_app, start_api

    busy = _busy_port()
    port = busy.getsockname()[1]
    try:
        async def start(spec: str):
            return await start_api(create_app(None), short_tmp / "s.sock", spec)

        with pytest.raises(ApiStartError, match=r"\(--api-listen\): .*give --api-listen another port"):
            asyncio.run(start(f"127.0.0.1:{port}"))
    finally:
        busy.close()
    from meshd.api.listen import bind_error

    in_use = OSError(errno.EADDRINUSE, "Address already in use")
    assert "Ollama server" in bind_error(in_use, "--http", 11434)


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
