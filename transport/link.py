"""Links between nodes: an async ROUTER server and an async DEALER client.

``StageServer`` (ROUTER) receives messages from any number of peers, hands
each to an async handler and sends back what the handler returns, tagged with
the request's id. ``Peer`` (DEALER) talks to one server: ``request()`` sends a
message and awaits the reply with the same request id, with any number of
requests in flight on one connection; ``send()`` is one-way (pipeline
forwarding: no reply unless something goes wrong).

Frames go out with ``send_multipart(frames)`` (copy=True): pyzmq copies the
small ``bytes`` header and routing id, which is cheaper than zero-copy
bookkeeping, while the tensor ``zmq.Frame``s built by ``transport.wire`` are
sent by reference whatever the flag.

Everything runs on the event loop through ``zmq.asyncio``; ZeroMQ's single I/O
thread per context does the socket work, so there is no thread per
connection. Messages are decoded by ``transport.messages.decode``, which turns
any malformed input into a ``ProtocolError``; the server answers those with an
``ErrorReply`` and keeps serving, and the client raises ``ErrorReply`` as
``RemoteError``.

Security: pass a ``Keypair`` to encrypt and authenticate with CurveZMQ. A
CURVE server refuses to start unless a ``CurveAuthenticator`` runs on its
context, because libzmq admits any key when no ZAP handler is bound.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import zmq
import zmq.asyncio

from transport.auth import ZAP_DOMAIN, authenticator_for, watch_handshakes
from transport.errors import (
    AuthenticationRefused,
    ProtocolError,
    RemoteError,
    TransportClosed,
    TransportError,
    TransportTimeout,
)
from transport.keys import Keypair
from transport.log import get_logger
from transport.messages import Ack, Envelope, ErrorReply, decode, encode
from transport.wire import DEFAULT_LIMITS, Limits

__all__ = ["StageServer", "Endpoint", "Peer", "Request", "Handler", "shared_context"]

log = get_logger("transport.link")

DEFAULT_HWM = 1000


def shared_context() -> zmq.asyncio.Context:
    """The process-wide context used when none is given (one I/O thread total)."""
    return zmq.asyncio.Context.instance()


def _link_socket(context: zmq.asyncio.Context, kind: int, hwm: int, limits: Limits) -> zmq.asyncio.Socket:
    """A socket with what every link shares: no linger, bounded queues, the message size cap."""
    sock = context.socket(kind)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, hwm)
        sock.setsockopt(zmq.RCVHWM, hwm)
        sock.setsockopt(zmq.MAXMSGSIZE, limits.max_total_bytes)
    except BaseException:
        sock.close(linger=0)
        raise
    return sock


@dataclass
class Request:
    """What a handler learns about an incoming message besides the message."""

    envelope: Envelope
    identity: bytes  # ROUTER routing id of the connection it came on
    peer_key: str  # the sender's CURVE public key (z85) as vouched by ZAP; "" without CURVE

    @property
    def message(self) -> Any:
        return self.envelope.message

    @property
    def sender(self) -> str:
        return self.envelope.sender

    @property
    def one_way(self) -> bool:
        return self.envelope.call_id == 0


Handler = Callable[[Any, Request], Awaitable[Any]]


def _error_code(exc: BaseException) -> str:
    return getattr(exc, "code", None) or "handler"


class StageServer:
    """Async ROUTER endpoint dispatching decoded messages to ``handler``.

    ``handler(message, request)`` returns the reply message (``None`` means
    ``Ack()``); replies to one-way messages are dropped, except error replies,
    which are always sent so a forwarding stage learns its chunks fail.
    Messages are handled concurrently (at most ``max_inflight`` at once) in
    arrival order of start; with ``ordered=True`` strictly one after another.

    ``urgent(message) -> bool`` (ordered servers only): such messages skip the
    queue and are handled as soon as they arrive, while the ordered ones keep
    their order behind them. A pipeline stage uses it for frees, so a request
    whose client hung up stops costing compute at once instead of after every
    chunk queued before its free. Up to ``max_queued`` ordered messages wait in
    memory; beyond that reading pauses and ZeroMQ's high-water mark pushes back.

    ``batch_handler(messages, requests) -> replies`` (ordered servers with an
    ``urgent`` lane): the ordered lane hands over everything already queued
    (up to ``max_batch`` messages) in one call, so a stage can run several
    sequences' work in one forward. The handler keeps the order that matters
    (per sequence) itself and returns one reply per message.
    ``batch_linger(requests) -> seconds``: how long to wait for more before
    handing a batch over (0: not at all), asked again after each arrival.
    """

    def __init__(
        self,
        handler: Handler,
        *,
        node_id: str = "",
        context: zmq.asyncio.Context | None = None,
        keypair: Keypair | None = None,
        limits: Limits = DEFAULT_LIMITS,
        hwm: int = DEFAULT_HWM,
        max_inflight: int = 256,
        ordered: bool = False,
        urgent: Callable[[Any], bool] | None = None,
        max_queued: int = 1024,
        batch_handler: Callable[[list[Any], list["Request"]], Awaitable[list[Any]]] | None = None,
        max_batch: int = 64,
        batch_linger: Callable[[list["Request"]], float] | None = None,
    ) -> None:
        self.handler = handler
        self.node_id = node_id
        self.context = context or shared_context()
        self.keypair = keypair
        self.limits = limits
        self.hwm = hwm
        self.ordered = ordered
        self.urgent = urgent
        self.batch_handler = batch_handler
        self.max_batch = max(1, int(max_batch))
        self.batch_linger = batch_linger
        self._queue: asyncio.Queue | None = asyncio.Queue(max_queued) if ordered and urgent else None
        self._worker_task: asyncio.Task | None = None
        self.address: str | None = None
        self.stats = {"received": 0, "replied": 0, "protocol_errors": 0, "handler_errors": 0}
        self._sem = asyncio.Semaphore(max_inflight)
        self._seq = itertools.count(1)
        self._sock: zmq.asyncio.Socket | None = None
        self._tasks: set[asyncio.Task] = set()
        self._loop_task: asyncio.Task | None = None
        self._monitor_task: asyncio.Task | None = None

    @property
    def curve(self) -> bool:
        return self.keypair is not None

    async def start(self, address: str = "tcp://127.0.0.1:0") -> str:
        """Bind and start serving; returns the bound endpoint (port 0 -> real port)."""
        if self._sock is not None:
            raise TransportError("server already started")
        sock = _link_socket(self.context, zmq.ROUTER, self.hwm, self.limits)
        try:
            # Report unroutable replies (peer gone) instead of dropping silently.
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            if self.keypair is not None:
                if authenticator_for(self.context) is None:
                    raise TransportError(
                        "a CURVE server needs a CurveAuthenticator running on its context "
                        "(without a ZAP handler libzmq would admit any key)"
                    )
                sock.curve_secretkey = self.keypair.secret
                sock.curve_publickey = self.keypair.public
                sock.curve_server = True
                sock.zap_domain = ZAP_DOMAIN.encode()
                sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
            sock.bind(address)
        except BaseException:
            sock.close(linger=0)
            raise
        self._sock = sock
        self.address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._monitor_task = asyncio.create_task(watch_handshakes(sock, "server"))
        self._loop_task = asyncio.create_task(self._serve())
        if self._queue is not None:
            self._worker_task = asyncio.create_task(self._work())
        log.info("server_listening", address=self.address, curve=self.curve, node_id=self.node_id)
        return self.address

    async def _serve(self) -> None:
        assert self._sock is not None
        sock = self._sock
        while True:
            frames = await sock.recv_multipart(copy=False)
            identity, body = frames[0].bytes, frames[1:]
            self.stats["received"] += 1
            try:
                env = decode(body, limits=self.limits)
            except ProtocolError as e:
                self.stats["protocol_errors"] += 1
                log.warning("protocol_error", error=str(e), call_id=e.call_id, peer=identity.hex())
                await self._send(identity, ErrorReply("protocol", str(e)), e.call_id)
                continue
            except Exception as e:  # a decoder bug must not stop the stage
                self.stats["protocol_errors"] += 1
                log.error("decode_failed", error=f"{type(e).__name__}: {e}", peer=identity.hex(), exc_info=True)
                await self._send(identity, ErrorReply("protocol", f"undecodable message: {type(e).__name__}"), 0)
                continue
            peer_key = ""
            if self.curve and body:
                try:
                    peer_key = body[0].get("User-Id")
                except (zmq.ZMQError, AttributeError):
                    peer_key = ""
            req = Request(env, identity, peer_key)
            if self._queue is not None:
                if self.urgent(env.message):
                    await self._handle(req)  # quick by contract: the handler must not block
                else:
                    await self._queue.put(req)
            elif self.ordered:
                await self._handle(req)
            else:
                await self._sem.acquire()
                task = asyncio.create_task(self._handle(req, release=True))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _work(self) -> None:
        """The ordered lane: one message at a time, in arrival order."""
        assert self._queue is not None
        while True:
            req = await self._queue.get()
            if self.batch_handler is None:
                await self._handle(req)
                continue
            reqs = [req]
            while len(reqs) < self.max_batch and not self._queue.empty():
                reqs.append(self._queue.get_nowait())
            linger = self.batch_linger(reqs) if self.batch_linger is not None else 0.0
            if linger > 0:  # the handler expects more work any moment: let it join this batch
                deadline = asyncio.get_running_loop().time() + linger
                while len(reqs) < self.max_batch:
                    left = deadline - asyncio.get_running_loop().time()
                    if left <= 0:
                        break
                    try:
                        async with asyncio.timeout(left):
                            reqs.append(await self._queue.get())
                    except TimeoutError:
                        break
                    if self.batch_linger(reqs) <= 0:
                        break
            await self._handle_batch(reqs)

    async def _handle_batch(self, reqs: list[Request]) -> None:
        try:
            replies = await self.batch_handler([r.message for r in reqs], reqs)
            if len(replies) != len(reqs):
                raise TransportError(f"batch handler answered {len(replies)} of {len(reqs)} messages")
        except asyncio.CancelledError:
            raise
        except Exception as e:
            replies = [self._handler_failed(r, e) for r in reqs]
        for r, reply in zip(reqs, replies):
            await self._reply(r, reply)

    def _handler_failed(self, req: Request, e: Exception) -> ErrorReply:
        self.stats["handler_errors"] += 1
        log.warning(
            "handler_error",
            message_type=type(req.message).__name__,
            error=f"{type(e).__name__}: {e}",
            exc_info=not isinstance(e, TransportError),
        )
        gen_id = getattr(req.message, "request_id", "")  # the generation it belonged to, if any
        return ErrorReply(_error_code(e), f"{type(e).__name__}: {e}", gen_id if isinstance(gen_id, str) else "")

    async def _reply(self, req: Request, reply: Any) -> None:
        if req.one_way and not isinstance(reply, ErrorReply):
            return
        await self._send(req.identity, reply if reply is not None else Ack(), req.envelope.call_id)

    async def _handle(self, req: Request, release: bool = False) -> None:
        try:
            try:
                reply = await self.handler(req.message, req)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                reply = self._handler_failed(req, e)
            await self._reply(req, reply)
        finally:
            if release:
                self._sem.release()

    async def _send(self, identity: bytes, reply: Any, call_id: int) -> None:
        if self._sock is None:
            return
        try:
            frames = encode(reply, call_id=call_id, seq=next(self._seq), sender=self.node_id)
        except ProtocolError as e:
            log.warning("reply_unencodable", error=str(e))
            frames = encode(ErrorReply("handler", f"reply could not be encoded: {e}"),
                            call_id=call_id, seq=next(self._seq), sender=self.node_id)
        try:
            await self._sock.send_multipart([identity, *frames])
            self.stats["replied"] += 1
        except zmq.ZMQError as e:
            # EHOSTUNREACH: the peer disconnected before its reply was ready.
            log.info("reply_dropped", reason=e.strerror, peer=identity.hex(), call_id=call_id)

    async def close(self) -> None:
        """Stop receiving, cancel running handlers, close the socket."""
        tasks = [t for t in (self._loop_task, self._worker_task, self._monitor_task, *self._tasks)
                 if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
        self._loop_task = self._monitor_task = self._worker_task = None
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    async def __aenter__(self) -> "StageServer":
        if self._sock is None:
            await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()


Endpoint = StageServer  # the same thing, named for coordinator-side uses


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
        sock = _link_socket(self.context, zmq.DEALER, self.hwm, self.limits)
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
