"""A tensor-parallel group's links: the partial sums of every layer, exchanged in the compute thread.

Why not the stage links: a decode step of a split model makes one or two reductions a layer (up to 56 on
a 28-layer model), each a few kilobytes that the next half-layer waits for. An asyncio hop per reduction
would cost more than the product it joins, so the group's sockets are used only by the thread that
computes, with the GIL released while they wait. The group forms over CurveZMQ: each member listens on
one ROUTER socket that admits only the group's member keys (a ZAP handler in its own thread) and reaches
every other member through a DEALER that checks that member's server key — encrypted and authenticated
both ways, like every other link of the home.

The partial sums themselves travel beside it, on one :mod:`transport.group_stream` per pair of members:
a TCP stream the compute thread writes and reads itself, sealed with session keys agreed over this
link (ZeroMQ's hop through its I/O thread was most of an exchange's cost on a one-core device). The
CurveZMQ link keeps what needs no speed: forming the group, the keys, the first member's commands, and
ZeroMQ's heartbeats that notice a member whose machine went silent.

Every member sends its partial to every other member and adds all of them in rank order
(``decoding.tensor_group.add_in_rank_order``): one exchange per reduction, and every member ends up
with the same bits. Inside the decode kernel the same frames are sealed, sent, read and added by C
(:meth:`GroupLink.native_sum`, ``decoding/quant/native/group_sum.cpp``) on these very streams and keys:
no trip through Python for each reduction (measured over the testbed's 0.3 ms link: ~35 us a side).
Activations travel as float32 (exact: the group computes what an in-process group computes). A peer
whose connection drops ends the wait at once (:class:`GroupLost`); a peer that is merely slow is waited
for as long as its link stays up.
"""

from __future__ import annotations

import ctypes
import logging
import os
import select
import struct
import time
from collections import deque
from dataclasses import dataclass

import numpy as np
import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from decoding.quant import native as kernels
from decoding.tensor_group import GroupLost, add_in_rank_order
from transport import group_stream
from transport.group_stream import SealedStream
from transport.keys import Keypair, validate_public_key
from transport.log import get_logger

log = get_logger("transport.group_link")

_HEADER = group_stream.HEADER  # kind, pass, exchange within the pass
_IDENTITY = struct.Struct("<HI")  # rank, epoch (the plan the links were formed for)
_HELLO_BODY = struct.Struct(f"<{group_stream.KX_PUBLIC_BYTES}sH")  # a member's stream key and port
_PARTIAL, _COMMAND, _HELLO = 1, 2, 3
# a caller on the stream port opens its stream within this (or is not a member): a stranger that connects
# and says nothing holds the group's formation no longer
_STREAM_PREAMBLE_S = 2.0
# a member waiting on a partial sum looks for it without sleeping this long first (yielding the core to
# anything else runnable): its core has nothing else to do, and waking from idle costs more than the wait
# (measured in a decode step on loopback: 88 us from the later member's send to both holding the sum when
# blocking at once, 46 us spinning first). Only while the waits are that short: a member that waits
# longer (a slower partner) sleeps at once instead of burning its core for nothing.
_SPIN_S = 0.0005
_ZAP_DOMAIN = "meshd-group"
_SLICE_MS = 200  # a blocked receive looks at the links' health (and an abort) this often
# ZeroMQ's own heartbeat on every link: a member whose machine lost power sends no reset, so without it a
# partial sum would be waited for forever
_HEARTBEAT_IVL_MS, _HEARTBEAT_TIMEOUT_MS = 1000, 5000
_REDIAL_S = 0.2  # a refused link is dialled again this often while the group forms
#: ``python``: every exchange through :meth:`GroupLink._swap` (the reference; an A/B switch for benchmarks)
EXCHANGE_ENV = "MESHD_GROUP_EXCHANGE"


@dataclass(frozen=True)
class GroupPeer:
    rank: int
    endpoint: str  # tcp://host:port of its group socket
    public_key: bytes
    # host:port of its stream listener when it is not reached at the endpoint's host and the port it
    # announces (a test bed's delay proxy in between)
    data_endpoint: str | None = None


class GroupLink:
    """Member ``rank``'s end of the group's links (a :class:`decoding.tensor_group.PartialSums`)."""

    def __init__(self, rank: int, size: int, keypair: Keypair, bind: str = "tcp://127.0.0.1:0", epoch: int = 0,
                 native: bool | None = None):
        """``epoch``: the plan this group is for; messages of another epoch's links (a member still on the
        previous plan, reaching the same port) are dropped. ``native``: let the decode kernel exchange the
        partial sums itself (default: yes, unless ``MESHD_GROUP_EXCHANGE=python``)."""
        self.rank, self.size, self.epoch = rank, size, epoch
        self._native_wanted = (os.environ.get(EXCHANGE_ENV, "native") != "python") if native is None else native
        self._native: kernels.GroupSum | None = None  # the kernel's exchange state, made at its first use
        self._reducer = None
        self._native_check = kernels.GROUP_CHECK_FN(self._native_links_ok)
        self.native_exchanges = 0  # how many of this member's exchanges the kernel made itself
        self._native_interrupt: BaseException | None = None
        self._ctx = zmq.Context()
        self._members: set[bytes] = {keypair.public}
        self._auth = ThreadAuthenticator(self._ctx, log=logging.getLogger("transport.group_link.zap"))
        self._out: dict[int, zmq.Socket] = {}
        self._monitors: list[zmq.Socket] = []
        self._closed = False
        try:
            self._auth.start()
            self._auth.configure_curve_callback(_ZAP_DOMAIN, self)
            self._inbox = self._ctx.socket(zmq.ROUTER)
            self._inbox.curve_server = True
            self._inbox.curve_publickey, self._inbox.curve_secretkey = keypair.public, keypair.secret
            self._inbox.zap_domain = _ZAP_DOMAIN.encode()
            self._inbox.linger = 0
            self._inbox.rcvtimeo = _SLICE_MS
            # a member that reconnects (its first handshakes refused until we admitted its key, a link
            # that dropped) comes back under the same identity: the new connection replaces the old
            self._inbox.router_handover = 1
            self._inbox.bind(bind)
        except zmq.ZMQError as exc:
            self._auth.stop()
            self._ctx.destroy(linger=0)
            raise GroupLost(f"the group socket cannot listen on {bind}: {exc}") from exc
        self.endpoint: str = self._inbox.getsockopt_string(zmq.LAST_ENDPOINT)
        host, port = _host_port(self.endpoint)
        try:
            # the partial sums' stream: the group port + 1 when it is fixed (7414 by default), else any
            self._listener = group_stream.listen(host, port + 1 if _host_port(bind)[1] else 0)
        except BaseException as exc:
            self._inbox.close(linger=0)
            self._auth.stop()
            self._ctx.destroy(linger=0)
            if isinstance(exc, (OSError, ValueError)):
                raise GroupLost(f"the group's stream cannot listen beside {self.endpoint}: {exc}") from exc
            raise
        self.data_port: int = self._listener.getsockname()[1]
        self._kx = group_stream.kx_keypair()
        self._keypair = keypair
        self._watch: dict[zmq.Socket, int] = {}  # the formed links' monitors -> the member at the other end
        self._early: dict[tuple[int, int, int], memoryview] = {}  # (rank, pass, exchange) before we asked
        self._commands: deque[bytes] = deque()
        self._pass = 0
        self._exchange = 0
        self._lost: str = ""
        self._abort_event = None
        self._peers: dict[int, GroupPeer] = {}
        self._hellos: dict[int, tuple[bytes, int]] = {}  # rank -> (its stream key, its stream port)
        self._streams: dict[int, SealedStream] = {}
        self._by_fd: dict[int, SealedStream] = {}
        self._poller = select.poll()
        self._last_wait_s = 0.0  # how long the last exchange waited for the others (whether to spin)

    # ZAP: only the group's members may connect (ThreadAuthenticator's credentials provider)
    def callback(self, domain: str, key: bytes) -> bool:
        return key in self._members

    def connect(self, peers: list[GroupPeer], timeout_s: float = 60.0) -> None:
        """Reach every other member (their keys admitted here as well), and wait until every link's
        handshake has passed. A member that has not admitted our key yet (it is still loading, or reading
        the plan) refuses the first handshakes, and ZeroMQ never dials again after a refused one (libzmq
        takes a ZAP refusal as final), so a refused link is dialled anew, every ``_REDIAL_S``, until
        the group forms — or ``timeout_s`` passes without it (:class:`GroupLost`).

        Members of one process (tests) may call :meth:`admit` on each before any of them connects."""
        if sorted([self.rank, *(p.rank for p in peers)]) != list(range(self.size)):
            raise ValueError(f"member {self.rank} of {self.size} needs every other member, got {[p.rank for p in peers]}")
        keys = self.admit(peers)
        self._peers.update({p.rank: p for p in peers})
        waiting: dict[zmq.Socket, GroupPeer] = {}
        for p, key in zip(peers, keys):
            waiting[self._dial(p, key)] = p
        deadline = time.monotonic() + timeout_s
        refused: dict[int, str] = {}
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                why = ", ".join(f"member {p.rank}: {refused.get(p.rank, 'no answer')}" for p in waiting.values())
                raise GroupLost(f"the group did not form within {timeout_s:g} s ({why})")
            for monitor in [m for m in waiting if m.poll(min(100, int(left * 1000) + 1))]:
                event = recv_monitor_message(monitor)
                if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    self._watch[monitor] = waiting.pop(monitor).rank
                elif event["event"] in (zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL):
                    peer = waiting.pop(monitor)
                    refused[peer.rank] = str(event["event"])
                    self._monitors.remove(monitor)  # its socket is replaced (closed by _dial)
                    monitor.close(linger=0)
                    time.sleep(_REDIAL_S)  # sleep-ok: the member admits our key once it has read the plan
                    waiting[self._dial(peer, validate_public_key(peer.public_key))] = peer
        # this member's stream key and port, to each member over the link that authenticated it; the
        # streams open at the first exchange (every member is in it then, so nobody waits on another's setup)
        hello = _HELLO_BODY.pack(self._kx[0], self.data_port)
        for s in self._out.values():
            self._send(s, _HELLO, hello)
        log.info("group_formed", rank=self.rank, size=self.size)

    def _dial(self, peer: GroupPeer, key: bytes) -> zmq.Socket:
        """A DEALER to ``peer`` (replacing one a refusal left dead); returns its monitor."""
        old = self._out.pop(peer.rank, None)
        if old is not None:
            old.close(linger=0)
        s = self._ctx.socket(zmq.DEALER)
        s.curve_serverkey = key
        s.curve_publickey, s.curve_secretkey = self._keypair.public, self._keypair.secret
        s.routing_id = _IDENTITY.pack(self.rank, self.epoch)
        s.linger = 0
        s.sndhwm = s.rcvhwm = 0
        s.heartbeat_ivl, s.heartbeat_timeout = _HEARTBEAT_IVL_MS, _HEARTBEAT_TIMEOUT_MS
        s.heartbeat_ttl = 2 * _HEARTBEAT_TIMEOUT_MS
        monitor = s.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
                                       | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
        s.connect(peer.endpoint)
        self._out[peer.rank] = s
        self._monitors.append(monitor)
        return monitor

    def admit(self, peers: list[GroupPeer]) -> list[bytes]:
        """Let ``peers``' keys through this member's socket (before they connect, or as they do)."""
        keys = [validate_public_key(p.public_key) for p in peers]
        self._members.update(keys)
        return keys

    # -- PartialSums ---------------------------------------------------------------------
    def begin_pass(self, number: int) -> None:
        """Exchanges from here on belong to pass ``number`` (the first member numbers them; the others take
        the number from its command): a partial sum pairs only with its own pass's."""
        self._pass, self._exchange = number, 0
        self._early = {k: v for k, v in self._early.items() if k[1] >= number}

    def sum_(self, x: np.ndarray) -> None:
        others = [r for r in range(self.size) if r != self.rank]
        add_in_rank_order(self._swap(x, to=others, want=others), x)

    def gather(self, x: np.ndarray) -> np.ndarray:
        """To the first member only: the others send their share and go on."""
        parts = self.gather_parts(x)
        return np.concatenate(parts, axis=-1) if parts is not None else x

    def gather_parts(self, x: np.ndarray) -> list[np.ndarray] | None:
        """To the first member only, every member's share as it came; the others send theirs and go on."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        if self.rank:
            self._swap(x, to=[0], want=[])
            return None
        return self._swap(x, to=[], want=list(range(1, self.size)))

    def native_sum(self) -> tuple[object, int] | None:
        """(the kernel's reducer, its ctx address) for one kernel call that sums its partials in C over
        these streams, or None: the links are lost, the kernels are not built, there are more members than
        it serves, or a stream holds bytes (or this member kept a partial early) that the Python path must
        take first. After the call, :meth:`native_done`."""
        if not self._native_wanted or self._closed or self._lost or self.size > kernels.GROUP_SUM_MAX_MEMBERS:
            return None
        self._open_streams()
        if any(key[1] >= self._pass for key in self._early):
            return None
        if not all(stream.idle() for stream in self._streams.values()):
            return None
        if self._native is None:
            others = [r for r in range(self.size) if r != self.rank]
            try:
                self._reducer = kernels.group_sum_reducer()
                push, pull = group_stream.sodium_stream_functions()
                # (the streams, open now, stay these until the links close)
                peers = [kernels.GroupSumPeer(r, *self._streams[r].native_handles()) for r in others]
            except (kernels.KernelUnavailable, ImportError, AttributeError) as exc:
                log.warning("group_native_sum_unavailable", why=str(exc))
                self._native_wanted = False
                return None
            self._native = kernels.GroupSum(spin_s=_SPIN_S, slice_ms=_SLICE_MS, rank=self.rank, size=self.size,
                                            npeers=len(others), seal=push, open=pull,
                                            check=ctypes.cast(self._native_check, ctypes.c_void_p).value)
            self._native.peers[:len(peers)] = peers
        g = self._native
        # (g.abort is abort()'s alone: set once, the links stay lost and nothing comes here again)
        g.pass_, g.exchange, g.last_wait_s = self._pass, self._exchange, self._last_wait_s
        return self._reducer, ctypes.addressof(g)

    def native_done(self, failed: bool) -> None:
        """The kernel call that :meth:`native_sum` served returned: its exchanges are this member's count;
        a failure raises :class:`GroupLost` and leaves the links lost (a frame may be half read)."""
        g = self._native
        self.native_exchanges += g.exchange - self._exchange
        self._exchange, self._last_wait_s = g.exchange, g.last_wait_s
        if failed:
            self._lost = self._lost or g.error.decode(errors="replace") or "the group's exchange failed"
            log.warning("group_exchange_failed", rank=self.rank, why=self._lost)
            interrupted, self._native_interrupt = self._native_interrupt, None
            if interrupted is not None:  # Ctrl-C or an exit while the wait asked Python: that, not GroupLost
                raise interrupted
            raise GroupLost(self._lost)

    def _native_links_ok(self) -> int:
        """group_sum.cpp's check, while a wait is blocked: 0 while the links are up and nobody aborted."""
        try:
            self._check_links()
        except GroupLost:
            return 1
        except BaseException as exc:  # noqa: BLE001 - nothing may cross the C frames: raised by native_done
            self._native_interrupt = exc
            return 1
        return 0

    # -- commands from the group's first member -------------------------------------------
    def send_command(self, payload: bytes) -> None:
        for s in self._out.values():
            self._send(s, _COMMAND, payload)

    def next_command(self, timeout_s: float | None = None) -> bytes | None:
        """The first member's next command (None: ``timeout_s`` passed without one)."""
        if self._commands:
            return self._commands.popleft()
        got = self._receive(lambda kind, rank, p, n: kind == _COMMAND, timeout_s)
        return None if got is None else bytes(got[2])

    def abort(self, why: str) -> None:
        """End this member's waits (any thread): the next or current receive raises :class:`GroupLost`."""
        self._lost = self._lost or why
        if self._native is not None:
            self._native.abort = 1

    def abort_when(self, event) -> None:
        """Abort as soon as ``event`` (a ``threading.Event``) is set: a follower leaving for a new plan."""
        self._abort_event = event

    def close(self, linger_s: float = 0.0) -> None:
        """Close the links (again: nothing). ``linger_s``: how long what is still queued (a last command)
        may take to leave."""
        if self._closed:
            return
        self._closed = True
        for stream in self._streams.values():
            stream.close()
        self._listener.close()
        for s in self._out.values():
            s.close(linger=int(linger_s * 1000))
        self._inbox.close(linger=0)
        for m in self._monitors:
            m.close(linger=0)
        self._auth.stop()
        self._ctx.term()

    # -- the exchange ---------------------------------------------------------------------
    def _send(self, sock: zmq.Socket, kind: int, payload) -> None:
        # copied into the message, never sent from the buffer in place: a sum is written into ``x`` while a
        # zero-copy send could still be reading it (and a gathered share's buffer is the allocator's again)
        try:
            sock.send_multipart([_HEADER.pack(kind, self._pass, self._exchange), payload])
        except zmq.ZMQError as exc:
            raise GroupLost(f"the group link failed: {exc}") from exc

    def _swap(self, x: np.ndarray, to: list[int], want: list[int]) -> list[np.ndarray]:
        """Exchange ``n`` of this pass: ``x`` to the members ``to``, and every member's part back (``x``
        at this member's rank) once those in ``want`` have arrived. Sending and receiving interleave, so
        a prompt's megabytes never deadlock two members that both send first."""
        self._open_streams()
        self._exchange += 1
        n = self._exchange
        sending = []
        for r in to:
            stream = self._streams[r]
            stream.seal(_PARTIAL, self._pass, n, x.data)
            if not stream.flush():
                sending.append(stream)
                self._poller.modify(stream.fileno(), select.POLLIN | select.POLLOUT)
        parts: list[np.ndarray | None] = [None] * self.size
        parts[self.rank] = x.copy()
        missing = set()
        for r in want:
            early = self._early.pop((r, self._pass, n), None)
            if early is None:
                missing.add(r)
            else:
                parts[r] = self._as_array(early, x)
        started = time.perf_counter()
        spin_until = started + (_SPIN_S if self._last_wait_s < _SPIN_S else 0.0)
        while missing or sending:
            self._check_abort()
            events = self._poller.poll(0)
            if not events and time.perf_counter() < spin_until:
                os.sched_yield()
                continue
            if not events:
                events = self._poller.poll(_SLICE_MS)
            if not events:
                self._check_links()
                continue
            for fd, event in events:
                stream = self._by_fd.get(fd)
                if stream is None or event & select.POLLNVAL or self._closed:
                    raise GroupLost("this member's group links were closed")
                if event & (select.POLLIN | select.POLLHUP | select.POLLERR):
                    for kind, number_pass, number, payload in stream.receive():
                        if kind != _PARTIAL:
                            continue
                        if stream.peer in missing and (number_pass, number) == (self._pass, n):
                            parts[stream.peer] = self._as_array(payload, x)
                            missing.discard(stream.peer)
                        else:
                            self._keep_early(stream.peer, number_pass, number, payload, stream.peer in missing, n)
                if event & select.POLLOUT and stream.flush():
                    sending.remove(stream)
                    self._poller.modify(fd, select.POLLIN)
        self._last_wait_s = time.perf_counter() - started
        return parts  # type: ignore[return-value]

    def _keep_early(self, rank: int, number_pass: int, number: int, payload, awaited: bool, n: int) -> None:
        """A partial this member did not ask for yet: kept for its exchange — or, from the first member
        while its partial for this exchange is still awaited, proof that it gave this pass up (its stream is
        in order: a later partial before the awaited one means the awaited one will never come)."""
        if number_pass < self._pass:
            return  # a pass given up before this one: nobody waits for it
        if rank == 0 and awaited and (number_pass, number) > (self._pass, n):
            raise GroupLost(f"the first member is in pass {number_pass}, this member in {self._pass}")
        self._early[(rank, number_pass, number)] = payload

    def _open_streams(self) -> None:
        """The streams to every other member, opened at this member's first exchange: it dials the
        members ranked below it and takes the calls of those above (no two wait on each other)."""
        if len(self._streams) == self.size - 1:
            return
        while len(self._hellos) < self.size - 1:
            self._receive(lambda kind, rank, p, n: kind == _HELLO and rank in self._hellos, _SLICE_MS / 1000)
        for r in range(self.rank):
            if r not in self._streams:
                self._add_stream(group_stream.dial(self._stream_address(r), self.rank, self.epoch, r, self._kx,
                                                   self._hellos[r][0], check=self._check_links))
        keys = {r: self._hellos[r][0] for r in range(self.rank + 1, self.size)}
        self._listener.settimeout(_SLICE_MS / 1000)
        while len(self._streams) < self.size - 1:
            self._check_links()
            stream = group_stream.accept(self._listener, self._kx, keys, self.epoch, _STREAM_PREAMBLE_S)
            if stream is not None and stream.peer not in self._streams:
                self._add_stream(stream)
            elif stream is not None:
                stream.close()
        self._listener.close()  # every member's stream is open: nobody else may call
        log.info("group_streams_open", rank=self.rank, size=self.size)

    def _add_stream(self, stream: SealedStream) -> None:
        self._streams[stream.peer] = stream
        self._by_fd[stream.fileno()] = stream
        self._poller.register(stream.fileno(), select.POLLIN)

    def _stream_address(self, rank: int) -> tuple[str, int]:
        peer = self._peers[rank]
        if peer.data_endpoint:
            return _host_port(peer.data_endpoint)
        return _host_port(peer.endpoint)[0], self._hellos[rank][1]

    @staticmethod
    def _as_array(payload, like: np.ndarray) -> np.ndarray:
        """A peer's part shaped as ours: the same rows; its own width (a gather's shares may differ)."""
        return np.frombuffer(payload, dtype=like.dtype).reshape(*like.shape[:-1], -1)

    def _receive(self, wanted, timeout_s: float | None):
        """The next CurveZMQ message ``wanted(kind, rank, pass, number)`` accepts (a command or a stream's
        hello; the partial sums come on the streams); a command not wanted waits in ``_commands``. Raises
        :class:`GroupLost` as soon as a member's link drops or :meth:`abort` is called.

        The inbox is read with a blocking receive (its timeout a short slice): polling every socket for
        every message would cost more than the message. The links' monitors are read between slices."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            self._check_links()
            try:
                ident, head, payload = self._inbox.recv_multipart(copy=False)
            except zmq.Again:
                if deadline is not None and time.monotonic() >= deadline:
                    return None
                continue
            except zmq.ZMQError as exc:
                raise GroupLost(f"the group link failed: {exc}") from exc
            rank, epoch = _IDENTITY.unpack(ident.bytes)
            if epoch != self.epoch:
                continue  # a link of another plan's group (a member still leaving it)
            kind, number_pass, number = _HEADER.unpack(head.bytes)
            if kind == _HELLO:
                self._hellos[rank] = _HELLO_BODY.unpack(payload.bytes)
            if wanted(kind, rank, number_pass, number):
                return kind, rank, payload.buffer
            if kind == _COMMAND:
                self._commands.append(bytes(payload.buffer))

    def _check_abort(self) -> None:
        if self._abort_event is not None and self._abort_event.is_set():
            self.abort("this member left the group (a new plan)")
        if self._lost:
            raise GroupLost(self._lost)

    def _check_links(self) -> None:
        self._check_abort()
        for monitor, rank in self._watch.items():
            if monitor.poll(0):
                event = recv_monitor_message(monitor)
                if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    continue
                self._lost = f"group member {rank} dropped its link ({event['event']!r})"
                log.warning("group_member_lost", rank=rank, why=str(event["event"]))
                raise GroupLost(self._lost)


def _host_port(endpoint: str) -> tuple[str, int]:
    """("host", port) of ``tcp://host:port``, ``host:port`` or ``tcp://[v6]:port`` (``*`` is every address)."""
    rest = endpoint.split("://", 1)[-1]
    host, _, port = rest.rpartition(":")
    host = host.strip("[]")
    return ("0.0.0.0" if host in ("*", "") else host), int(port or 0)
