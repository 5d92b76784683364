"""The home's link to a cloud verifier: requests, timeouts from measured round times, backoff.

Implements ``decoding.offload.loop.Verifier``. The timeout of a verification
is derived from what this link has measured (an EWMA of round times and of
their spread), so a verifier that usually answers in 60 ms is given up on
after a few hundred, not after a fixed ten seconds — the home keeps
generating either way, but a stuck answer costs it the chunk's correction,
not the user's time. After a failure the link stays *unavailable* for a
backoff (doubling, capped) so the home does not pay a timeout per chunk while
the verifier is down; ZeroMQ reconnects underneath, and the first request
after the backoff finds out whether it is back. ``status()`` is what
``meshd status`` prints.
"""

from __future__ import annotations

import asyncio
import dataclasses
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from decoding.exits.previews import Preview
from decoding.offload.loop import VerifierEvicted, VerifierUnavailable, VerifyRequest, VerifyResult
from meshd.log import get_logger
from partition.ids import CloudSession
from transport.cloud_messages import CloudClose, CloudHello, CloudPreview, CloudVerdict, CloudVerify
from transport.errors import RemoteError, TransportError
from transport.messages import encode

log = get_logger("meshd.cloud.link")

FIRST_TIMEOUT_S = 30.0  # before anything was measured, and for a session's first (prompt-carrying) request
MIN_TIMEOUT_S = 1.0  # never give up on a verdict sooner: load spikes on either side are normal
PER_TOKEN_S = 0.002  # allowance per uncached token beyond a round's usual size
BACKOFF_MIN_S = 0.5
BACKOFF_MAX_S = 30.0
HELLO_TIMEOUT_S = 10.0


def to_message(req: VerifyRequest) -> CloudVerify:
    q = None
    if req.q is not None:
        q = [b"".join(struct.pack("<If", int(i), float(p)) for i, p in zip(ids, probs)) for ids, probs in req.q]
    return CloudVerify(req.session, req.start, struct.pack(f"<{len(req.tokens)}I", *req.tokens), req.drafts,
                       q, req.open, max(1, min(100, round(req.previews * 100))) if req.previews > 0 else 0)


def request_end(req: VerifyRequest) -> int:
    """Where a request's tokens end: its previews carry it (``CloudPreview.at``)."""
    return req.start + len(req.tokens)


@dataclass
class LinkStats:
    rounds: int = 0
    timeouts: int = 0
    refused: int = 0
    evicted: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    last_error: str = ""
    last_error_at: float = 0.0
    connected_since: float = 0.0
    rtt_s: float = 0.0  # EWMA of a verification's round time
    rtt_dev_s: float = 0.0
    previews: int = 0  # early verdicts received
    up_sizes: list = field(default_factory=list)  # per round, the last 256 (reporting)
    down_sizes: list = field(default_factory=list)


class CloudLink:
    """``peer``: a connected ``transport.peer.Peer`` whose unsolicited messages (previews) this link reads:
    its ``on_message`` is set here if unset."""

    def __init__(self, peer, address: str = "", *, first_timeout_s: float = FIRST_TIMEOUT_S,
                 min_timeout_s: float = MIN_TIMEOUT_S):
        self.peer = peer
        self.address = address
        self.first_timeout_s = first_timeout_s
        self.min_timeout_s = min_timeout_s
        self.stats = LinkStats()
        self._retry_at = 0.0
        self._backoff = BACKOFF_MIN_S
        self.previews_at: list[int] | None = None  # the verifier's preview exits; None: not asked yet
        self._hello: asyncio.Task | None = None
        self._watching: dict[tuple[int, int], Callable[[Preview], None]] = {}
        if getattr(peer, "on_message", False) is None:
            peer.on_message = self.receive

    @property
    def available(self) -> bool:
        return time.monotonic() >= self._retry_at

    def offers_previews(self) -> bool:
        """Whether the verifier said it previews its verdicts; the first call asks it (in the background)."""
        if self.previews_at is None and self._hello is None:
            self._hello = asyncio.ensure_future(self.hello())
        return bool(self.previews_at)

    async def hello(self, timeout_s: float = HELLO_TIMEOUT_S) -> list[int]:
        """Ask the verifier what it offers; a verifier that predates the question offers no previews.
        An unreachable one is asked again later."""
        try:
            reply = await self.peer.request(CloudHello(), timeout=timeout_s)
            self.previews_at = list(reply.previews_at) if isinstance(reply, CloudHello) else []
        except RemoteError:
            self.previews_at = []
        except (TransportError, OSError):
            pass
        finally:
            self._hello = None
        if self.previews_at is not None:
            log.info("cloud_verifier_hello", address=self.address, previews_at=self.previews_at or None)
        return self.previews_at or []

    def receive(self, env) -> None:
        """An unsolicited message from the verifier: a preview goes to the request it is about, if still
        waiting (a late one is dropped)."""
        msg = env.message
        if isinstance(msg, CloudPreview):
            self.stats.previews += 1
            watch = self._watching.get((int(msg.session), msg.at))
            if watch is not None:
                watch(Preview(msg.layer, msg.accepted, msg.token, msg.confidence))

    def timeout_for(self, req: VerifyRequest) -> float:
        s = self.stats
        if s.rounds == 0 or req.open is not None:
            return self.first_timeout_s
        return max(self.min_timeout_s, 4.0 * s.rtt_s + 8.0 * s.rtt_dev_s + PER_TOKEN_S * len(req.tokens))

    async def verify(self, req: VerifyRequest, timeout_s: float | None = None,
                     on_preview: Callable[[Preview], None] | None = None) -> VerifyResult:
        if req.previews and not self.previews_at:  # only a verifier that offered them is asked for previews
            req = dataclasses.replace(req, previews=0.0)
        msg = to_message(req)
        timeout = timeout_s if timeout_s is not None else self.timeout_for(req)
        t0 = time.monotonic()
        key = (int(req.session), request_end(req))
        if req.previews and on_preview is not None:
            self._watching[key] = on_preview
        try:
            reply = await self.peer.request(msg, timeout=timeout)
        except RemoteError as exc:
            if exc.code == "evicted":
                self.stats.evicted += 1
                raise VerifierEvicted(str(exc)) from None
            self.stats.refused += 1
            self._failed(f"verifier refused ({exc.code}): {exc}", short=exc.code in ("busy", "superseded"))
            raise VerifierUnavailable(str(exc)) from None
        except (TransportError, OSError) as exc:
            self.stats.timeouts += 1
            self._failed(str(exc) or type(exc).__name__)
            raise VerifierUnavailable(str(exc)) from None
        finally:
            self._watching.pop(key, None)
        if not isinstance(reply, CloudVerdict) or reply.session != req.session:
            self._failed(f"unexpected reply {type(reply).__name__}")
            raise VerifierUnavailable("the verifier answered something else")
        self._observe(time.monotonic() - t0, msg, reply, req)
        return VerifyResult(reply.accepted, reply.token, reply.draws)

    async def close_session(self, session: CloudSession) -> None:
        try:
            await self.peer.send(CloudClose(session), timeout=1.0)
        except (TransportError, OSError):
            pass

    def _observe(self, dt: float, msg: CloudVerify, reply: CloudVerdict, req: VerifyRequest) -> None:
        s = self.stats
        up = sum(len(f) for f in encode(msg, call_id=1, seq=1))
        down = sum(len(f) for f in encode(reply, call_id=1, seq=1))
        s.bytes_up += up
        s.bytes_down += down
        if req.open is None:  # a session's first request carries its prompt: not a usual round
            s.up_sizes = (s.up_sizes + [up])[-256:]
            s.down_sizes = (s.down_sizes + [down])[-256:]
        if req.open is None:  # a session's first request carries the prompt: not a usual round
            if s.rounds == 0 or s.rtt_s == 0.0:
                s.rtt_s, s.rtt_dev_s = dt, dt / 2
            else:
                s.rtt_dev_s += 0.25 * (abs(dt - s.rtt_s) - s.rtt_dev_s)
                s.rtt_s += 0.125 * (dt - s.rtt_s)
        s.rounds += 1
        if not s.connected_since:
            s.connected_since = time.time()
            log.info("cloud_verifier_reachable", address=self.address, rtt_ms=round(dt * 1000, 1))
        self._backoff = BACKOFF_MIN_S

    def _failed(self, why: str, short: bool = False) -> None:
        s = self.stats
        s.last_error, s.last_error_at = why, time.time()
        if s.connected_since and not short:
            log.warning("cloud_verifier_unreachable", address=self.address, error=why)
            s.connected_since = 0.0
        self._retry_at = time.monotonic() + (BACKOFF_MIN_S if short else self._backoff)
        if not short:
            self._backoff = min(self._backoff * 2, BACKOFF_MAX_S)

    def status(self) -> dict:
        s = self.stats
        state = "connected" if s.connected_since and self.available else (
            "backing off" if not self.available else ("unreachable" if s.last_error else "idle"))
        mean = lambda xs: round(sum(xs) / len(xs), 1) if xs else 0.0  # noqa: E731
        return {"address": self.address, "state": state, "rounds": s.rounds, "timeouts": s.timeouts,
                "refused": s.refused, "evicted": s.evicted, "rtt_ms": round(s.rtt_s * 1000, 1),
                "previews_at": self.previews_at, "previews": s.previews,
                "bytes_up": s.bytes_up, "bytes_down": s.bytes_down,
                "uplink_bytes_per_round": mean(s.up_sizes), "downlink_bytes_per_round": mean(s.down_sizes),
                "last_error": s.last_error, "retry_in_s": round(max(0.0, self._retry_at - time.monotonic()), 1)}
