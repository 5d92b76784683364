"""``python -m bench.testbed selftest``: does the emulated link match its settings?

Two hosts; a probe server in host 1, the probe client in host 0 (separate
processes, pinned to their own cores). For each path it measures the median
round trip of 64-byte TCP messages (one in flight, TCP_NODELAY) and a bulk
transfer (64 MiB, or ~3 s at the configured rate if more, 1 GiB unshaped;
stopped after 6 s) and prints measured against configured:

* ``direct``   - host 0 -> host 1 over the shaped veths, no proxy
* ``proxy0``   - through a delay proxy with zero delay: the proxy's own cost
* ``delayed``  - through the delay proxy at the link's RTT (what benchmarks use)

Plus a UDP multicast datagram to 224.0.0.251:5353 from host 0 to host 1 (mDNS
reachability).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from bench.testbed.linkspec import LinkSpec
from bench.testbed.testbed import Testbed, _read_ready

_MCAST_RECV = """
import socket, struct, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_UDP)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("224.0.0.251", 5353))
s.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP,
             struct.pack("4s4s", socket.inet_aton("224.0.0.251"), socket.inet_aton(sys.argv[1])))
print("READY 224.0.0.251 5353", flush=True)
s.settimeout(5)
data, addr = s.recvfrom(2048)
print("GOT", addr[0], data.decode(), flush=True)
"""

_MCAST_SEND = """
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_UDP)
s.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_TTL, 255)
s.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton(sys.argv[1]))
for _ in range(10):
    s.sendto(b"meshd-testbed-mdns", ("224.0.0.251", 5353))
    time.sleep(0.05)
"""


def multicast_ok(tb: Testbed, src: int = 0, dst: int = 1) -> bool:
    """True when a datagram to 224.0.0.251:5353 from host ``src`` reaches host ``dst``."""
    rx = tb.host(dst).popen([sys.executable, "-c", _MCAST_RECV, tb.host(dst).ip],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _read_ready(rx, timeout=10, what="multicast receiver")
    tb.host(src).run([sys.executable, "-c", _MCAST_SEND, tb.host(src).ip], timeout=10)
    try:
        out, _ = rx.communicate(timeout=6)
    except subprocess.TimeoutExpired:
        tb._kill(rx)
        return False
    return f"GOT {tb.host(src).ip} meshd-testbed-mdns" in out


def selftest(link: LinkSpec, prefix: str = "meshd-tb-selftest", mode: str = "auto",
             bulk_bytes: int = 64 << 20, bulk_seconds: float = 6.0, pings: int = 300) -> dict:
    t0 = time.monotonic()
    with Testbed(2, link, name_prefix=prefix, mode=mode) as tb:
        setup = tb.describe()
        print(f"testbed selftest: mode={tb.mode} hosts={[h.ip for h in tb.hosts]} "
              f"cores={[h.default_cores for h in tb.hosts]} ncpu={os.cpu_count()} "
              f"load1={os.getloadavg()[0]:.2f}")
        print(f"  link {link} ({link.describe()}); rate shaping: "
              f"{('tc ' + setup['tbf'] + ' on both veth ends') if tb.shaped else 'off'}; "
              f"delay: {setup['delay']}")
        _, port = tb.probe_server(1)
        paths = {"direct": (tb.host(1).ip, port),
                 "proxy0": tb.delayed_address(1, port, rtt_s=0.0, proxy=True)}
        if link.delayed:
            paths["delayed"] = tb.delayed_address(1, port)
        if link.rate_bps:  # ~3 s of traffic on fast links, still bounded by bulk_seconds
            bulk_bytes = max(bulk_bytes, int(link.rate_bps / 8 * 3))
        else:  # unshaped runs at several Gbit/s: 64 MiB would be over in ~60 ms
            bulk_bytes = max(bulk_bytes, 1 << 30)
        results: dict[str, dict] = {}
        for name, addr in paths.items():
            ping = tb.probe(0, "ping", addr, count=pings, max_seconds=4)
            bulk = tb.probe(0, "bulk", addr, bytes=bulk_bytes, max_seconds=bulk_seconds)
            results[name] = {"rtt_ms": ping["rtt_median_ms"], "rtt_p90_ms": ping["rtt_p90_ms"],
                             "mbit_s": bulk["mbit_s"], "bulk_bytes": bulk["bytes"]}
            print(f"  {name:8s} {addr[0]}:{addr[1]:<6d} rtt median {ping['rtt_median_ms']:7.3f} ms "
                  f"(p90 {ping['rtt_p90_ms']:.3f})  bulk {bulk['mbit_s']:9.1f} Mbit/s "
                  f"({bulk['bytes'] >> 20} MiB in {bulk['seconds']:.2f} s)")
        mcast = multicast_ok(tb) if tb.mode == "netns" else None
    main = results.get("delayed", results["direct"])
    rate_cfg = f"{link.rate_bps / 1e6:g} Mbit/s" if link.rate_bps else "unshaped"
    if link.rate_bps and setup["mode"] != "netns":
        rate_cfg += " (NOT applied: loopback mode)"
    print(f"rate {rate_cfg} configured → {main['mbit_s']:.1f} Mbit/s measured; "
          f"RTT {link.rtt_s * 1e3:g} ms configured → {main['rtt_ms']:.2f} ms measured "
          f"(direct path {results['direct']['rtt_ms']:.3f} ms)")
    print(f"delay proxy overhead (delay 0): +{results['proxy0']['rtt_ms'] - results['direct']['rtt_ms']:.3f} ms RTT, "
          f"{results['proxy0']['mbit_s']:.0f} Mbit/s vs {results['direct']['mbit_s']:.0f} direct")
    if mcast is not None:
        print(f"multicast 224.0.0.251:5353 host0 → host1: {'ok' if mcast else 'FAILED'}")
    return {
        "bench": "testbed_selftest",
        "link": str(link),
        "mode": setup["mode"],
        "configured": {"rate_mbit_s": link.rate_bps / 1e6 if link.rate_bps else None,
                       "rtt_ms": link.rtt_s * 1e3},
        "measured": {"rate_mbit_s": main["mbit_s"], "rtt_ms": main["rtt_ms"]},
        "paths": results,
        "multicast_ok": mcast,
        "setup": setup,
        "ncpu": os.cpu_count(),
        "load_avg_1m": os.getloadavg()[0],
        "seconds": time.monotonic() - t0,
    }
