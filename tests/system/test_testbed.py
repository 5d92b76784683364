"""The multi-host testbed: link strings, the delay proxy, namespaces and teardown.

Timing checks are one-sided or very generous: the proxy must never release
data *early*, and must not serialise its delay per chunk; the machine is shared,
so nothing asserts a tight wall-clock bound.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from bench.testbed import FALLBACK_LINE, DelayProxy, LinkSpec, LinkSpecError, Testbed
from bench.testbed import netns as tbnetns
from meshd.errors import MeshdError
from tests.support.waiting import wait_until

PY = sys.executable


# ---------------------------------------------------------------- LinkSpec


@pytest.mark.parametrize(
    "text, rate, rtt",
    [
        ("100mbit,4ms", 100_000_000, 0.004),
        ("1gbit,1ms", 1_000_000_000, 0.001),
        ("1GBit, 1ms", 1_000_000_000, 0.001),
        ("100mbit", 100_000_000, 0.0),
        ("4ms", None, 0.004),
        ("500us", None, 0.0005),
        ("2.5mbit,0.5s", 2_500_000, 0.5),
    ],
)
def test_linkspec_parses_rate_and_round_trip_time(text, rate, rtt):
    spec = LinkSpec.parse(text)
    assert spec.rate_bps == rate
    assert spec.rtt_s == pytest.approx(rtt)
    assert spec.one_way_delay_s == pytest.approx(rtt / 2)


@pytest.mark.parametrize("text", ["none", "unshaped", "", None, "  NONE "])
def test_linkspec_none_and_unshaped_mean_no_shaping_and_no_delay(text):
    spec = LinkSpec.parse(text)
    assert not spec.shaped and not spec.delayed
    assert str(spec) == "unshaped"


@pytest.mark.parametrize("text", ["100mbit,4ms", "1gbit,1ms", "100mbit", "4ms", "250us"])
def test_linkspec_string_form_round_trips(text):
    assert str(LinkSpec.parse(text)) == text
    assert LinkSpec.parse(str(LinkSpec.parse(text))) == LinkSpec.parse(text)


def test_an_asymmetric_wan_link_shapes_each_direction_at_its_own_rate():
    wan = LinkSpec.parse("20mbit/100mbit,40ms")
    assert (wan.rate_bps, wan.downlink_bps, wan.rtt_s) == (20_000_000, 100_000_000, pytest.approx(0.04))
    assert wan.tbf_args()[2] == "20000000bit" and wan.tbf_args(down=True)[2] == "100000000bit"
    assert str(wan) == "20mbit/100mbit,40ms" and LinkSpec.parse(str(wan)) == wan
    assert "20 Mbit/s up, 100 Mbit/s down" in wan.describe()
    assert LinkSpec.parse("2mbit/2mbit") == LinkSpec.parse("2mbit")  # symmetric stays symmetric


@pytest.mark.parametrize("text", ["fast", "100mb", "100mbit,4", "4ms,5ms", "1gbit,2gbit", "0mbit", "-1ms",
                                  "1mbit/2mbit/3mbit", "1mbit/", "0mbit/1mbit"])
def test_linkspec_rejects_malformed_strings_with_a_user_facing_error(text):
    with pytest.raises(LinkSpecError) as e:
        LinkSpec.parse(text)
    assert isinstance(e.value, MeshdError) and isinstance(e.value, ValueError)
    assert "link" in str(e.value)


def test_tbf_burst_is_a_few_milliseconds_of_traffic_but_at_least_two_frames():
    fast, slow = LinkSpec.parse("1gbit"), LinkSpec.parse("1mbit")
    assert fast.burst_bytes() == 1_000_000_000 // 8 * 4 // 1000  # 4 ms at 1 Gbit/s
    assert slow.burst_bytes() == 3000  # 2 x 1500-byte frames
    args = fast.tbf_args()
    assert args[0] == "tbf" and args[args.index("rate") + 1] == "1000000000bit"


# ---------------------------------------------------------------- DelayProxy (loopback)


class _CompiledProxy:
    """``bench/testbed/delay_proxy.c`` as the testbed runs it (a process), behind DelayProxy's interface."""

    def __init__(self, target, one_way_delay_s: float):
        self.target, self.delay = target, one_way_delay_s
        self.address = None
        self._p = None

    async def __aenter__(self):
        import subprocess

        from bench.testbed.testbed import _read_ready, compiled_delay_proxy

        binary = compiled_delay_proxy()
        if binary is None:
            pytest.skip("no C compiler builds the compiled delay proxy here")
        self._p = subprocess.Popen([str(binary), "--listen", "127.0.0.1:0", "--target",
                                    f"{self.target[0]}:{self.target[1]}", "--one-way-ms", repr(self.delay * 1000)],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.address = _read_ready(self._p, timeout=15.0, what="compiled delay proxy")
        return self

    async def __aexit__(self, *exc):
        self._p.kill()
        self._p.wait(timeout=10)


@pytest.fixture(params=["python", "compiled"])
def delay_proxy(request):
    """Both delay proxies keep the same promises: the Python one and the compiled one the testbed prefers."""
    return DelayProxy if request.param == "python" else _CompiledProxy


async def _echo_server():
    """Echoes everything; on EOF from the client, half-closes back."""

    async def handle(reader, writer):
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
        writer.write_eof()
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[:2]


async def _round_trip(addr, n=5):
    reader, writer = await asyncio.open_connection(*addr)
    times = []
    for _ in range(n):
        t = time.perf_counter()
        writer.write(b"ping")
        await reader.readexactly(4)
        times.append(time.perf_counter() - t)
    writer.close()
    return min(times)


async def test_delay_proxy_adds_at_least_the_configured_round_trip_time(delay_proxy):
    server, target = await _echo_server()
    async with server, delay_proxy(target, one_way_delay_s=0.015) as proxy:
        rtt = await _round_trip(proxy.address)
    # never early — or, for the compiled proxy, early by at most its timer's lead (its measured wake-up
    # lateness, capped at 0.1 ms), so that it is on time on average
    assert rtt >= 0.030 - 2 * 0.0001
    assert rtt < 0.030 + 1.0  # generous: a loaded machine may add scheduling delay


async def test_delay_proxy_preserves_bytes_exactly_in_both_directions_with_half_close(delay_proxy):
    server, target = await _echo_server()
    rng = random.Random(1234)
    async with server, delay_proxy(target, one_way_delay_s=0.002) as proxy:

        async def one(size):
            payload = rng.randbytes(size)
            reader, writer = await asyncio.open_connection(*proxy.address)
            pieces = []
            pos = 0
            while pos < len(payload):  # many irregular writes: order must survive
                step = rng.randint(1, 70_000)
                writer.write(payload[pos:pos + step])
                pos += step
                if rng.random() < 0.2:
                    await writer.drain()
            writer.write_eof()
            while data := await reader.read(1 << 16):
                pieces.append(data)
            writer.close()
            return payload, b"".join(pieces)

        results = await asyncio.gather(*(one(s) for s in (0, 1, 4096, 300_000, 3_000_000)))
    for sent, received in results:
        assert received == sent


async def test_delay_proxy_pipelines_chunks_so_the_delay_does_not_cap_throughput(delay_proxy):
    # 2000 separate writes with 50 ms each way: a proxy that slept per chunk
    # would need >= 100 s; a pipeline needs about one delay plus transfer time.
    server, target = await _echo_server()
    async with server, delay_proxy(target, one_way_delay_s=0.050) as proxy:
        reader, writer = await asyncio.open_connection(*proxy.address)
        t = time.perf_counter()
        total = 0
        for _ in range(2000):
            writer.write(b"z" * 4096)
            total += 4096
            await writer.drain()
            await asyncio.sleep(0)  # sleep-ok: yields to the proxy between writes, as separate sends do
        writer.write_eof()
        got = 0
        while data := await reader.read(1 << 16):
            got += len(data)
        elapsed = time.perf_counter() - t
        writer.close()
    assert got == total
    assert 0.100 <= elapsed < 20.0


async def test_zeromq_peers_talk_through_the_delay_proxy_with_its_round_trip_time(delay_proxy):
    import zmq
    import zmq.asyncio

    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer = ctx.socket(zmq.DEALER)
    try:
        async with delay_proxy(("127.0.0.1", port), one_way_delay_s=0.010) as proxy:
            dealer.connect(f"tcp://{proxy.address[0]}:{proxy.address[1]}")
            await dealer.send_multipart([b"hdr", b"x" * 100_000])  # handshake + first message
            ident, *frames = await asyncio.wait_for(router.recv_multipart(), 10)
            assert frames == [b"hdr", b"x" * 100_000]
            t = time.perf_counter()
            await dealer.send(b"ping")
            ident, msg = await asyncio.wait_for(router.recv_multipart(), 10)
            await router.send_multipart([ident, b"pong"])
            assert await asyncio.wait_for(dealer.recv(), 10) == b"pong"
            assert time.perf_counter() - t >= 0.020
    finally:
        dealer.close(linger=0)
        router.close(linger=0)
        ctx.term()


async def test_delay_proxy_resets_the_client_when_the_target_is_down():
    server, target = await _echo_server()
    server.close()
    await server.wait_closed()
    async with DelayProxy(target, one_way_delay_s=0.001) as proxy:
        reader, writer = await asyncio.open_connection(*proxy.address)
        writer.write(b"hello")
        try:  # like a refused connection: reset (or EOF), never a hang
            assert await asyncio.wait_for(reader.read(10), timeout=5) == b""
        except ConnectionResetError:
            pass
        writer.close()


# ---------------------------------------------------------------- Testbed, loopback mode


def _tcp_echo_script() -> str:
    return textwrap.dedent(
        """
        import socket, sys
        s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((sys.argv[1], 0)); s.listen()
        print("READY", *s.getsockname(), flush=True)
        while True:
            c, _ = s.accept()
            with c:
                while data := c.recv(65536):
                    c.sendall(data)
        """
    )


def _talk(tb: Testbed, src: int, addr) -> str:
    client = (
        "import socket, sys\n"
        "c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)\n"
        "c.sendall(b'hello from host'); print(c.recv(100).decode())\n"
    )
    res = tb.host(src).run([PY, "-c", client, addr[0], str(addr[1])], timeout=20)
    assert res.returncode == 0, res.stderr
    return res.stdout.strip()


def _start_echo(tb: Testbed, i: int):
    from bench.testbed.testbed import _read_ready

    p = tb.host(i).popen([PY, "-c", _tcp_echo_script(), tb.host(i).ip],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return p, _read_ready(p, timeout=15, what="echo server")


def test_a_links_round_trip_includes_the_paths_own_so_the_proxy_adds_only_the_rest(monkeypatch):
    measured = []
    monkeypatch.setattr(Testbed, "_measure_path_rtt", lambda self: measured.append(1) or 0.0001)
    with Testbed(2, "1gbit,0.3ms", mode="loopback") as tb:
        assert tb.describe()["path_rtt_ms"] is None  # nothing measured before a delay is asked for
        assert tb.added_one_way_s(0.0003) == pytest.approx(0.0001)
        assert tb.added_one_way_s(0.00005) == 0.0  # a link faster than the path: nothing added
        assert tb.added_one_way_s(0.0) == 0.0
        assert tb.added_one_way_s(0.04) == pytest.approx(0.01995)
        assert tb.describe()["path_rtt_ms"] == pytest.approx(0.1)
    assert measured == [1]  # once per testbed


def test_the_path_round_trip_is_measured_through_a_zero_delay_proxy():
    with Testbed(2, "1gbit,0.3ms", mode="loopback") as tb:
        path = tb.path_rtt_s()
        assert 0 < path < 0.05  # loopback through a relay: well under the 50 ms a WAN test link adds
        assert tb.path_rtt_s() == path  # kept


def test_loopback_mode_runs_pinned_processes_on_distinct_loopback_addresses_and_kills_them():
    with Testbed(2, "100mbit,4ms", mode="loopback") as tb:
        assert tb.mode == "loopback" and not tb.shaped
        assert [h.ip for h in tb.hosts] == ["127.0.0.1", "127.0.0.2"]
        server, addr = _start_echo(tb, 1)
        assert os.sched_getaffinity(server.pid) == {1 % os.cpu_count()}
        assert _talk(tb, 0, addr) == "hello from host"
        delayed = tb.delayed_address(1, addr[1])
        assert delayed != addr
        assert _talk(tb, 0, delayed) == "hello from host"
    assert server.poll() is not None


def test_teardown_kills_whole_process_groups_even_when_they_ignore_sigterm():
    with Testbed(1, mode="loopback") as tb:
        p = tb.host(0).popen(["sh", "-c", "trap '' TERM; sleep 100 & wait"])
        wait_until(lambda: len(_live_group_members(p.pid)) >= 2, 10, "sh (ignoring TERM) and its sleep running")
    assert p.poll() is not None
    assert _live_group_members(p.pid) == []  # the backgrounded sleep is gone too


def _live_group_members(pgid: int) -> list[int]:
    """Processes of a group that are not zombies (orphans wait for init to reap them)."""
    live = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                live.append(int(entry))
    return live


def test_without_root_the_testbed_says_it_falls_back_to_loopback(monkeypatch, capsys):
    monkeypatch.setattr("bench.testbed.testbed.os.geteuid", lambda: 1000)
    with Testbed(2, "1gbit,1ms") as tb:
        assert tb.mode == "loopback"
        assert tb.describe()["fallback_reason"] == "not root"
    assert FALLBACK_LINE in capsys.readouterr().err


def test_testbed_restores_signal_handlers_after_exit():
    before = signal.getsignal(signal.SIGTERM)
    with Testbed(1, mode="loopback"):
        assert signal.getsignal(signal.SIGTERM) is not before
    assert signal.getsignal(signal.SIGTERM) is before


# ---------------------------------------------------------------- Testbed, namespaces (root)


def _netns_works() -> str | None:
    if os.geteuid() != 0:
        return "needs root for network namespaces"
    if not tbnetns.tools_present():
        return "iproute2 (ip, tc) not installed"
    probe = f"meshd-tbprobe{os.getpid()}-h0"
    if subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode != 0:
        return "ip netns add fails here (no permission for namespaces)"
    subprocess.run(["ip", "netns", "delete", probe], capture_output=True)
    return None


_NETNS_SKIP = _netns_works()
needs_netns = pytest.mark.skipif(_NETNS_SKIP is not None, reason=str(_NETNS_SKIP))


def _prefix(tag: str) -> str:
    return f"meshd-tbt{os.getpid()}{tag}"


@pytest.mark.root
@needs_netns
def test_two_namespace_hosts_talk_directly_and_through_the_delay_proxy_then_vanish():
    prefix = _prefix("a")
    with Testbed(2, "100mbit,4ms", name_prefix=prefix) as tb:
        assert tb.mode == "netns" and tb.shaped
        assert sorted(tbnetns.testbed_namespaces(prefix)) == sorted(
            [f"{prefix}-sw", f"{prefix}-h0", f"{prefix}-h1"])
        qdisc = subprocess.run(["tc", "-n", f"{prefix}-h0", "qdisc", "show", "dev", "eth0"],
                               capture_output=True, text=True).stdout
        assert "tbf" in qdisc and "100Mbit" in qdisc
        server, addr = _start_echo(tb, 1)
        assert addr[0] == "10.213.0.2"
        assert _talk(tb, 0, addr) == "hello from host"
        assert _talk(tb, 0, tb.delayed_address(1, addr[1])) == "hello from host"
    assert server.poll() is not None
    assert tbnetns.testbed_namespaces(prefix) == []


@pytest.mark.root
@needs_netns
def test_a_home_on_a_wan_uplink_next_to_an_unshaped_cloud_host():
    prefix = _prefix("w")
    with Testbed(2, name_prefix=prefix, host_links={0: "2mbit/20mbit"}) as tb:
        show = lambda ns, dev: subprocess.run(["tc", "-n", ns, "qdisc", "show", "dev", dev],  # noqa: E731
                                              capture_output=True, text=True).stdout
        assert "2Mbit" in show(f"{prefix}-h0", "eth0") and "20Mbit" in show(f"{prefix}-sw", "h0")
        assert "tbf" not in show(f"{prefix}-h1", "eth0") and "tbf" not in show(f"{prefix}-sw", "h1")
        assert tb.describe()["hosts"][0]["link"] == "2mbit/20mbit"
        server, addr = _start_echo(tb, 1)
        assert _talk(tb, 0, tb.delayed_address(1, addr[1], rtt_s=0.02)) == "hello from host"


@pytest.mark.root
@needs_netns
def test_namespace_hosts_reach_each_other_with_mdns_multicast_but_no_default_route():
    from bench.testbed.selftest import multicast_ok

    with Testbed(2, name_prefix=_prefix("m")) as tb:
        assert multicast_ok(tb)
        routes = subprocess.run(["ip", "-n", tb.host(0).ns, "route", "show"],
                                capture_output=True, text=True).stdout
        assert "default" not in routes


@pytest.mark.root
@needs_netns
def test_a_new_testbed_removes_stale_namespaces_of_its_prefix_and_cleanup_removes_orphans():
    prefix = _prefix("s")
    subprocess.run(["ip", "netns", "add", f"{prefix}-h7"], check=True)  # "crashed run"
    with Testbed(1, name_prefix=prefix):
        assert f"{prefix}-h7" not in tbnetns.list_namespaces()
    orphan = _prefix("o")
    subprocess.run(["ip", "netns", "add", f"{orphan}-h0"], check=True)
    removed, skipped = tbnetns.cleanup(orphan)
    assert removed == [f"{orphan}-h0"] and skipped == []
    assert tbnetns.testbed_namespaces(orphan) == []


@pytest.mark.root
@needs_netns
def test_cleanup_leaves_a_live_testbed_alone():
    prefix = _prefix("l")
    with Testbed(1, name_prefix=prefix):
        removed, skipped = tbnetns.cleanup(prefix)
        assert removed == [] and f"{prefix}-h0" in skipped
        assert f"{prefix}-h0" in tbnetns.list_namespaces()


@pytest.mark.root
@needs_netns
def test_a_second_testbed_with_a_live_prefix_is_refused_not_degraded_to_loopback():
    from bench.testbed.testbed import TestbedBusy

    prefix = _prefix("b")
    with Testbed(1, name_prefix=prefix):
        with pytest.raises(TestbedBusy):
            Testbed(1, name_prefix=prefix).start()
        assert f"{prefix}-h0" in tbnetns.list_namespaces()


@pytest.mark.root
@needs_netns
def test_sigterm_tears_down_namespaces_and_processes():
    prefix = _prefix("t")
    script = textwrap.dedent(
        f"""
        import sys, time
        from bench.testbed import Testbed
        with Testbed(2, "100mbit,4ms", name_prefix={prefix!r}) as tb:
            p = tb.host(1).popen(["sleep", "300"])
            print("UP", p.pid, flush=True)
            time.sleep(60)
        """
    )
    from bench.testbed.testbed import REPO_ROOT, _python_env

    owner = subprocess.Popen([PY, "-c", script], stdout=subprocess.PIPE, text=True,
                             cwd=REPO_ROOT, env=_python_env(None))
    line = owner.stdout.readline()
    assert line.startswith("UP"), line
    sleeper = int(line.split()[1])
    owner.send_signal(signal.SIGTERM)
    assert owner.wait(timeout=20) == 128 + signal.SIGTERM
    assert tbnetns.testbed_namespaces(prefix) == []
    with pytest.raises(ProcessLookupError):
        os.kill(sleeper, 0)
