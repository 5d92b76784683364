"""Daemon lifecycle: sd_notify, SIGTERM during a request, bad input, first-run errors."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import threading
from collections.abc import AsyncIterator

import pytest
import zmq
import zmq.auth

from meshd.client import MeshdClient
from meshd.engine.base import Engine, GenerationRequest
from meshd.errors import MeshdError
from tests.support.daemons import run_cli, summary
from tests.support.waiting import wait_until
from transport.keys import AllowList, Keypair
from transport.wire import encode_frames

# --------------------------------------------------------------------------- a slow fake engine


class _CharTokenizer:
    eos_ids = ()

    def encode(self, text):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)

    def apply_chat(self, messages):
        return self.encode(" ".join(str(m.get("content", "")) for m in messages))


class SlowEngine(Engine):
    """One 'x' every 50 ms, forever (until max_tokens): a request that is surely in flight."""

    model_id = "slow-fake"
    context_length = 100_000
    tokenizer = _CharTokenizer()

    async def token_ids(self, req: GenerationRequest) -> AsyncIterator[int]:
        for _ in range(req.max_tokens):
            await asyncio.sleep(0.05)  # sleep-ok: a slow engine, so a request is surely in flight
            yield ord("x")


def make_slow_engine(daemon):
    return SlowEngine()


# --------------------------------------------------------------------------- tests


def _notify_socket(path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(str(path))
    s.settimeout(30)
    return s


def _browse_loopback(instances_seen: dict, stop: threading.Event):
    """A plain python-zeroconf browser on loopback, standing in for another device."""
    from zeroconf import IPVersion, ServiceBrowser, Zeroconf

    zc = Zeroconf(interfaces=["127.0.0.1"], ip_version=IPVersion.V4Only)

    def handler(zeroconf, service_type, name, state_change):
        instances_seen.setdefault(name, []).append(state_change.name)

    browser = ServiceBrowser(zc, "_meshd._tcp.local.", handlers=[handler])
    stop.wait()
    browser.cancel()
    zc.close()


@pytest.mark.slow
def test_sigterm_during_a_request_refuses_new_ones_fails_it_clearly_and_leaves_nothing_behind(mesh):
    notify_path = mesh.root / "notify.sock"
    notify = _notify_socket(notify_path)
    seen: dict = {}
    stop_browsing = threading.Event()
    browser = threading.Thread(target=_browse_loopback, args=(seen, stop_browsing), daemon=True)
    browser.start()
    try:
        d = mesh.spawn("solo", "--engine", "tests.mesh.test_daemon_lifecycle:make_slow_engine",
                       new_home="flat",
                       env={"NOTIFY_SOCKET": str(notify_path), "WATCHDOG_USEC": "2000000",
                            "MESHD_DRAIN_TIMEOUT_S": "2"})
        first = [notify.recv(200) for _ in range(2)]  # READY=1 (once it can serve) and a watchdog ping
        assert any(m.startswith(b"READY=1") for m in first), first
        assert b"WATCHDOG=1" in first or notify.recv(200) == b"WATCHDOG=1"
        d.wait_serving()
        instance = f"meshd-{d.node_id()}._meshd._tcp.local."
        wait_until(lambda: "Added" in seen.get(instance, []), 10, what="the daemon's mDNS record")

        stream = MeshdClient(d.socket, timeout=30).chat("hi", stream=True, max_tokens=100_000)
        pieces, error = [], []

        def consume():
            try:
                for piece in stream:
                    pieces.append(piece)
            except MeshdError as exc:
                error.append(str(exc))

        reader = threading.Thread(target=consume)
        reader.start()
        wait_until(lambda: pieces, 10, what="the first token")
        d.signal(signal.SIGTERM)

        def new_request_refused():
            try:
                MeshdClient(d.socket, timeout=5).chat("hi", max_tokens=1)
            except MeshdError as exc:
                return "shutting down" in str(exc) and "503" in str(exc)
            return False

        # while the running request drains (2 s), new ones are refused clearly
        wait_until(new_request_refused, 2, what="a new request refused while draining")
        assert d.wait(30) == 0
        reader.join(10)

        assert error and "shutting down" in error[0], (error, d.log_tail())
        assert not d.socket.exists()
        assert not (d.state_dir / "daemon.json").exists()
        msgs = []
        notify.settimeout(0.5)
        while True:
            try:
                msgs.append(notify.recv(200))
            except TimeoutError:
                break
        assert b"STOPPING=1" in msgs
        wait_until(lambda: "Removed" in seen.get(instance, []), 5, what="the mDNS goodbye")
        events = [e["event"] for e in d.events()]
        assert events.index("mdns_unregistered") < events.index("daemon_stopped")
    finally:
        stop_browsing.set()
        notify.close()


@pytest.mark.slow
def test_malformed_frames_and_unknown_types_from_a_member_are_logged_and_serving_goes_on(mesh):
    d = mesh.spawn("solo", "--engine", "tests.mesh.test_daemon_lifecycle:make_slow_engine", new_home="flat")
    d.wait_serving()
    port = d.status()["ports"]["transport"]

    # A member-signed (allow-listed) client sends garbage and an unknown message type.
    intruder = Keypair.generate()
    AllowList.for_state_dir(d.state_dir).add(intruder.public, "test client")
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.linger = 5000  # deliver before closing (the CURVE handshake comes first)
    s.curve_secretkey, s.curve_publickey = intruder.secret, intruder.public
    s.curve_serverkey = zmq.auth.load_certificate(d.state_dir / "keys" / "node.key")[0]
    s.connect(f"tcp://127.0.0.1:{port}")
    s.send_multipart([b"\x00garbage", b"more"])
    s.send_multipart([b"\x93\xa4nope"])
    s.send_multipart(encode_frames("NoSuchMessage", {"x": 1}, [], call_id=0, seq=1, sender="t"))
    s.close()
    ctx.term()

    def logged_protocol_error():
        errors = [e for e in d.events() if e["event"] == "protocol_error"]
        return len(errors) >= 2 and any("NoSuchMessage" in e["error"] for e in errors)

    wait_until(logged_protocol_error, 10, what="a logged protocol error")
    out = MeshdClient(d.socket, timeout=30).chat("hi", max_tokens=3)  # still serving
    assert out.text == "xxx"


def test_join_without_a_home_says_how_to_get_one(tmp_path):
    rc, _ = run_cli("join", "--state-dir", str(tmp_path / "s"), "--model", "none")
    assert rc == 1


def test_join_refuses_a_token_on_a_device_already_in_a_home(tmp_path, capsys):
    from meshd.state import StateDir

    StateDir(tmp_path / "s").ensure().create_home("flat")
    rc, _ = run_cli("join", "--state-dir", str(tmp_path / "s"), "--token", "meshd1-xyz")
    assert rc == 1
    assert "already belongs to home 'flat'" in capsys.readouterr().err


def test_join_rejects_a_malformed_token(tmp_path, capsys):
    rc, _ = run_cli("join", "--state-dir", str(tmp_path / "s"), "--token", "hello")
    assert rc == 1
    assert "not a meshd invite token" in capsys.readouterr().err


def test_a_cut_token_is_refused_with_what_to_paste_instead(tmp_path, capsys):
    rc, _ = run_cli("join", "--state-dir", str(tmp_path / "s"), "--token", "meshd1-eyJzIjoi")
    err = capsys.readouterr().err
    assert rc == 1 and "malformed invite token" in err and "whole first line" in err
    assert "Error)" not in err  # no bare exception class names


def test_an_invite_minted_before_a_restart_on_pairing_port_0_still_pairs(mesh):
    """Tokens name the pairing port; with --pairing-port 0 a restarted daemon takes its last one
    again, so a token handed out before the restart is not a bare connection error after it."""
    a = mesh.spawn("a", new_home="flat")
    a.wait_serving(60)
    token = mesh.invite(a)
    port_before = json.loads((a.state_dir / "daemon.json").read_text())["pairing_port"]
    a.signal(signal.SIGTERM)
    assert a.wait(30) == 0
    a.start()
    a.wait_serving(60)
    assert json.loads((a.state_dir / "daemon.json").read_text())["pairing_port"] == port_before
    b = mesh.spawn("b", token=token)
    wait_until(lambda: len(a.status().get("members", [])) == 2, 60, what="the new member to be admitted",
               explain=lambda: summary(a, b))
