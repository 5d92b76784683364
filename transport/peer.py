"""The async DEALER client of one ``transport.link.StageServer``.

``Peer`` talks to one server: ``request()`` sends a message and awaits the
reply with the same request id, with any number of requests in flight on one
connection; ``send()`` is one-way (pipeline forwarding: no reply unless
something goes wrong). A server's ``ErrorReply`` is raised as ``RemoteError``.
Its own module because it is the other end of a link: it shares only the
socket setup with the server (``transport.link.link_socket``).

Security: with a ``Keypair`` and the server's public key the link is
encrypted and authenticated with CurveZMQ; a refused key fails requests fast
while the link retries the handshake with backoff.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any, Callable

import zmq
import zmq.asyncio

from transport.auth import watch_handshakes
from transport.errors import AuthenticationRefused, ProtocolError, RemoteError, TransportClosed, TransportError, \
    TransportTimeout
from transport.keys import Keypair
from transport.link import DEFAULT_HWM, link_socket, shared_context
from transport.log import get_logger
from transport.messages import Envelope, ErrorReply, decode, encode
from transport.wire import DEFAULT_LIMITS, Limits

__all__ = ["Peer"]

log = get_logger("transport.peer")


class Peer:
    """Async DEALER client of one ``StageServer``.

    ``request()`` may be called concurrently: each call gets a fresh request
    id and its own future, the receive loop resolves futures by id, and a
    cancelled or timed-out call removes its future (a late reply is then
    dropped). ``activation_dtype`` ("float16"/"bfloat16") sends float32
    activation fields at reduced precision (see ``transport.wire``).

    If the server refuses our key, requests fail fast with
    ``AuthenticationRefused`` while the link retries the handshake with
    backoff (``RETRY_MIN_S`` doubling to ``RETRY_MAX_S``).
    """

    RETRY_MIN_S = 0.25
    RETRY_MAX_S = 30.0

    def __init__(
        self,
        *,
        node_id: str = "",
        context: zmq.asyncio.Context | None = None,
        keypair: Keypair | None = None,
        server_key: bytes | str | None = None,
        limits: Limits = DEFAULT_LIMITS,
        hwm: int = DEFAULT_HWM,
        timeout: float = 10.0,
        activation_dtype: str | None = None,
        on_message: Callable[[Envelope], None] | None = None,
    ) -> None:
        if (keypair is None) != (server_key is None):
            raise TransportError("CURVE needs both our keypair and the server's public key")
        self.node_id = node_id
        self.context = context or shared_context()
        self.keypair = keypair
        self.server_key = server_key.encode() if isinstance(server_key, str) else server_key
        self.limits = limits
        self.hwm = hwm
        self.timeout = timeout
        self.activation_dtype = activation_dtype
        self.on_message = on_message
        self.address: str | None = None
        self._ids = itertools.count(1)
        self._seq = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self._sock: zmq.asyncio.Socket | None = None
        self._recv_task: asyncio.Task | None = None
        self._monitor_task: asyncio.Task | None = None
        self._refused: AuthenticationRefused | None = None
        self._retry_s = self.RETRY_MIN_S
        self._retry_handle: asyncio.TimerHandle | None = None
        self._closed = False

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    @property
    def closed(self) -> bool:
        """Closed by :meth:`close` (a peer never connected is not closed)."""
        return self._closed

    async def connect(self, address: str) -> "Peer":
        if self._sock is not None:
            raise TransportError("peer already connected")
        sock = link_socket(self.context, zmq.DEALER, self.hwm, self.limits)
        try:
            # Queue only to completed connections: a request sent before the
            # handshake waits (and can time out) instead of vanishing into a
            # pipe that a refused handshake will discard.
            sock.setsockopt(zmq.IMMEDIATE, 1)
            if self.keypair is not None:
                sock.curve_secretkey = self.keypair.secret
                sock.curve_publickey = self.keypair.public
                sock.curve_serverkey = self.server_key
            sock.connect(address)
        except BaseException:
            sock.close(linger=0)
            raise
        self._sock = sock
        self.address = address
        self._monitor_task = asyncio.create_task(watch_handshakes(sock, "client", self._on_handshake))
        self._recv_task = asyncio.create_task(self._receive())
        return self

    def _on_handshake(self, event: int, value: int) -> None:
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self._refused = None
            self._retry_s = self.RETRY_MIN_S
        elif event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            if self._refused is None:
                self._refused = AuthenticationRefused(
                    f"{self.address} refused our key (ZAP status {value}): add this node's public "
                    f"key to that home's allow-list"
                )
            self._fail_all(self._refused)
            # libzmq does not reconnect after a refused handshake; we do, with
            # backoff, so a member admitted later gets in without a restart.
            if self._retry_handle is None:
                loop = asyncio.get_running_loop()
                self._retry_handle = loop.call_later(self._retry_s, self._reconnect)
                self._retry_s = min(self._retry_s * 2, self.RETRY_MAX_S)

    def _reconnect(self) -> None:
        self._retry_handle = None
        if self._sock is None or self.address is None:
            return
        try:
            self._sock.disconnect(self.address)
        except zmq.ZMQError:
            pass
        self._sock.connect(self.address)

    def _fail_all(self, exc: BaseException) -> None:
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(exc)

    async def _receive(self) -> None:
        assert self._sock is not None
        sock = self._sock
        while True:
            frames = await sock.recv_multipart(copy=False)
            try:
                env = decode(frames, limits=self.limits)
            except ProtocolError as e:
                fut = self._pending.get(e.call_id)
                if fut is not None and not fut.done():
                    fut.set_exception(e)
                else:
                    log.warning("protocol_error", error=str(e), peer=self.address)
                continue
            except Exception as e:  # a decoder bug must not stop the link
                log.error("decode_failed", error=f"{type(e).__name__}: {e}", peer=self.address, exc_info=True)
                continue
            fut = self._pending.get(env.call_id) if env.call_id else None
            if fut is not None:
                if not fut.done():
                    fut.set_result(env)
            elif isinstance(env.message, ErrorReply):
                m = env.message
                log.warning("remote_error", code=m.code, error=m.message, peer=self.address,
                            call_id=env.call_id or None)
                self._deliver_unsolicited(env)
            elif self.on_message is not None:
                self._deliver_unsolicited(env)
            else:
                log.debug("late_reply_dropped", call_id=env.call_id, peer=self.address)

    def _deliver_unsolicited(self, env: Envelope) -> None:
        if self.on_message is None:
            return
        try:
            self.on_message(env)
        except Exception:  # the callback's bug must not stop the receive loop
            log.error("on_message_failed", peer=self.address, exc_info=True)

    def _check_open(self) -> zmq.asyncio.Socket:
        if self._sock is None:
            raise TransportClosed("peer is not connected")
        if self._refused is not None:
            raise AuthenticationRefused(str(self._refused))
        return self._sock

    async def request(
        self, msg: Any, *, timeout: float | None = None, activation_dtype: str | None = None
    ) -> Any:
        """Send ``msg`` and return the reply message.

        Raises ``TransportTimeout`` if no reply comes within ``timeout``
        seconds (default: the peer's), ``RemoteError`` if the server answered
        with an ``ErrorReply``, ``AuthenticationRefused`` if the server does
        not admit our key.
        """
        sock = self._check_open()
        timeout = self.timeout if timeout is None else timeout
        rid = next(self._ids)
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        try:
            frames = encode(
                msg, call_id=rid, seq=next(self._seq), sender=self.node_id,
                activation_dtype=activation_dtype or self.activation_dtype,
            )
            # The send itself may wait (no completed connection yet, HWM); the
            # reply future may meanwhile fail (key refused, link closed), so
            # wait for whichever settles first.
            sent = sock.send_multipart(frames)
            try:
                async with asyncio.timeout(timeout):
                    if not sent.done():  # usually queued at once; else wait for either
                        await asyncio.wait((sent, fut), return_when=asyncio.FIRST_COMPLETED)
                    if not fut.done():
                        sent.result()
                    env: Envelope = await fut
            except TimeoutError:
                raise TransportTimeout(
                    f"no reply to {type(msg).__name__} from {self.address} within {timeout:g}s"
                ) from None
            finally:
                if not sent.done():
                    sent.cancel()
        finally:
            self._pending.pop(rid, None)
            if fut.done() and not fut.cancelled():
                fut.exception()  # mark retrieved; it was raised above if it mattered
            else:
                fut.cancel()
        if isinstance(env.message, ErrorReply):
            raise RemoteError(env.message.code, env.message.message, peer=env.sender or self.address or "")
        return env.message

    async def send(
        self, msg: Any, *, timeout: float | None = None, activation_dtype: str | None = None
    ) -> None:
        """One-way send (no reply). Waits only while the send queue is full (HWM)."""
        sock = self._check_open()
        frames = encode(
            msg, call_id=0, seq=next(self._seq), sender=self.node_id,
            activation_dtype=activation_dtype or self.activation_dtype,
        )
        timeout = self.timeout if timeout is None else timeout
        try:
            async with asyncio.timeout(timeout):
                await sock.send_multipart(frames)
        except TimeoutError:
            raise TransportTimeout(
                f"could not queue {type(msg).__name__} to {self.address} within {timeout:g}s "
                f"(peer unreachable or its queue is full)"
            ) from None
        except asyncio.CancelledError:
            # Closing the socket cancels its pending sends. That is this link failing,
            # not our caller being cancelled: say so, or the caller would unwind as if
            # its own client had gone away.
            task = asyncio.current_task()
            if self._sock is not sock and (task is None or task.cancelling() == 0):
                raise TransportClosed(
                    f"link to {self.address} closed while sending {type(msg).__name__}") from None
            raise

    async def close(self, linger: float = 0.0) -> None:
        """Close the link; pending requests fail with ``TransportClosed``.

        ``linger`` seconds are granted to deliver already queued one-way sends.
        """
        self._closed = True
        self._fail_all(TransportClosed(f"link to {self.address} closed"))
        if self._retry_handle is not None:
            self._retry_handle.cancel()
            self._retry_handle = None
        tasks = [t for t in (self._recv_task, self._monitor_task) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._recv_task = self._monitor_task = None
        if self._sock is not None:
            self._sock.close(linger=int(linger * 1000))
            self._sock = None

    async def __aenter__(self) -> "Peer":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()
