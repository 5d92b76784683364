"""Three daemons in three network namespaces on one bridge: real interfaces, real multicast.

Runs only as root (CI is root); each namespace has one veth interface on a
private /24 and a loopback, and the daemons advertise on the veth by name
(``--interface``), so this checks discovery and transport across interfaces
rather than on a shared loopback.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess

import pytest

from tests.support.daemons import GONE_AFTER_S, kill_hard, states, summary

from tests.support.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.root]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


@contextlib.contextmanager
def bridged_namespaces(n: int):
    """Yield [(namespace, interface, address)] joined by a bridge; removes everything after."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2")
    tag = f"{os.getpid() % 100000}"
    bridge = f"mbr{tag}"
    made_ns, made_links = [], []
    subnet = 10 + os.getpid() % 200
    try:
        try:
            _ip("link", "add", bridge, "type", "bridge")
        except subprocess.CalledProcessError as exc:
            pytest.skip(f"cannot create a bridge here: {exc.stderr.strip()}")
        made_links.append(bridge)
        _ip("link", "set", bridge, "up")
        out = []
        for i in range(n):
            ns, host_end, ns_end = f"mns{tag}-{i}", f"mh{tag}{i}", f"mv{tag}{i}"
            _ip("netns", "add", ns)
            made_ns.append(ns)
            _ip("link", "add", host_end, "type", "veth", "peer", "name", ns_end)
            made_links.append(host_end)
            _ip("link", "set", ns_end, "netns", ns)
            _ip("link", "set", host_end, "master", bridge)
            _ip("link", "set", host_end, "up")
            addr = f"10.{subnet}.77.{i + 1}"
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", ns_end)
            _ip("-n", ns, "link", "set", ns_end, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            out.append((ns, ns_end, addr))
        yield out
    finally:
        for ns in made_ns:
            _ip("netns", "del", ns, check=False)
        for link in made_links:
            _ip("link", "del", link, check=False)


def test_daemons_in_three_namespaces_discover_each_other_over_a_bridge(mesh):
    with bridged_namespaces(3) as spaces:
        (ns_a, if_a, ip_a), (ns_b, if_b, _), (ns_c, if_c, _) = spaces
        a = mesh.spawn("a", new_home="flat", interface=if_a, prefix=["ip", "netns", "exec", ns_a])
        s = a.wait_serving()
        assert s["interfaces"] == [{"name": if_a, "addresses": [ip_a]}]
        b = mesh.spawn("b", token=mesh.invite(a), interface=if_b, prefix=["ip", "netns", "exec", ns_b])
        c = mesh.spawn("c", token=mesh.invite(a), interface=if_c, prefix=["ip", "netns", "exec", ns_c])
        procs = (a, b, c)
        for p in procs:
            p.wait_serving()

        def all_ready():
            return all(states(p.status()) == {"a": "ready", "b": "ready", "c": "ready"} for p in procs)

        wait_until(all_ready, 10, what="a, b, c ready across namespaces", explain=lambda: summary(*procs))
        for p in procs:  # each reaches the others at their namespace's address
            addrs = {m["name"]: m["address"] for m in p.status()["members"]}
            assert all(v and v.startswith(f"10.") for v in addrs.values()), addrs

        kill_hard(c)
        wait_until(lambda: all(states(p.status())["c"] == "gone" for p in (a, b)), GONE_AFTER_S + 3.0,
                   what="c gone on a and b", explain=lambda: summary(a, b))
