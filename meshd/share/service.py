"""The daemon's sharing role: lend this device's model pieces, fetch the ones it lacks.

One ``ShareService`` per daemon, built from a :class:`~meshd.share.deps.ShareDeps`
(never the daemon), on the daemon's transport node and event loop. Its parts,
each owning its state:

- ``held`` (:class:`~meshd.share.held.HeldModel`): the local file or cache entry;
- ``endpoint`` (:class:`~meshd.share.endpoint.PieceEndpoint`): lends manifest and pieces;
- ``peers`` (:class:`~meshd.share.peers.PeerBook`): the others' adverts, bans, links;
- ``own`` (:class:`~meshd.share.own_fetch.OwnFetch`): this device's fetch and its target;
- ``leader`` (:class:`~meshd.share.leader.FetchGate`): a new plan waits for fetches.

What this service itself does is the order of things: which model this
device runs (:meth:`obtain_source`: the local file, else the home's model from
the mesh, never from a package index — manifest, header, then its layers),
adverts each heartbeat interval, routing control messages, and the status.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from meshd.log import get_logger
from meshd.share import manifest as mf
from meshd.share.deps import ShareDeps
from meshd.share.endpoint import PieceEndpoint
from meshd.share.own_fetch import OwnFetch
from meshd.share.held import HeldModel
from meshd.share.leader import FetchGate
from meshd.share.messages import ShareAdvert, ShareTarget
from meshd.share.peers import PeerBook
from meshd.share.runs import to_runs
from meshd.share.store import ModelCache
from meshd.share.throttle import AsyncLimiter

log = get_logger("meshd.share")


class ShareService:
    def __init__(self, deps: ShareDeps):
        self.deps = deps
        self.settings = s = deps.settings
        self.mode = s.mode
        self.held = HeldModel(ModelCache(deps.models_dir))
        self.endpoint = PieceEndpoint(self.held, AsyncLimiter(s.rate_bps, mf.PIECE_SIZE))
        self.peers = PeerBook(deps, lambda: self.held.manifest)
        self.own = OwnFetch(self.held, self.peers, AsyncLimiter(s.rate_bps, mf.PIECE_SIZE), s.mode,
                            self.advertise_now, self._own_fetch_done)
        self.leader = FetchGate(deps, self.held, self.peers, self.own)
        self._tasks: list[asyncio.Task] = []

    # -- lifecycle ------------------------------------------------------------------
    async def start(self) -> None:
        self.own.bind_loop()
        await self.endpoint.start(self.deps.transport, self.settings.listen)
        self._tasks.append(asyncio.create_task(self._advert_loop(), name="share-adverts"))
        rate = self.settings.rate_bps
        log.info("share_started", port=self.endpoint.port, mode=self.mode,
                 rate_mbit=round(rate * 8 / 1e6, 2) if rate else None)

    async def aclose(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.own.aclose()
        await self.peers.close()
        self.held.close()

    # -- the names callers use ------------------------------------------------------------
    @property
    def port(self) -> int:
        return self.endpoint.port

    @property
    def manifest(self) -> mf.Manifest | None:
        return self.held.manifest

    @property
    def identity(self) -> str:
        return self.held.identity

    @property
    def state(self) -> str:
        return self.own.state

    def set_target(self, first: int, end: int) -> asyncio.Task | None:
        return self.own.set_target(first, end, why="asked directly")

    def gate(self, candidate: Any, current: Any, members: list[str], model: str,
             plan_over: Callable[[list[str]], Any]) -> Any | None:
        """The plan to adopt now (None: keep the current one); sends fetch targets (``FetchGate.gate``)."""
        return self.leader.gate(candidate, current, members, model, plan_over)

    # -- adverts ------------------------------------------------------------------------
    def advert(self) -> ShareAdvert:
        h = self.held.holdings()
        m = self.held.manifest
        return ShareAdvert(identity=self.identity, sha256=m.sha256 if m else "", size=m.size if m else 0,
                           manifest_digest=m.digest if m else "", share_port=self.port, complete=h.complete,
                           header=h.header, layers=to_runs(h.layers), tensors=sorted(h.tensors),
                           fetch=self.own.progress())

    async def _advert_loop(self) -> None:
        while True:
            try:
                self.advertise_now()
            except Exception:  # never let one bad advert end the loop
                log.exception("share_advert_failed")
            await asyncio.sleep(self.settings.advert_interval_s)

    def advertise_now(self) -> None:
        self.deps.broadcast(self.advert())

    def _own_fetch_done(self) -> None:
        self.deps.holdings_changed()
        self.leader.on_own_fetch_done()

    # -- control messages --------------------------------------------------------------------
    def on_control(self, sender: str, msg: Any) -> bool:
        """Adverts and targets arriving on the control link; False for anything else."""
        if isinstance(msg, ShareAdvert):
            changed = self.peers.on_advert(sender, msg)
            if changed is None:
                return True  # malformed: logged, ignored
            if changed:
                self.deps.holdings_changed()  # who can serve which layers changed
            self.leader.on_advert(sender, msg)
            return True
        if isinstance(msg, ShareTarget):
            self._on_target(sender, msg)
            return True
        return False

    def _on_target(self, sender: str, t: ShareTarget) -> None:
        if self.mode == "off":
            return
        if self.identity and t.identity != self.identity:
            log.info("share_target_ignored", peer=sender, identity=t.identity, ours=self.identity)
            return
        if self.own.target != (t.first, t.end) or not self.own.running:
            log.info("share_target", leader=sender, first=t.first, end=t.end)
        self.own.set_target(int(t.first), int(t.end), why=f"the leader {sender}")

    # -- the model this device runs ---------------------------------------------------------------
    async def obtain_source(self) -> Any:
        """The model source serving uses: the local file, else the home's model from the mesh."""
        from meshd.model.store import ModelNotAvailable, open_model

        model = self.settings.model
        try:
            source = await asyncio.to_thread(open_model, model or None)
        except ModelNotAvailable as exc:
            if model or self.mode == "off":
                raise
            log.info("share_model_not_local", reason=str(exc), mode=self.mode)
            return await self._source_from_mesh()
        reader = self.held.adopt_local(source)
        if self.held.local_path is not None:
            self._tasks.append(asyncio.create_task(self._lend_local(source.identity, reader),
                                                   name="share-manifest"))
        return source

    async def _lend_local(self, identity: str, reader: Any) -> None:
        if await self.held.build_local_manifest(identity, reader, self.deps.device_ready):
            self.advertise_now()

    async def _source_from_mesh(self) -> Any:
        from meshd.model.store import tokenizers_dir
        from meshd.share.source import PartialGGUFSource

        cache = self.held.cache
        entry = cache.most_recent()
        if entry is not None and not entry.complete and not entry.has_headers():
            entry = None
        fetching = entry is None or not entry.has_headers()
        if fetching:
            self.deps.model_fetching(True)
        if entry is None:
            self.own.state = "waiting_for_holders"
            manifest = await self.peers.fetch_manifest(self._waiting_for_holders)
            entry = await asyncio.to_thread(cache.create, manifest)
            log.info("share_model_chosen", identity=manifest.identity, size=manifest.size, mode=self.mode)
        else:
            log.info("share_model_cached", identity=entry.manifest.identity, complete=entry.complete,
                     held_bytes=entry.held_bytes())
        self.held.adopt_entry(entry)
        if not entry.has_headers():
            await self.own.until_done(entry.manifest.header_pieces)
        self.advertise_now()
        if self.mode == "whole":
            self.own.fetch_all()
        else:
            self.own.apply_pending()
        source = await asyncio.to_thread(PartialGGUFSource, entry, tokenizers_dir(), self.own.ensure_blocking)
        self.held.source = source
        if fetching:
            self.deps.model_fetching(False)
        self.advertise_now()
        return source

    def _waiting_for_holders(self, why: str) -> None:
        self.own.error = why
        if why:
            log.info("share_waiting_for_holders", reason=why)

    # -- status ----------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """What ``meshd status`` shows; no file paths (it reaches API clients; the log has them)."""
        h = self.held.holdings()
        m = self.held.manifest
        held = self.held.held_bytes()
        fetch = self.own.progress()
        if self.own.fetch is not None:
            fetch.update(self.own.fetch.stats.to_dict())
        fetch["bytes_moved"] = self.peers.moved["manifest_bytes"] + self.peers.moved["piece_bytes"]
        fetch.update(self.own.totals())
        rate = self.settings.rate_bps
        return {
            "mode": self.mode, "share_port": self.port,
            "rate_limit_mbit": round(rate * 8 / 1e6, 3) if rate else None,
            "model": self.identity or None, "sha256": m.sha256 if m else None,
            "size_bytes": m.size if m else None, "manifest": m.digest if m else None,
            "holds": {"complete": h.complete, "header": h.header, "layers": to_runs(h.layers),
                      "tensors": sorted(h.tensors), "bytes": held,
                      "fraction": round(held / m.size, 4) if m and held is not None else None},
            "fetch": fetch,
            "served": dict(self.endpoint.served),
            "banned": dict(self.peers.banned),
            "peers": {nid: {"model": p.advert.identity or None, "complete": p.holdings.complete,
                            "layers": to_runs(p.holdings.layers), "fetch": p.advert.fetch}
                      for nid, p in sorted(self.peers.peers.items())},
            "plan_waits_for": {nid: list(r) for nid, r in sorted(self.leader.waiting.items())},
        }


async def start_sharing(deps: ShareDeps) -> ShareService:
    service = ShareService(deps)
    await service.start()
    return service
