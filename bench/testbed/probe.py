"""Tiny TCP probe used by the selftest: a ping-pong/bulk server and its client.

Runs as a separate process inside a host's namespace (``python -m
bench.testbed.probe serve|ping|bulk``) so it measures the emulated path, not an
in-process shortcut. Plain blocking sockets: the probe must not be the
bottleneck it is measuring, and a thread per connection is the cheapest way.

Protocol: the client's first byte picks the mode. ``P``: the server echoes
fixed-size messages back. ``B``: the server counts bytes until EOF and answers
with the count (8 bytes, big endian).
"""

from __future__ import annotations

import argparse
import json
import socket
import socketserver
import statistics
import sys
import time

PING_SIZE = 64
BULK_CHUNK = 1 << 20


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            raise ConnectionError("peer closed early")
        buf += part
    return bytes(buf)


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        sock: socket.socket = self.request
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        mode = sock.recv(1)
        if mode == b"P":
            while True:
                try:
                    msg = _recv_exact(sock, PING_SIZE)
                except ConnectionError:
                    return
                sock.sendall(msg)
        elif mode == b"B":
            total = 0
            buf = bytearray(BULK_CHUNK)
            while True:
                n = sock.recv_into(buf)
                if n == 0:
                    break
                total += n
            sock.sendall(total.to_bytes(8, "big"))


class _Server(socketserver.ThreadingTCPServer):
    allow_reuse_address = True
    daemon_threads = True


def serve(host: str, port: int) -> None:
    with _Server((host, port), _Handler) as srv:
        print(f"READY {srv.server_address[0]} {srv.server_address[1]}", flush=True)
        srv.serve_forever()


def ping(host: str, port: int, count: int, max_seconds: float) -> dict:
    """Round-trip times of ``count`` 64-byte messages (one in flight), after 10 warm-ups."""
    with socket.create_connection((host, port), timeout=10) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.sendall(b"P")
        msg = b"x" * PING_SIZE
        rtts = []
        deadline = time.monotonic() + max_seconds
        for i in range(count + 10):
            t = time.perf_counter()
            s.sendall(msg)
            _recv_exact(s, PING_SIZE)
            if i >= 10:
                rtts.append(time.perf_counter() - t)
            if time.monotonic() > deadline:
                break
    rtts.sort()
    return {
        "count": len(rtts),
        "rtt_median_ms": statistics.median(rtts) * 1e3,
        "rtt_p10_ms": rtts[len(rtts) // 10] * 1e3,
        "rtt_p90_ms": rtts[(len(rtts) * 9) // 10] * 1e3,
        "rtt_min_ms": rtts[0] * 1e3,
    }


def bulk(host: str, port: int, nbytes: int, max_seconds: float) -> dict:
    """Send up to ``nbytes`` (stopping early after ``max_seconds``); rate = bytes acknowledged by the server / time."""
    chunk = b"\0" * BULK_CHUNK
    with socket.create_connection((host, port), timeout=30) as s:
        s.sendall(b"B")
        sent = 0
        t0 = time.perf_counter()
        deadline = time.monotonic() + max_seconds
        while sent < nbytes and time.monotonic() < deadline:
            n = min(BULK_CHUNK, nbytes - sent)
            s.sendall(chunk[:n])
            sent += n
        s.shutdown(socket.SHUT_WR)
        got = int.from_bytes(_recv_exact(s, 8), "big")
        dt = time.perf_counter() - t0
    if got != sent + 0:
        raise RuntimeError(f"bulk: sent {sent} bytes, server counted {got}")
    return {"bytes": got, "seconds": dt, "mbit_s": got * 8 / dt / 1e6}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.testbed.probe")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--listen", default="0.0.0.0:0")
    for name in ("ping", "bulk"):
        c = sub.add_parser(name)
        c.add_argument("--connect", required=True)
        c.add_argument("--count", type=int, default=300)
        c.add_argument("--bytes", type=int, default=64 << 20)
        c.add_argument("--max-seconds", type=float, default=6.0)
    args = p.parse_args(argv)
    if args.cmd == "serve":
        host, _, port = args.listen.rpartition(":")
        serve(host, int(port))
        return 0
    host, _, port = args.connect.rpartition(":")
    if args.cmd == "ping":
        out = ping(host, int(port), args.count, args.max_seconds)
    else:
        out = bulk(host, int(port), args.bytes, args.max_seconds)
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
