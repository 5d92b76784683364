"""This device's own fetch: the header first, then exactly the pieces of the layer range it is to serve.

A *target* is the range this device is to serve: from the leader (a plan
waits for it), from the cache's record (a restart resumes it), or the first
range a stage load asks for. The fetch always follows the newest target: a
narrower target replaces a wider fetch still running, so pieces no plan wants
any more are not fetched. A *load* (``ensure``) only adds what it needs to the
fetch under way; it never moves the target.

A target of every layer makes a layer-range fetch the whole file. That is
right only when a plan really gives this device every layer, so it is never
silent: ``share_fetch_every_layer`` is logged (with who asked) and counted in
the status (``fetch.every_layer_fetches``), which the benchmark reports.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any

from decoding.errors import ModelLoadError
from meshd.log import get_logger
from meshd.share.fetch import Fetch, NoHolder
from meshd.share.held import HeldModel
from meshd.share.manifest import needed_tensors
from meshd.share.peers import PeerBook
from meshd.share.throttle import AsyncLimiter

log = get_logger("meshd.share")


class OwnFetch:
    def __init__(self, held: HeldModel, peers: PeerBook, down: AsyncLimiter, mode: str,
                 advertise: Callable[[], None], finished: Callable[[], None]):
        self.held = held
        self.peers = peers
        self.down = down
        self.mode = mode
        self._advertise = advertise
        self._finished = finished
        self.state = "idle"
        self.error = ""
        self.target: tuple[int, int] | None = None
        self.pending_target: tuple[int, int, str] | None = None  # arrived before the header did
        self.fetch: Fetch | None = None
        self.every_layer_fetches = 0  # targets of every layer fetched (the whole file in layers mode)
        self._task: asyncio.Task | None = None
        self._wanted: frozenset[int] = frozenset()
        self._fetched_before = 0  # bytes fetched by earlier (finished or replaced) fetches of this run
        self._by_holder_before: dict[str, int] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def bind_loop(self) -> None:
        self._loop = asyncio.get_running_loop()

    # -- targets ------------------------------------------------------------------
    def set_target(self, first: int, end: int, why: str) -> asyncio.Task | None:
        """Fetch what layers ``[first, end)`` need (and the header); replaces the previous target."""
        entry = self.held.entry
        if self.held.local_path is not None or (entry is not None and entry.complete):
            return None  # we hold everything
        if entry is None or not entry.has_headers():
            self.pending_target = (first, end, why)  # applied once the header is in
            return None
        # Layers come from the tensor names, so the fetch starts while the header is still
        # being parsed and the tokenizer built (seconds), not after.
        num_layers = entry.manifest.num_layers
        if not 0 <= first < end <= num_layers:
            log.warning("share_target_rejected", first=first, end=end, num_layers=num_layers, asked_by=why)
            return None
        if self.mode == "whole":
            self.target = (first, end)
            entry.set_target(self.target)
            return self._task  # every piece is coming anyway
        wanted = self.pieces_for(first, end)
        moved = self.target != (first, end)
        if moved and (first, end) == (0, num_layers) and not wanted <= entry.have:
            self.every_layer_fetches += 1
            log.warning("share_fetch_every_layer", asked_by=why, num_layers=num_layers,
                        reason="a plan gives this device every layer: its layer range is the whole file")
        self.target = (first, end)
        entry.set_target(self.target)
        return self._start(wanted, self.target, replace=moved)

    def apply_pending(self) -> None:
        """The header is in: start the target that arrived before it, else the one the cache recorded."""
        entry = self.held.entry
        if self.pending_target is not None:
            self.set_target(*self.pending_target)
        elif entry is not None and entry.target is not None:
            self.set_target(*entry.target, why="resumed (the cache's last target)")

    def pieces_for(self, first: int, end: int) -> frozenset[int]:
        m = self.held.entry.manifest
        return m.header_pieces | frozenset(
            m.pieces_of(needed_tensors(m.tensor_names, m.num_layers, first, end)))

    def fetch_all(self) -> asyncio.Task:
        return self._start(range(len(self.held.entry.manifest.pieces)), None, replace=False)

    # -- loads ----------------------------------------------------------------------
    def ensure_blocking(self, first: int, end: int) -> None:
        """Called by ``PartialGGUFSource.load_stage`` on a worker thread: fetch, then return."""
        assert self._loop is not None
        asyncio.run_coroutine_threadsafe(self._ensure(first, end), self._loop).result()

    def _for_load(self, first: int, end: int) -> asyncio.Task | None:
        entry = self.held.entry
        if entry is None or not entry.has_headers():
            return None
        if self.target is None and self.mode != "whole":
            return self.set_target(first, end, why="a stage load")
        wanted = self.pieces_for(first, end)
        if self.running:
            wanted |= self._wanted  # the target's fetch goes on beside what this load needs
        return self._start(wanted, self.target, replace=False)

    async def _ensure(self, first: int, end: int) -> None:
        source = self.held.source
        attempts = 0
        while source is not None and source.missing(first, end):
            task = self._for_load(first, end)
            if task is None:
                raise ModelLoadError(f"cannot fetch layers [{first}, {end}) here")
            try:
                await asyncio.shield(task)
            except asyncio.CancelledError:
                if not task.cancelled():
                    raise
            except NoHolder as exc:
                attempts += 1
                if attempts >= 2:
                    raise ModelLoadError(str(exc)) from None

    async def until_done(self, wanted: Iterable[int]) -> None:
        """Fetch ``wanted`` (the header) to the end, waiting out holders that come and go."""
        while True:
            task = self._start(wanted, None, replace=False)
            try:
                await asyncio.shield(task)
                return
            except asyncio.CancelledError:
                if not task.cancelled():
                    raise  # we were cancelled ourselves
                # replaced by a newer fetch: make sure ours is still covered
            except NoHolder:
                await asyncio.sleep(1.0)  # holders may come back; keep trying (status shows why)

    # -- the fetch ------------------------------------------------------------------------
    def _start(self, wanted: Iterable[int], target: tuple[int, int] | None, replace: bool) -> asyncio.Task:
        """A fetch of ``wanted``. The one running stays when it fetches exactly that, or (unless a new
        target ``replace``s it) a superset; otherwise it is replaced, keeping what it wrote."""
        wanted = frozenset(wanted)
        task = self._task
        if self.running and (wanted == self._wanted or (not replace and wanted <= self._wanted)):
            return task
        if self.running:
            task.cancel()
        self._wanted = wanted
        if self.fetch is not None:
            self._fetched_before += self.fetch.stats.fetched_bytes
            for nid, n in self.fetch.stats.by_holder.items():
                self._by_holder_before[nid] = self._by_holder_before.get(nid, 0) + n
        self.fetch = Fetch(self.held.entry, sorted(wanted), self.peers.holders, self.down, self.peers.banned)
        self.error = ""
        self._task = asyncio.create_task(self._run(self.fetch, target), name="share-fetch")
        return self._task

    async def _run(self, fetch: Fetch, target: tuple[int, int] | None) -> None:
        self.state = "fetching"
        log.info("share_fetch_started", target=list(target) if target else "all", mode=self.mode,
                 wanted_bytes=fetch.stats.wanted_bytes, resumed_bytes=fetch.stats.had_bytes)
        self._advertise()
        try:
            stats = await fetch.run()
        except NoHolder as exc:
            self.state, self.error = "stalled", str(exc)
            log.warning("share_fetch_stalled", error=str(exc))
            self._advertise()
            raise
        s = stats.to_dict()
        log.info("share_fetch_done", target=list(target) if target else "all", fetched_bytes=s["fetched_bytes"],
                 resumed_bytes=s["had_bytes"], seconds=s["seconds"], rate_mbit=s["rate_mbit"],
                 by_holder=s["by_holder"], corrupt_pieces=s["corrupt_pieces"])
        entry = self.held.entry
        if entry is not None and len(entry.have) == len(entry.manifest.pieces) and not entry.complete:
            ok = await asyncio.to_thread(entry.verify_whole)
            log.info("share_whole_file_verified" if ok else "share_whole_file_mismatch",
                     identity=entry.manifest.identity)
        self.state = "done"
        self._advertise()
        self._finished()

    # -- what status shows ------------------------------------------------------------------
    def progress(self) -> dict[str, Any]:
        """What adverts carry: the state, the target and how far the fetch is."""
        out: dict[str, Any] = {"state": self.state, "mode": self.mode,
                               "target": list(self.target) if self.target else None}
        if self.fetch is not None:
            s = self.fetch.stats.to_dict()
            out.update({k: s[k] for k in ("progress", "done_bytes", "wanted_bytes", "rate_mbit", "eta_s")})
        if self.error:
            out["error"] = self.error
        return out

    def totals(self) -> dict[str, Any]:
        """The whole run's fetching, over every fetch this daemon started."""
        by = dict(self._by_holder_before)
        for nid, n in (self.fetch.stats.by_holder.items() if self.fetch else ()):
            by[nid] = by.get(nid, 0) + n
        return {"fetched_bytes_total": self._fetched_before + (self.fetch.stats.fetched_bytes if self.fetch else 0),
                "resumed_bytes": self.held.resumed_bytes, "by_holder_total": by,
                "every_layer_fetches": self.every_layer_fetches}

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
