"""sd_notify over NOTIFY_SOCKET, without libsystemd."""

import os
import socket

from meshd.sdnotify import Notifier


def test_without_notify_socket_every_call_is_a_no_op():
    n = Notifier({})
    assert not n.enabled and n.ready() is False and n.watchdog_interval_s is None


def test_ready_and_watchdog_datagrams_reach_the_socket(tmp_path):
    path = str(tmp_path / "notify")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind(path)
        n = Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "4000000"})
        assert n.ready("serving")
        assert n.watchdog()
        assert s.recv(100) == b"READY=1\nSTATUS=serving"
        assert s.recv(100) == b"WATCHDOG=1"
    assert n.watchdog_interval_s == 2.0


def test_abstract_socket_names_start_with_at():
    name = f"meshd-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind("\0" + name)
        assert Notifier({"NOTIFY_SOCKET": "@" + name}).stopping()
        assert s.recv(100) == b"STOPPING=1"


def test_the_watchdog_of_another_pid_is_not_ours():
    n = Notifier({"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": str(os.getpid() + 1)})
    assert n.watchdog_interval_s is None
