"""The other members as lenders: what each advertises, whom not to ask, the links to their endpoints.

Adverts are what fetches and the leader's gate read: a member counts as a
holder only while it is active, advertises our manifest's digest, and has not
sent a corrupt byte (``banned``). The home's model, for a device with none, is
the identity most members advertise and its manifest the digest most of them
advertise, so one member cannot impose another file on the rest.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from meshd.errors import MeshdError
from meshd.log import get_logger
from meshd.share.deps import ShareDeps, ShareError
from meshd.share.fetch import Holder
from meshd.share.gate import Holdings
from meshd.share.manifest import Manifest
from meshd.share.messages import ManifestReply, ManifestRequest, PieceReply, PieceRequest, ShareAdvert
from meshd.share.runs import from_runs
from transport.errors import TransportError
from partition.ids import NodeId

log = get_logger("meshd.share")

REQUEST_TIMEOUT_S = 60.0
MAX_LAYERS = 4096  # an advert claiming layers beyond this is malformed


@dataclass
class PeerShare:
    advert: ShareAdvert
    holdings: Holdings
    pieces: frozenset[int] | None = None  # of our manifest, computed on first use

    @property
    def fetch_mode(self) -> str | None:
        return (self.advert.fetch or {}).get("mode")


def advert_holdings(a: ShareAdvert) -> Holdings:
    """Raises ValueError on malformed runs."""
    return Holdings(bool(a.complete), frozenset(from_runs(a.layers, MAX_LAYERS)), frozenset(map(str, a.tensors)),
                    bool(a.header))


class PeerBook:
    def __init__(self, deps: ShareDeps, manifest: Callable[[], Manifest | None]):
        self.deps = deps
        self._manifest = manifest  # ours (None until we hold or fetched one)
        self.peers: dict[str, PeerShare] = {}
        self.banned: dict[str, str] = {}  # node id -> what it did
        self.moved = {"manifest_bytes": 0, "piece_bytes": 0}
        self._clients: dict[str, tuple[str, Any]] = {}

    def on_advert(self, sender: str, a: ShareAdvert) -> bool | None:
        """Record an advert; True when what the sender can lend changed, None when it was malformed."""
        try:
            holdings = advert_holdings(a)
        except (ValueError, TypeError) as exc:
            log.warning("share_advert_rejected", peer=sender, error=str(exc))
            return None
        old = self.peers.get(sender)
        new = self.peers[sender] = PeerShare(a, holdings)
        return old is None or old.holdings != holdings or old.advert.identity != a.identity \
            or old.advert.manifest_digest != a.manifest_digest or old.fetch_mode != new.fetch_mode

    # -- whom to ask --------------------------------------------------------------
    def holders(self) -> dict[str, Holder]:
        """The members that can lend pieces of our manifest now."""
        m = self._manifest()
        if m is None:
            return {}
        out = {}
        for nid, p in self.peers.items():
            a = p.advert
            if a.manifest_digest != m.digest or not a.share_port or nid in self.banned:
                continue
            if self.deps.address_of(nid) is None:
                continue
            if p.pieces is None:
                p.pieces = pieces_held(m, p.holdings)
            out[nid] = Holder(nid, p.pieces.__contains__, partial(self.get_piece, nid))
        return out

    def home_choice(self) -> tuple[str, str, list[str]] | None:
        """(sha256, manifest digest, holders to ask) of the home's model, from the adverts.

        The home's model is the identity most members hold (ties: the lowest node id's);
        its manifest is the digest most of them advertise.
        """
        ready = set(self.deps.ready_ids())
        shown = {n: p.advert for n, p in sorted(self.peers.items())
                 if n in ready and n not in self.banned and p.advert.manifest_digest and p.advert.share_port}
        if not shown:
            return None
        counts = Counter(a.identity for a in shown.values())
        first_seen: dict[str, int] = {}
        for i, a in enumerate(shown.values()):
            first_seen.setdefault(a.identity, i)
        identity = max(counts, key=lambda k: (counts[k], -first_seen[k]))
        digests = Counter((a.sha256, a.manifest_digest) for a in shown.values() if a.identity == identity)
        (sha, digest), _ = digests.most_common(1)[0]
        holders = [n for n, a in shown.items() if a.manifest_digest == digest]
        return sha, digest, holders

    # -- asking ---------------------------------------------------------------------
    async def client(self, nid: NodeId) -> Any:
        where = self.deps.address_of(nid)
        if where is None:
            raise ShareError("unreachable", f"{nid} is not an active member with a known address")
        endpoint = f"tcp://{where.host}:{self.peers[nid].advert.share_port}"
        cur = self._clients.get(nid)
        if cur is not None and cur[0] == endpoint:
            return cur[1]
        if cur is not None:
            await cur[1].close()
        peer = await self.deps.transport.connect(endpoint, server_key=where.public_key, timeout=REQUEST_TIMEOUT_S)
        self._clients[nid] = (endpoint, peer)
        return peer

    async def get_piece(self, nid: NodeId, i: int) -> bytes:
        m = self._manifest()
        peer = await self.client(nid)
        reply = await peer.request(PieceRequest(m.sha256, i), timeout=REQUEST_TIMEOUT_S)
        if not isinstance(reply, PieceReply) or reply.index != i or reply.sha256 != m.sha256 or reply.data is None:
            raise ShareError("bad_reply", f"{nid} answered piece {i} with {type(reply).__name__}")
        data = reply.data.tobytes()
        self.moved["piece_bytes"] += len(data)
        return data

    async def fetch_manifest(self, on_wait: Callable[[str], None]) -> Manifest:
        """The home's manifest, from a holder whose copy matches the digest most advertise (waits for one)."""
        said = False
        while True:
            choice = self.home_choice()
            if choice is None:
                if not said:
                    on_wait("no member of the home advertises a model to share yet "
                            "(or run `meshd model pull` on this device)")
                    said = True
                await asyncio.sleep(0.2)
                continue
            sha, digest, holders = choice
            on_wait("")
            for nid in holders:
                try:
                    m = await self._manifest_from(nid, sha, digest)
                except (TransportError, MeshdError, KeyError) as exc:
                    log.info("share_manifest_request_failed", peer=nid, error=f"{type(exc).__name__}: {exc}")
                    continue
                if m is not None:
                    return m
            await asyncio.sleep(0.5)

    async def _manifest_from(self, nid: NodeId, sha: str, digest: str) -> Manifest | None:
        peer = await self.client(nid)
        reply = await peer.request(ManifestRequest(sha), timeout=REQUEST_TIMEOUT_S)
        if not isinstance(reply, ManifestReply) or reply.data is None:
            raise ShareError("bad_reply", f"unexpected reply {type(reply).__name__}")
        data = reply.data.tobytes()
        self.moved["manifest_bytes"] += len(data)
        if hashlib.sha256(data).hexdigest() != digest:
            self.banned[nid] = "sent a manifest that does not match the digest it advertised"
            log.warning("share_peer_corrupt", peer=nid, what="manifest")
            return None
        m = Manifest.from_data(data)
        if m.sha256 != sha:
            raise ShareError("bad_reply", "manifest of another file")
        return m

    async def close(self) -> None:
        for _, peer in self._clients.values():
            await peer.close()
        self._clients.clear()


def pieces_held(m: Manifest, h: Holdings) -> frozenset[int]:
    """The pieces of ``m`` a member with holdings ``h`` can lend."""
    if h.complete:
        return frozenset(range(len(m.pieces)))
    out: set[int] = set(m.header_pieces) if h.header else set()
    for r in m.regions:
        if r.is_tensor and h.covers([r.name]):
            out.update(r.piece_range)
    return frozenset(out)
