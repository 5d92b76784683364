"""What the sharing role needs from the rest of the daemon, named: values and a few callbacks.

The sharing role is built from a :class:`ShareDeps`, never from the daemon, so
everything it may touch is listed here: which node it is, its settings, where
the cache lives, the CURVE node it serves and connects with, how a control
message reaches the members, who is active, and the three things it tells the
daemon (the model is being fetched, who holds what changed, a waiting plan can
go ahead). A test builds one from plain functions.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from meshd.errors import MeshdError
from meshd.share.throttle import parse_rate
from partition.ids import NodeId

MODES = ("layers", "whole", "off")
ACTIVE_STATES = ("ready", "suspect")  # a suspect member may only have missed a heartbeat: still asked


class ShareError(MeshdError):
    """A share request refused, or sharing misconfigured (``code`` travels in the error reply)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class ShareSettings:
    """The daemon's configuration, as far as sharing reads it."""

    mode: str = "layers"  # no local model: fetch "layers" (this device's range) or the "whole" file; "off"
    rate_bps: float | None = None  # per direction; None: no cap
    listen: str = "127.0.0.1"  # interface the share endpoint binds
    advert_interval_s: float = 1.0  # the heartbeat interval: adverts go out as often
    model: str | None = None  # the configured model ("" or None: the default one, else from the home)

    @classmethod
    def from_config(cls, cfg: Any) -> ShareSettings:
        """Raises ShareError on an unknown ``share_fetch`` (``RateError`` on a bad ``share_rate``)."""
        mode = str(getattr(cfg, "share_fetch", None) or "layers").lower()
        if mode not in MODES:
            raise ShareError("config", f"share_fetch must be one of {', '.join(MODES)}, got {mode!r}")
        return cls(mode, parse_rate(getattr(cfg, "share_rate", None)), cfg.listen,
                   float(cfg.heartbeat_interval_s), cfg.model or None)


@dataclass(frozen=True)
class PeerAddress:
    """Where an active member's share endpoint host is, and the key its CURVE server proves."""

    host: str
    public_key: str


class ShareTransport(Protocol):
    """The daemon's CURVE transport node (``transport.node.TransportNode``)."""

    async def serve(self, handler: Any, address: str = ..., **kwargs: Any) -> Any: ...

    async def connect(self, address: str, server_key: bytes | str | None = None, **kwargs: Any) -> Any: ...


def _nothing() -> None:
    return None


async def _at_once() -> None:
    return None


@dataclass(frozen=True)
class ShareDeps:
    node_id: NodeId
    settings: ShareSettings
    models_dir: Path  # the cache of fetched models (``state_dir/models``)
    transport: ShareTransport
    broadcast: Callable[[Any], Any]  # a control message to every member
    send: Callable[[NodeId, Any], Any]  # a control message to one member
    ready_ids: Callable[[], list[NodeId]]  # the active members, this node included
    address_of: Callable[[NodeId], PeerAddress | None]  # None while a member is not active or not found
    model_fetching: Callable[[bool], None] = lambda fetching: None  # True: the model is coming from the home
    holdings_changed: Callable[[], None] = _nothing  # who holds which layers changed: worth a re-plan
    replan_now: Callable[[], None] = _nothing  # the plan waiting for a fetch may go ahead now
    # returns once the device serves (or gave up loading): hashing a local file for lending waits for it, as
    # on a one-core device it would take the start's CPU (a 1.5B start was ~2 s later beside it)
    device_ready: Callable[[], Awaitable[None]] = _at_once


def share_address(state: Any, address: tuple[str, int] | None, member: Any) -> PeerAddress | None:
    """``address_of`` from the daemon's facts: a member's state, its (ip, port), its member record."""
    value = getattr(state, "value", state)
    if value not in ACTIVE_STATES or address is None or member is None:
        return None
    return PeerAddress(address[0], member.public_key)
