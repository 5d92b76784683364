"""A user-space TCP proxy that delays each direction by a fixed one-way time.

Why: this kernel has no ``netem``, so ``tc`` can shape rate (``tbf``) but not add
latency. ZeroMQ endpoints are plain TCP, so a peer that connects to this proxy
instead of the real service sees the configured round-trip time.

How: every chunk read from one side is stamped ``now + delay`` and queued; a
timer releases all chunks whose time has come, in order. The delay is a
*pipeline*, not a per-chunk sleep: while one chunk waits, later chunks keep
arriving, so throughput is not capped by the delay (bytes in flight = rate x
delay, bounded by ``max_buffer_bytes`` per direction, which pauses reading).

The wake-ups use a Linux ``timerfd`` (nanosecond deadline, epoll-driven) because
asyncio's own timers round up to whole milliseconds, which would turn the
0.5 ms one-way delay of a '1gbit,1ms' link into ~1 ms. Elsewhere it falls back
to ``loop.call_at``.

It is a split-TCP proxy: the sender's TCP sees the proxy's quick ACKs, so TCP's
congestion window does not grow against the emulated RTT. Applications (message
round trips, request/response) see the full delay; bulk TCP ramp-up is somewhat
optimistic compared with a real long path. At home-network RTTs (1-4 ms) TCP
slow start ends within a few ms, so the difference is small.

Half-close is forwarded (EOF travels with the same delay as data); a reset on
one side aborts the other.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import ctypes
import os
import signal
import socket
import sys
import time
from typing import Callable

_CLOCK_MONOTONIC = 1
_TFD_NONBLOCK = os.O_NONBLOCK
_TFD_CLOEXEC = 0o2000000
_TFD_TIMER_ABSTIME = 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


try:  # Linux timerfd through libc; None elsewhere
    _libc = ctypes.CDLL(None, use_errno=True)
    _timerfd_create = _libc.timerfd_create
    _timerfd_settime = _libc.timerfd_settime
except (OSError, AttributeError):  # pragma: no cover - non-Linux
    _timerfd_create = None


class _Timer:
    """A one-shot deadline on ``time.monotonic()`` with sub-millisecond precision."""

    def __init__(self, loop: asyncio.AbstractEventLoop, callback: Callable[[], None]):
        self._loop = loop
        self._callback = callback
        self._handle: asyncio.TimerHandle | None = None
        self._fd = -1
        self.armed = False
        if _timerfd_create is not None and sys.platform.startswith("linux"):
            fd = _timerfd_create(_CLOCK_MONOTONIC, _TFD_NONBLOCK | _TFD_CLOEXEC)
            if fd >= 0:
                self._fd = fd
                loop.add_reader(fd, self._on_fd)

    def arm(self, deadline: float) -> None:
        self.armed = True
        if self._fd >= 0:
            # CLOCK_MONOTONIC is what time.monotonic() reads on Linux. A zero
            # it_value would disarm, so past deadlines become 1 ns.
            sec = max(deadline, 1e-9)
            spec = _Itimerspec()
            spec.it_value.tv_sec = int(sec)
            spec.it_value.tv_nsec = max(1, int((sec - int(sec)) * 1e9))
            if _timerfd_settime(self._fd, _TFD_TIMER_ABSTIME, ctypes.byref(spec), None) != 0:
                raise OSError(ctypes.get_errno(), "timerfd_settime failed")
        else:
            if self._handle is not None:
                self._handle.cancel()
            delay = max(0.0, deadline - time.monotonic())
            self._handle = self._loop.call_later(delay, self._fire)

    def _on_fd(self) -> None:
        try:
            os.read(self._fd, 8)
        except BlockingIOError:
            return
        self._fire()

    def _fire(self) -> None:
        self._handle = None
        self.armed = False
        self._callback()

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
        if self._fd >= 0:
            self._loop.remove_reader(self._fd)
            os.close(self._fd)
            self._fd = -1


class _Direction:
    """One direction of one connection: stamped chunks waiting for their release time."""

    def __init__(self, conn: "_Connection", src: "_Side", dst: "_Side", delay: float):
        self.conn = conn
        self.src, self.dst = src, dst
        self.delay = delay
        self.queue: collections.deque[tuple[float, bytes | None]] = collections.deque()
        self.buffered = 0
        self.done = False  # EOF delivered (or destination gone)
        self.eof_queued = False
        self.src_paused = False
        self.timer = _Timer(conn.loop, self.flush)

    def feed(self, data: bytes) -> None:
        self.queue.append((time.monotonic() + self.delay, data))
        self.buffered += len(data)
        if self.buffered > self.conn.proxy.max_buffer_bytes and not self.src_paused:
            self.src_paused = True
            self.src.transport.pause_reading()
        self._schedule()

    def feed_eof(self) -> None:
        if self.eof_queued:
            return
        self.eof_queued = True
        self.queue.append((time.monotonic() + self.delay, None))
        self._schedule()

    def _schedule(self) -> None:
        if self.queue and not self.timer.armed and not self.dst.write_paused:
            if self.delay <= 0:
                self.flush()
            else:
                self.timer.arm(self.queue[0][0])

    def flush(self) -> None:
        """Release every chunk whose time has come; re-arm for the next one."""
        if self.done:
            return
        now = time.monotonic()
        out: list[bytes] = []
        eof = False
        while self.queue and self.queue[0][0] <= now and not self.dst.write_paused:
            _, data = self.queue.popleft()
            if data is None:
                eof = True
                break
            out.append(data)
            self.buffered -= len(data)
            if len(out) >= 64:  # bound one write; the rest goes on the next turn
                break
        if out and not self.dst.lost:
            self.dst.transport.write(b"".join(out) if len(out) > 1 else out[0])
            self.conn.proxy.bytes_forwarded += sum(map(len, out))
        if self.src_paused and self.buffered <= self.conn.proxy.max_buffer_bytes // 2:
            self.src_paused = False
            if not self.src.lost:
                self.src.transport.resume_reading()
        if eof:
            self.done = True
            if not self.dst.lost and self.dst.transport.can_write_eof():
                self.dst.transport.write_eof()
            self.conn.maybe_close()
            return
        if self.queue and not self.timer.armed and not self.dst.write_paused:
            if self.queue[0][0] <= now:
                self.conn.loop.call_soon(self.flush)
            else:
                self.timer.arm(self.queue[0][0])

    def close(self) -> None:
        self.done = True
        self.queue.clear()
        self.timer.close()


class _Side(asyncio.Protocol):
    """Protocol for one socket of a connection (the client's or the upstream's)."""

    def __init__(self, conn: "_Connection", name: str):
        self.conn = conn
        self.name = name
        self.transport: asyncio.Transport | None = None
        self.out: _Direction | None = None  # data read here goes out through this
        self.write_paused = False
        self.lost = False

    def connection_made(self, transport) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.conn.side_made(self)

    def data_received(self, data: bytes) -> None:
        if self.out is not None:
            self.out.feed(data)

    def eof_received(self) -> bool:
        if self.out is not None:
            self.out.feed_eof()
        return True  # keep the other half open: half-close is forwarded

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        for d in self.conn.directions():
            if d.dst is self:
                d.flush()

    def connection_lost(self, exc) -> None:
        self.lost = True
        self.conn.side_lost(self, exc)


class _Connection:
    def __init__(self, proxy: "DelayProxy"):
        self.proxy = proxy
        self.loop = asyncio.get_running_loop()
        self.client = _Side(self, "client")
        self.upstream = _Side(self, "upstream")
        self.up_dir: _Direction | None = None
        self.down_dir: _Direction | None = None
        self.closed = False

    def directions(self):
        return [d for d in (self.up_dir, self.down_dir) if d is not None]

    def side_made(self, side: _Side) -> None:
        if side is self.client:
            side.transport.pause_reading()  # until the upstream is connected
            self.proxy._connections.add(self)
            self.proxy.connections_total += 1
            self.loop.create_task(self._connect_upstream())

    async def _connect_upstream(self) -> None:
        host, port = self.proxy.target
        try:
            await self.loop.create_connection(lambda: self.upstream, host, port)
        except OSError:
            self.client.transport.abort()
            return
        if self.client.lost:
            self.upstream.transport.abort()
            return
        self.up_dir = _Direction(self, self.client, self.upstream, self.proxy.one_way_delay_s)
        self.down_dir = _Direction(self, self.upstream, self.client, self.proxy.one_way_delay_s)
        self.client.out, self.upstream.out = self.up_dir, self.down_dir
        self.client.transport.resume_reading()

    def side_lost(self, side: _Side, exc) -> None:
        other = self.upstream if side is self.client else self.client
        if exc is not None or self.up_dir is None:
            self.close(abort=True)
            return
        # Data already read from the lost side still travels, then EOF.
        if side.out is not None:
            side.out.feed_eof()
        for d in self.directions():
            if d.dst is side:
                d.close()
        if other.lost:
            self.close(abort=True)
        else:
            self.maybe_close()

    def maybe_close(self) -> None:
        if all(d.done for d in self.directions()) and self.directions():
            self.close(abort=False)

    def close(self, abort: bool) -> None:
        if self.closed:
            return
        self.closed = True
        for d in self.directions():
            d.close()
        for s in (self.client, self.upstream):
            if s.transport is not None and not s.lost:
                s.transport.abort() if abort else s.transport.close()
        self.proxy._connections.discard(self)


class DelayProxy:
    """Listen on ``listen``; forward each connection to ``target`` with a one-way delay.

    ``async with DelayProxy(("10.0.0.2", 5555), 0.002) as p: connect(p.address)``.
    """

    def __init__(
        self,
        target: tuple[str, int],
        one_way_delay_s: float,
        listen: tuple[str, int] = ("127.0.0.1", 0),
        max_buffer_bytes: int = 8 << 20,
    ):
        if one_way_delay_s < 0:
            raise ValueError("delay must be >= 0")
        self.target = target
        self.one_way_delay_s = one_way_delay_s
        self.listen = listen
        self.max_buffer_bytes = max_buffer_bytes
        self.address: tuple[str, int] | None = None
        self.connections_total = 0
        self.bytes_forwarded = 0
        self._server: asyncio.base_events.Server | None = None
        self._connections: set[_Connection] = set()

    async def start(self) -> tuple[str, int]:
        self._server = await asyncio.get_running_loop().create_server(
            lambda: _Connection(self).client, self.listen[0], self.listen[1],
            reuse_address=True, backlog=128,
        )
        self.address = self._server.sockets[0].getsockname()[:2]
        return self.address

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for c in list(self._connections):
            c.close(abort=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    async def __aenter__(self) -> "DelayProxy":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


def _hostport(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


async def _serve(args) -> None:
    proxy = DelayProxy(_hostport(args.target), args.one_way_ms / 1000.0, _hostport(args.listen))
    host, port = await proxy.start()
    print(f"READY {host} {port}", flush=True)  # the parent reads this line
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await proxy.close()


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.testbed.delay_proxy --listen IP:PORT --target IP:PORT --one-way-ms X``."""
    p = argparse.ArgumentParser(prog="python -m bench.testbed.delay_proxy", description=main.__doc__)
    p.add_argument("--listen", default="127.0.0.1:0")
    p.add_argument("--target", required=True)
    p.add_argument("--one-way-ms", type=float, default=0.0)
    args = p.parse_args(argv)
    asyncio.run(_serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
