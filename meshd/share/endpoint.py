"""The share endpoint: a CURVE server (the home's keys only) lending the manifest and pieces held here.

Every piece is checked against the manifest again before it leaves, so a byte
that rotted on disk here is refused (and dropped from the record) rather than
sent; uploads wait on ``--share-rate``'s bucket so lending never starves the
requests this device serves.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from meshd.share.deps import ShareError, ShareTransport
from meshd.share.held import HeldModel
from meshd.share.messages import ManifestReply, ManifestRequest, PieceReply, PieceRequest
from meshd.share.throttle import AsyncLimiter


class PieceEndpoint:
    def __init__(self, held: HeldModel, up: AsyncLimiter):
        self.held = held
        self.up = up
        self.served = {"pieces": 0, "bytes": 0, "manifests": 0, "refused": 0}
        self.port = 0
        self._server: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self, transport: ShareTransport, listen: str) -> int:
        self._loop = asyncio.get_running_loop()
        self._server = await transport.serve(self.handle, f"tcp://{listen}:0")
        self.port = int(self._server.address.rsplit(":", 1)[1])
        return self.port

    def _refuse(self, code: str, message: str) -> ShareError:
        self.served["refused"] += 1
        return ShareError(code, message)

    async def handle(self, msg: Any, req: Any) -> Any:
        m = self.held.manifest
        match msg:
            case ManifestRequest(sha256=sha):
                if m is None or m.sha256 != sha:
                    raise self._refuse("not_held", f"no manifest for {str(sha)[:16]} here")
                self.served["manifests"] += 1
                return ManifestReply(sha, np.frombuffer(m.data, dtype=np.uint8))
            case PieceRequest(sha256=sha, index=i):
                if m is None or m.sha256 != sha:
                    raise self._refuse("not_held", f"model {str(sha)[:16]} is not held here")
                if not 0 <= i < len(m.pieces):
                    raise self._refuse("bad_request", f"piece {i} does not exist ({len(m.pieces)} pieces)")
                if not self.held.holds_piece(i):
                    raise self._refuse("not_held", f"piece {i} is not held here")
                await self.up.take(m.pieces[i].length)
                data = await asyncio.to_thread(self.read_checked, i)
                self.served["pieces"] += 1
                self.served["bytes"] += len(data)
                return PieceReply(sha, i, np.frombuffer(data, dtype=np.uint8))
            case _:
                raise ShareError("unexpected", f"the share endpoint does not take {type(msg).__name__}")

    def read_checked(self, i: int) -> bytes:
        return self.held.read_checked(i, self._loop)
