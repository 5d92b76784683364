"""One daemon's transport: a context, its keys, its ZAP handler, its links.

A daemon creates one ``TransportNode`` and gets every server and peer link
from it. That keeps all links on one ZeroMQ context (one I/O thread, however
many peers), and makes the security set-up impossible to half-do: with
``curve=True`` (the default) the node loads or creates its keypair under
``state_dir/keys``, starts the allow-list authenticator before any server
binds, and stops it only after every server is closed.

    node = TransportNode("kitchen-pc", state_dir=state)
    await node.start()
    server = await node.serve(handler, "tcp://0.0.0.0:5710")
    peer = await node.connect("tcp://laptop:5710", server_key=laptop_public_key)
    ...
    await node.close()
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import zmq.asyncio

from transport.auth import CurveAuthenticator
from transport.errors import TransportError
from transport.keys import AllowList, Keypair, load_or_create_keypair
from transport.link import Handler, StageServer
from transport.log import get_logger
from transport.peer import Peer
from transport.tuning import tune_allocator_for_large_messages
from transport.wire import DEFAULT_LIMITS, Limits

__all__ = ["TransportNode"]

log = get_logger("transport.node")


class TransportNode:
    def __init__(
        self,
        node_id: str,
        *,
        state_dir: str | os.PathLike | None = None,
        curve: bool = True,
        keypair: Keypair | None = None,
        allowlist: AllowList | None = None,
        limits: Limits = DEFAULT_LIMITS,
        tune_allocator: bool = False,
    ) -> None:
        """``tune_allocator=True`` applies
        ``transport.tuning.tune_allocator_for_large_messages()`` (process-wide,
        glibc only) so messages of 32 MiB and more are received without page
        faults; recommended for a daemon, off by default for library use."""
        if tune_allocator:
            tune_allocator_for_large_messages(limits.max_total_bytes)
        self.node_id = node_id
        self.curve = curve
        self.limits = limits
        if curve:
            if keypair is None:
                if state_dir is None:
                    raise TransportError("CURVE needs a state_dir for the keypair (or an explicit keypair)")
                keypair = load_or_create_keypair(state_dir)
            if allowlist is None:
                if state_dir is None:
                    raise TransportError("CURVE needs a state_dir for the allow-list (or an explicit AllowList)")
                allowlist = AllowList.for_state_dir(state_dir)
        self.keypair = keypair if curve else None
        self.allowlist = allowlist if curve else None
        self.context = zmq.asyncio.Context()
        self.authenticator: CurveAuthenticator | None = None
        self._servers: list[StageServer] = []
        self._peers: list[Peer] = []

    @property
    def public_key(self) -> bytes | None:
        return self.keypair.public if self.keypair else None

    async def start(self) -> "TransportNode":
        if self.curve and self.authenticator is None:
            assert self.allowlist is not None
            self.authenticator = CurveAuthenticator(self.context, self.allowlist).start()
        log.info("transport_started", node_id=self.node_id, curve=self.curve,
                 fingerprint=self.keypair.fingerprint if self.keypair else None)
        return self

    def admit(self, public_key: bytes | str, name: str = "") -> None:
        """Add a member's key to the allow-list; effective on its next handshake."""
        if self.allowlist is None:
            raise TransportError("this node runs without CURVE; there is no allow-list")
        self.allowlist.add(public_key, name)

    async def serve(self, handler: Handler, address: str = "tcp://127.0.0.1:0", **kwargs: Any) -> StageServer:
        if self.curve and self.authenticator is None:
            await self.start()
        server = StageServer(
            handler, node_id=self.node_id, context=self.context, keypair=self.keypair,
            limits=kwargs.pop("limits", self.limits), **kwargs,
        )
        await server.start(address)
        self._servers.append(server)
        return server

    async def connect(self, address: str, server_key: bytes | str | None = None, **kwargs: Any) -> Peer:
        if self.curve and server_key is None:
            raise TransportError(f"connecting to {address} with CURVE needs the server's public key")
        peer = Peer(
            node_id=self.node_id, context=self.context,
            keypair=self.keypair if self.curve else None,
            server_key=server_key if self.curve else None,
            limits=kwargs.pop("limits", self.limits), **kwargs,
        )
        await peer.connect(address)
        # Peers closed by their owner (a cloud verifier unpaired, a member gone) are forgotten here.
        self._peers = [p for p in self._peers if not p.closed] + [peer]
        return peer

    async def close(self) -> None:
        for peer in self._peers:
            await peer.close()
        for server in self._servers:
            await server.close()
        self._peers.clear()
        self._servers.clear()
        # Only now: a CURVE server without its ZAP handler would admit anyone.
        if self.authenticator is not None:
            self.authenticator.stop()
            self.authenticator = None
            # Let the cancelled ZAP task unwind (it unregisters its poller from
            # the event loop) before the context dies: terminating first leaves
            # a stale reader behind, and the next node's ZAP handler in this
            # event loop then never answers — every later CURVE handshake hangs.
            await asyncio.sleep(0)
        self.context.term()

    async def __aenter__(self) -> "TransportNode":
        return await self.start()

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()
