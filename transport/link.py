"""Links between nodes: the async ROUTER server, and what it shares with its client.

``StageServer`` (ROUTER) receives messages from any number of peers, hands
each to an async handler — or queues it for its owner — and sends back the
reply, tagged with the request's id. Its client, ``transport.peer.Peer``
(DEALER), talks to one server. The server only receives, queues and sends: what
a pipeline stage does with its queue (batching several sequences into one
forward) is the stage's (``meshd.pipeline.stage``).

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
from transport.errors import ProtocolError, TransportError
from transport.keys import Keypair
from transport.log import get_logger
from transport.messages import Ack, Envelope, ErrorReply, decode, encode
from transport.wire import DEFAULT_LIMITS, Limits

__all__ = ["StageServer", "Endpoint", "Request", "Handler", "Lane", "link_socket", "shared_context"]

log = get_logger("transport.link")

DEFAULT_HWM = 1000


def shared_context() -> zmq.asyncio.Context:
    """The process-wide context used when none is given (one I/O thread total)."""
    return zmq.asyncio.Context.instance()


def link_socket(context: zmq.asyncio.Context, kind: int, hwm: int, limits: Limits) -> zmq.asyncio.Socket:
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
#: Takes the ordered messages from ``server.inbox`` and answers them (``server.answer``), forever.
Lane = Callable[["StageServer"], Awaitable[None]]


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
    their order behind them in :attr:`inbox`. A pipeline stage uses it for frees,
    so a request whose client hung up stops costing compute at once instead of
    after every chunk queued before its free. Up to ``max_queued`` ordered
    messages wait in memory; beyond that reading pauses and ZeroMQ's high-water
    mark pushes back.

    ``lane(server)`` (with ``urgent``): who takes the ordered messages from the
    inbox, running from start to close — by default one at a time, in arrival
    order, through ``handler``. A pipeline stage passes its own loop, which takes
    what queued and runs several sequences' work in one forward, answering every
    message with :meth:`answer`.
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
        lane: Lane | None = None,
    ) -> None:
        self.handler = handler
        self.node_id = node_id
        self.context = context or shared_context()
        self.keypair = keypair
        self.limits = limits
        self.hwm = hwm
        self.ordered = ordered
        self.urgent = urgent
        self.lane = lane
        #: The ordered messages (``Request``s) waiting for the lane, in arrival order (ordered servers with urgent).
        self.inbox: asyncio.Queue | None = asyncio.Queue(max_queued) if ordered and urgent else None
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
        sock = link_socket(self.context, zmq.ROUTER, self.hwm, self.limits)
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
        if self.inbox is not None:
            self._worker_task = asyncio.create_task(self.lane(self) if self.lane is not None else self._one_by_one())
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
            if self.inbox is not None:
                if self.urgent(env.message):
                    await self._handle(req)  # quick by contract: the handler must not block
                else:
                    await self.inbox.put(req)
            elif self.ordered:
                await self._handle(req)
            else:
                await self._sem.acquire()
                task = asyncio.create_task(self._handle(req, release=True))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _one_by_one(self) -> None:
        """The default lane: one ordered message at a time, in arrival order."""
        assert self.inbox is not None
        while True:
            await self._handle(await self.inbox.get())

    def queued(self) -> list[Any]:
        """The ordered messages waiting in :attr:`inbox` now, oldest first (a snapshot; ``[]`` without one)."""
        # asyncio.Queue has no public peek; its deque is read, never changed, here and only here.
        return [r.message for r in list(self.inbox._queue)] if self.inbox is not None else []

    async def answer(self, reqs: list[Request], step: Callable[[list[Any]], Awaitable[list[Any]]]) -> None:
        """Answer ``reqs`` with ``step(their messages)``, one reply each (None: ``Ack``); if the step fails,
        each gets the error reply. One-way messages are answered only with errors."""
        try:
            replies = await step([r.message for r in reqs])
            if len(replies) != len(reqs):
                raise TransportError(f"the step answered {len(replies)} of {len(reqs)} messages")
        except asyncio.CancelledError:
            raise
        except Exception as e:
            replies = [self._handler_failed(r, e) for r in reqs]
        for r, reply in zip(reqs, replies):
            await self._reply(r, reply)

    async def push(self, identity: bytes, msg: Any) -> None:
        """Send ``msg`` one-way to the client on connection ``identity`` (a ``Request.identity``): something
        the client did not ask for by id, such as an early word on a request still being answered. Its
        ``Peer`` hands it to ``on_message``; a client gone meanwhile loses it (and it is logged)."""
        await self._send(identity, msg, 0)

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
