"""CurveZMQ admission: a ZAP handler that admits only allow-listed public keys.

ZeroMQ asks a context's ZAP handler (RFC 27) to approve every CURVE handshake
a server socket of that context receives. We run pyzmq's
``AsyncioAuthenticator`` on the daemon's event loop (no extra thread) with a
callback that looks the client key up in the home's ``AllowList`` at handshake
time, so adding a member takes effect immediately, without restarting
sockets.

Refusals are logged here (unknown key) and by ``watch_handshakes`` (peers that
fail the handshake before ZAP is asked, e.g. a plaintext client talking to a
CURVE server). Both are rate-limited per peer, because a refused DEALER keeps
reconnecting every 100 ms.
"""

from __future__ import annotations

import logging
import time
import weakref
from typing import Callable

import zmq
import zmq.asyncio
from zmq.auth.asyncio import AsyncioAuthenticator
from zmq.utils.monitor import parse_monitor_message

from transport.errors import KeyStoreError, TransportError
from transport.keys import AllowList, fingerprint
from transport.log import get_logger

__all__ = ["CurveAuthenticator", "authenticator_for", "watch_handshakes", "ZAP_DOMAIN"]

log = get_logger("transport.auth")

ZAP_DOMAIN = "meshd"
_LOG_EVERY_S = 30.0

# context -> running authenticator: a CURVE server refuses to start without one,
# because libzmq admits every key when no ZAP handler is bound.
_RUNNING: "weakref.WeakKeyDictionary[zmq.Context, CurveAuthenticator]" = weakref.WeakKeyDictionary()


def authenticator_for(context: zmq.Context) -> "CurveAuthenticator | None":
    return _RUNNING.get(context)


class _RateLimit:
    def __init__(self, every_s: float = _LOG_EVERY_S) -> None:
        self.every_s = every_s
        self._last: dict[object, tuple[float, int]] = {}

    def hit(self, key: object) -> int:
        """Return how many hits to report now (0 = stay quiet)."""
        now = time.monotonic()
        last, suppressed = self._last.get(key, (-1e18, 0))
        if now - last >= self.every_s:
            self._last[key] = (now, 0)
            return suppressed + 1
        self._last[key] = (last, suppressed + 1)
        return 0


class CurveAuthenticator:
    """The ZAP handler of one ZeroMQ context, backed by an allow-list.

    ``allowed`` is an ``AllowList`` or any predicate on a z85 public key.
    Start it before binding CURVE server sockets on ``context`` and stop it
    after closing them.
    """

    def __init__(
        self,
        context: zmq.asyncio.Context,
        allowed: AllowList | Callable[[bytes], bool],
    ) -> None:
        self.context = context
        self.allowed = allowed
        self.admitted = 0
        self.refused = 0
        self._limit = _RateLimit()
        self._auth: AsyncioAuthenticator | None = None

    def start(self) -> "CurveAuthenticator":
        if self._auth is not None:
            return self
        if self.context in _RUNNING:
            raise TransportError("this ZeroMQ context already has a ZAP authenticator")
        # pyzmq's own debug chatter goes to the stdlib 'zmq.auth' logger; our
        # decisions are logged by callback() in the daemon's structured format.
        self._auth = AsyncioAuthenticator(self.context, log=logging.getLogger("zmq.auth"))
        self._auth.start()
        self._auth.configure_curve_callback(domain=ZAP_DOMAIN, credentials_provider=self)
        _RUNNING[self.context] = self
        return self

    def stop(self) -> None:
        if self._auth is None:
            return
        _RUNNING.pop(self.context, None)
        self._auth.stop()
        self._auth = None

    @property
    def running(self) -> bool:
        return self._auth is not None

    def _is_allowed(self, key: bytes) -> bool:
        try:
            if isinstance(self.allowed, AllowList):
                return key in self.allowed
            return bool(self.allowed(key))
        except KeyStoreError as e:
            # A broken allow-list must fail closed, loudly.
            log.error("allowlist_unreadable", error=str(e))
            return False

    def callback(self, domain: str, key: bytes) -> bool:
        """Called by pyzmq for every CURVE handshake; ``key`` is z85."""
        if self._is_allowed(key):
            self.admitted += 1
            log.debug("peer_admitted", fingerprint=fingerprint(key), domain=domain)
            return True
        self.refused += 1
        n = self._limit.hit(key)
        if n:
            log.warning(
                "peer_refused",
                reason="public key not in this home's allow-list",
                fingerprint=fingerprint(key),
                public_key=key.decode("ascii", "replace"),
                attempts=n,
            )
        return False


_HANDSHAKE_EVENTS = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_SUCCEEDED
)


async def watch_handshakes(
    sock: zmq.asyncio.Socket,
    role: str,
    on_event: Callable[[int, int], None] | None = None,
) -> None:
    """Log failed handshakes on ``sock`` until cancelled.

    Covers what ZAP never sees: a plaintext (NULL) peer meeting a CURVE socket
    fails the ZMTP mechanism check first. ``on_event(event, value)`` lets a
    client react, e.g. fail pending requests when the server refused its key.
    """
    mon = sock.get_monitor_socket(_HANDSHAKE_EVENTS)
    limit = _RateLimit()
    try:
        while True:
            evt = parse_monitor_message(await mon.recv_multipart())
            event, value = int(evt["event"]), int(evt["value"])
            endpoint = evt["endpoint"].decode("utf-8", "replace")
            if on_event is not None:
                on_event(event, value)
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                continue
            n = limit.hit((event, endpoint))
            if not n:
                continue
            if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                reason = f"authentication refused (ZAP status {value})"
            elif event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
                reason = "protocol error (e.g. plaintext peer on an encrypted link, or wrong server key)"
            else:
                reason = "handshake failed (peer closed or wrong keys)"
            log.warning("handshake_failed", role=role, endpoint=endpoint, reason=reason, code=value, attempts=n)
    finally:
        try:
            sock.disable_monitor()
        except zmq.ZMQError:
            pass
        mon.close(linger=0)
