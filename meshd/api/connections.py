"""Connections: a cap on how many are open, and aiohttp's own errors answered as JSON.

aiohttp has neither a connection cap nor a way to choose the class that answers
requests it cannot parse. :class:`ConnectionGate` is the protocol factory of
every listener and does both; :class:`GatedSite` is a listener that uses it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import ssl

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from meshd.api.common import log
from meshd.api.errors import internal_error, json_error, log_rejected, malformed
from meshd.api.validation import RequestError

# After an error that leaves a body unread, how long aiohttp keeps reading
# (and dropping) it before closing; also how long a refused connection lingers.
LINGER_S = 2.0


class _ApiRequestHandler(RequestHandler):
    """aiohttp's per-connection protocol, answering its own errors as OpenAI JSON.

    Requests aiohttp cannot parse (bad request line or method, oversized
    headers) never reach the middleware: aiohttp answers them from
    ``handle_error``, as text/plain. aiohttp has no option to choose the
    handler class, so :class:`ConnectionGate` re-classes each handler the
    Server makes into a subclass of this one: no new slots, only methods.
    """

    __slots__ = ()
    gate: ConnectionGate  # set on the per-gate subclass

    def handle_error(self, request, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if request.writer.output_size > 0:  # as aiohttp: too late for another response
            raise ConnectionError("response already started; cannot send the error")
        path = _safe_path(request)
        if status >= 500:
            log.error("api_internal_error", path=path, exc_info=exc)
            err = internal_error()
        else:
            err = malformed(status, message)
            log_rejected(err, path)
        resp = json_error(err)
        resp.force_close()
        return resp

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._manager is not None:  # aiohttp ignores repeated calls; count once too
            self.gate.release()
        super().connection_lost(exc)


def _safe_path(request) -> str | None:
    with contextlib.suppress(Exception):
        return request.path
    return None


class ConnectionGate:
    """The protocol factory of every listener: at most ``limit`` open connections.

    aiohttp has no connection cap. Past it, a new connection gets one 503
    (with ``Retry-After``) and is closed, so a flood costs a socket for a
    moment instead of file descriptors and memory for as long as it lasts.
    Counting here, not in aiohttp's connection table, also covers a burst
    accepted in one go, before any of it is registered there.
    """

    def __init__(self, server: web.Server, limit: int):
        self.server = server
        self.limit = limit
        self.open = 0
        self.handler_class = type("GatedRequestHandler", (_ApiRequestHandler,),
                                  {"__slots__": (), "gate": self})

    def __call__(self) -> asyncio.Protocol:
        if self.open >= self.limit:
            return _Refusal(self.open, self.limit)
        handler = self.server()
        handler.__class__ = self.handler_class
        self.open += 1
        return handler

    def release(self) -> None:
        self.open -= 1


class _Refusal(asyncio.Protocol):
    """Answers one connection over the cap with a 503 JSON error and closes it.

    The answer waits for the request's first bytes (or ``LINGER_S``), and the
    rest is read and dropped until the client closes: closing on unread data
    resets the connection, which can destroy the answer before it is read.
    """

    def __init__(self, open_now: int, limit: int):
        self.open_now = open_now
        self.err = RequestError(
            f"the API has {limit} connections open, its limit; retry shortly",
            status=503, type="service_unavailable", code="too_many_connections", retry_after_s=1.0)
        self.transport: asyncio.Transport | None = None
        self.answered = False
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.timer = asyncio.get_running_loop().call_later(LINGER_S, self._close)
        log_rejected(self.err, None, open_connections=self.open_now)

    def data_received(self, data: bytes) -> None:
        self._answer()

    def eof_received(self) -> bool:
        self._close()
        return False

    def connection_lost(self, exc: BaseException | None) -> None:
        if self.timer is not None:
            self.timer.cancel()

    def _answer(self) -> None:
        if self.answered or self.transport is None or self.transport.is_closing():
            return
        self.answered = True
        body = json.dumps(self.err.body()).encode()
        head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json; "
                f"charset=utf-8\r\nContent-Length: {len(body)}\r\nRetry-After: 1\r\n"
                f"Connection: close\r\n\r\n")
        self.transport.write(head.encode() + body)

    def _close(self) -> None:
        self._answer()
        if self.transport is not None:
            self.transport.close()


class GatedSite(web.SockSite):
    """A listener on our own bound socket whose connections pass the gate."""

    def __init__(self, runner: web.AppRunner, sock: socket.socket, gate: ConnectionGate,
                 backlog: int, ssl_context: ssl.SSLContext | None = None):
        super().__init__(runner, sock, backlog=backlog, ssl_context=ssl_context)
        self._gate = gate

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site, so runner.cleanup() stops it
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._gate, sock=self._sock,
                                                backlog=self._backlog, ssl=self._ssl_context)
