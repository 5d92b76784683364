"""The daemon's sharing role: lend this device's model pieces, fetch the ones it lacks.

One ``ShareService`` per daemon, on the daemon's transport node and event loop:

- **Endpoint.** A CURVE server (the home's keys only) answering manifest and
  piece requests from what this device holds verified; every piece is checked
  against the manifest again before it leaves, so a byte that rotted on disk
  here is refused rather than sent.
- **Adverts.** Each heartbeat interval a ``ShareAdvert`` to every member: the
  model, its manifest digest, the share port, what is held, how this device's
  own fetch goes. Peers' adverts are what fetches and the leader's gate read.
- **The model this device runs** (:meth:`obtain_source`): the local file when
  there is one (its manifest is built once, in the background, and cached);
  otherwise the home's model from the mesh, never from a package index: the
  manifest most holders advertise, then the header, then — ``share_fetch =
  "layers"`` — only the tensors of the layer range the leader targets, or —
  ``"whole"`` — every piece. A partial model restarts from what is on disk.
- **The leader's gate** (:meth:`gate`): a new plan waits for its members to
  hold their layers (``meshd.share.gate``); the leader sends each one a
  ``ShareTarget`` and re-plans the moment the last of them reports it holds it.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from decoding.errors import ModelLoadError
from meshd.errors import MeshdError
from meshd.log import get_logger
from meshd.share import manifest as mf
from meshd.share.fetch import Fetch, Holder, NoHolder
from meshd.share.gate import NOTHING, Holdings, gate_plan
from meshd.share.manifest import Manifest, ManifestError, needed_tensors
from meshd.share.messages import (ManifestReply, ManifestRequest, PieceReply, PieceRequest, ShareAdvert,
                                  ShareTarget)
from meshd.share.runs import from_runs, to_runs
from meshd.share.store import CachedModel, ModelCache
from meshd.share.throttle import AsyncLimiter, parse_rate
from transport.errors import TransportError

log = get_logger("meshd.share")

MODES = ("layers", "whole", "off")
LOCAL_MANIFESTS = ".local-manifests"  # under the cache root: manifests of local files, by path/size/mtime
REQUEST_TIMEOUT_S = 60.0
MAX_LAYERS = 4096  # an advert claiming layers beyond this is malformed


class ShareError(MeshdError):
    """A share request refused (``code`` travels in the error reply)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


@dataclass
class PeerShare:
    advert: ShareAdvert
    holdings: Holdings
    pieces: frozenset[int] | None = None  # of our manifest, computed on first use


def advert_holdings(a: ShareAdvert) -> Holdings:
    """Raises ValueError on malformed runs."""
    return Holdings(bool(a.complete), frozenset(from_runs(a.layers, MAX_LAYERS)), frozenset(map(str, a.tensors)),
                    bool(a.header))


class ShareService:
    def __init__(self, daemon, replan_now: Callable[[], None] | None = None):
        self.d = daemon
        cfg = daemon.config
        self.mode = str(getattr(cfg, "share_fetch", None) or "layers").lower()
        if self.mode not in MODES:
            raise ShareError("config", f"share_fetch must be one of {', '.join(MODES)}, got {self.mode!r}")
        rate = parse_rate(getattr(cfg, "share_rate", None))
        self.rate = rate
        self.down = AsyncLimiter(rate, mf.PIECE_SIZE)
        self.up = AsyncLimiter(rate, mf.PIECE_SIZE)
        self.cache = ModelCache(daemon.state.models_dir)
        self.replan_now = replan_now
        self.server = None
        self.port = 0
        # what this device holds
        self.source = None
        self.local_path: Path | None = None  # a whole local file outside the cache
        self._local_fd: int | None = None
        self.manifest: Manifest | None = None
        self.entry: CachedModel | None = None
        self.tensor_names: tuple[str, ...] | None = None
        # the others
        self.peers: dict[str, PeerShare] = {}
        self.banned: dict[str, str] = {}
        self._clients: dict[str, tuple[str, Any]] = {}
        # this device's fetch
        self.state = "idle"
        self.error = ""
        self.target: tuple[int, int] | None = None
        self._pending_target: tuple[int, int] | None = None
        self.fetch: Fetch | None = None
        self._fetch_task: asyncio.Task | None = None
        self._fetch_wanted: frozenset[int] = frozenset()
        self._fetched_before = 0  # bytes fetched by earlier (finished or replaced) fetches of this run
        self.resumed_bytes = 0  # verified bytes the cache already held when this daemon started
        self._by_holder_before: dict[str, int] = {}
        self.moved = {"manifest_bytes": 0, "piece_bytes": 0}
        self.served = {"pieces": 0, "bytes": 0, "manifests": 0, "refused": 0}
        # the leader's view
        self.waiting: dict[str, tuple[int, int]] = {}
        self.wait_reason = ""
        self._tasks: list[asyncio.Task] = []
        self._loop: asyncio.AbstractEventLoop | None = None

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.server = await self.d.link.node.serve(self._handle, f"tcp://{self.d.config.listen}:0")
        self.port = int(self.server.address.rsplit(":", 1)[1])
        self._tasks.append(asyncio.create_task(self._advert_loop(), name="share-adverts"))
        log.info("share_started", port=self.port, mode=self.mode,
                 rate_mbit=round(self.rate * 8 / 1e6, 2) if self.rate else None)

    async def aclose(self) -> None:
        tasks = [t for t in (*self._tasks, self._fetch_task) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for _, peer in self._clients.values():
            await peer.close()
        self._clients.clear()
        if self.entry is not None:
            self.entry.close()
        if self._local_fd is not None:
            os.close(self._local_fd)
            self._local_fd = None

    # ------------------------------------------------------------------ what we hold
    @property
    def identity(self) -> str:
        if self.source is not None:
            return str(getattr(self.source, "identity", "") or "")
        return self.manifest.identity if self.manifest is not None else ""

    def _num_layers(self) -> int:
        if self.manifest is not None:
            return self.manifest.num_layers
        cfg = getattr(self.source, "config", None)
        return int(getattr(cfg, "num_layers", 0) or 0)

    def holdings(self) -> Holdings:
        if self.local_path is not None or (self.source is not None and self.entry is None):
            return Holdings(complete=True, header=True)
        if self.entry is not None:
            return self.entry.holdings()
        return NOTHING

    def _holds_piece(self, i: int) -> bool:
        return self.local_path is not None or (self.entry is not None and i in self.entry.have)

    def advert(self) -> ShareAdvert:
        h = self.holdings()
        m = self.manifest
        return ShareAdvert(identity=self.identity, sha256=m.sha256 if m else "", size=m.size if m else 0,
                           manifest_digest=m.digest if m else "", share_port=self.port, complete=h.complete,
                           header=h.header, layers=to_runs(h.layers), tensors=sorted(h.tensors),
                           fetch=self.fetch_progress())

    def fetch_progress(self) -> dict[str, Any]:
        out: dict[str, Any] = {"state": self.state, "mode": self.mode,
                               "target": list(self.target) if self.target else None}
        if self.fetch is not None:
            s = self.fetch.stats.to_dict()
            out.update({k: s[k] for k in ("progress", "done_bytes", "wanted_bytes", "rate_mbit", "eta_s")})
        if self.error:
            out["error"] = self.error
        return out

    async def _advert_loop(self) -> None:
        while True:
            try:
                self._advertise_now()
            except Exception:  # never let one bad advert end the loop
                log.exception("share_advert_failed")
            await asyncio.sleep(self.d.config.heartbeat_interval_s)

    def _advertise_now(self) -> None:
        if self.d.link is not None:
            self.d.link.broadcast(self.advert())

    # ------------------------------------------------------------------ the model this device runs
    async def obtain_source(self):
        """The model source serving uses: the local file, else the home's model from the mesh."""
        from meshd.model_store import ModelNotAvailable, open_model

        cfg = self.d.config
        try:
            source = await asyncio.to_thread(open_model, cfg.model or None)
        except ModelNotAvailable as exc:
            if cfg.model or self.mode == "off":
                raise
            log.info("share_model_not_local", reason=str(exc), mode=self.mode)
            return await self._source_from_mesh()
        self._adopt_local(source)
        return source

    def _adopt_local(self, source) -> None:
        self.source = source
        path = Path(getattr(source, "path", ""))
        reader = getattr(source, "_reader", None)
        if reader is None or not path.is_file():
            log.info("share_not_shareable", model=str(path), reason="only GGUF files are shared")
            return
        self.local_path = path
        self.tensor_names = tuple(t.name for t in reader.tensors)
        self._tasks.append(asyncio.create_task(self._local_manifest(path, source.identity, reader),
                                               name="share-manifest"))

    async def _local_manifest(self, path: Path, identity: str, reader=None) -> None:
        """Build (once; cached by path, size and mtime) the manifest this device serves from."""
        st = path.stat()
        key = hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:24]
        cached = self.cache.root / LOCAL_MANIFESTS / f"{key}.json"
        try:
            try:
                m = Manifest.from_data(cached.read_bytes())
            except (OSError, ManifestError):
                m = await asyncio.to_thread(mf.build, path, mf.PIECE_SIZE, None, reader)
                from meshd.state import atomic_write

                atomic_write(cached, m.data, mode=0o644)
        except (OSError, ManifestError) as exc:
            log.warning("share_manifest_failed", model=str(path), error=str(exc))
            return
        if m.identity != identity:
            log.error("share_manifest_mismatch", model=str(path), manifest=m.identity, identity=identity)
            return
        self.manifest = m
        log.info("share_manifest_ready", identity=m.identity, pieces=len(m.pieces), digest=m.digest[:16])
        self._advertise_now()

    async def _source_from_mesh(self):
        from meshd.model_store import tokenizers_dir
        from meshd.share.source import PartialGGUFSource

        entry = self.cache.most_recent()
        if entry is not None and not entry.complete and "@header" not in entry.held_regions():
            entry = None
        if entry is None:
            self.d.load_state = "fetching"
            self.state = "waiting_for_holders"
            manifest = await self._fetch_manifest()
            entry = await asyncio.to_thread(self.cache.create, manifest)
            log.info("share_model_chosen", identity=manifest.identity, size=manifest.size, mode=self.mode)
        else:
            log.info("share_model_cached", identity=entry.manifest.identity, complete=entry.complete,
                     held_bytes=entry.held_bytes())
        self.entry, self.manifest = entry, entry.manifest
        self.tensor_names = entry.manifest.tensor_names
        self.resumed_bytes = entry.held_bytes()
        if "@header" not in entry.held_regions():
            self.d.load_state = "fetching"
            await self._fetch_until_done(list(entry.manifest.header.piece_range), None)
        self._advertise_now()
        if self.mode == "whole":
            self._start_fetch(range(len(entry.manifest.pieces)), None)
        else:
            target = self._pending_target or entry.target
            if target is not None:
                self.set_target(*target)
        source = await asyncio.to_thread(PartialGGUFSource, entry, tokenizers_dir(), self.ensure_blocking)
        self.source = source
        if self.d.load_state == "fetching":
            self.d.load_state = "loading"
        self._advertise_now()
        return source

    def _home_choice(self) -> tuple[str, str, list[str]] | None:
        """(sha256, manifest digest, holders to ask) of the home's model, from the adverts.

        The home's model is the identity most members hold (ties: the lowest node id's);
        its manifest is the digest most of them advertise, so one member cannot
        impose a different manifest on the others.
        """
        ready = set(self.d.membership.ready_ids()) if self.d.membership else set(self.peers)
        shown = {n: p.advert for n, p in sorted(self.peers.items())
                 if n in ready and n not in self.banned and p.advert.manifest_digest and p.advert.share_port}
        if not shown:
            return None
        counts = Counter(a.identity for a in shown.values())
        first_seen = {}
        for i, a in enumerate(shown.values()):
            first_seen.setdefault(a.identity, i)
        identity = max(counts, key=lambda k: (counts[k], -first_seen[k]))
        digests = Counter((a.sha256, a.manifest_digest) for a in shown.values() if a.identity == identity)
        (sha, digest), _ = digests.most_common(1)[0]
        holders = [n for n, a in shown.items() if a.manifest_digest == digest]
        return sha, digest, holders

    async def _fetch_manifest(self) -> Manifest:
        logged = False
        while True:
            choice = self._home_choice()
            if choice is None:
                if not logged:
                    self.error = ("no member of the home advertises a model to share yet "
                                  "(or run `meshd model pull` on this device)")
                    log.info("share_waiting_for_holders", reason=self.error)
                    logged = True
                await asyncio.sleep(0.2)
                continue
            sha, digest, holders = choice
            self.error = ""
            for nid in holders:
                try:
                    peer = await self._client(nid)
                    reply = await peer.request(ManifestRequest(sha), timeout=REQUEST_TIMEOUT_S)
                    if not isinstance(reply, ManifestReply) or reply.data is None:
                        raise ShareError("bad_reply", f"unexpected reply {type(reply).__name__}")
                    data = reply.data.tobytes()
                    self.moved["manifest_bytes"] += len(data)
                    if hashlib.sha256(data).hexdigest() != digest:
                        self.banned[nid] = "sent a manifest that does not match the digest it advertised"
                        log.warning("share_peer_corrupt", peer=nid, what="manifest")
                        continue
                    m = Manifest.from_data(data)
                    if m.sha256 != sha:
                        raise ShareError("bad_reply", "manifest of another file")
                    return m
                except (TransportError, MeshdError, KeyError) as exc:
                    log.info("share_manifest_request_failed", peer=nid, error=f"{type(exc).__name__}: {exc}")
            await asyncio.sleep(0.5)

    # ------------------------------------------------------------------ targets and fetches
    def set_target(self, first: int, end: int) -> asyncio.Task | None:
        """Fetch what layers ``[first, end)`` need (and the header); replaces the previous target."""
        if self.local_path is not None or (self.entry is not None and self.entry.complete):
            return None  # we hold everything
        if self.entry is None or "@header" not in self.entry.held_regions():
            self._pending_target = (first, end)  # applied once the header is in
            return None
        # Layers come from the tensor names, so the fetch starts while the header is still
        # being parsed and the tokenizer built (seconds), not after.
        num_layers = self.entry.manifest.num_layers
        if not 0 <= first < end <= num_layers:
            log.warning("share_target_rejected", first=first, end=end, num_layers=num_layers)
            return None
        self.target = (first, end)
        self.entry.set_target(self.target)
        if self.mode == "whole":
            return self._fetch_task  # every piece is coming anyway
        m = self.entry.manifest
        wanted = set(m.header.piece_range) | set(m.pieces_of(needed_tensors(m.tensor_names, num_layers, first, end)))
        return self._start_fetch(wanted, (first, end))

    def _start_fetch(self, wanted, target) -> asyncio.Task:
        wanted = frozenset(wanted)
        task = self._fetch_task
        if task is not None and not task.done() and wanted <= self._fetch_wanted:
            return task
        if task is not None and not task.done():
            task.cancel()
        self._fetch_wanted = wanted
        if self.fetch is not None:
            self._fetched_before += self.fetch.stats.fetched_bytes
            for nid, n in self.fetch.stats.by_holder.items():
                self._by_holder_before[nid] = self._by_holder_before.get(nid, 0) + n
        self.fetch = Fetch(self.entry, sorted(wanted), self._holders, self.down, self.banned)
        self.error = ""
        self._fetch_task = asyncio.create_task(self._run_fetch(self.fetch, target), name="share-fetch")
        return self._fetch_task

    async def _run_fetch(self, fetch: Fetch, target) -> None:
        self.state = "fetching"
        log.info("share_fetch_started", target=list(target) if target else "all", mode=self.mode,
                 wanted_bytes=fetch.stats.wanted_bytes, resumed_bytes=fetch.stats.had_bytes)
        self._advertise_now()
        try:
            stats = await fetch.run()
        except NoHolder as exc:
            self.state, self.error = "stalled", str(exc)
            log.warning("share_fetch_stalled", error=str(exc))
            self._advertise_now()
            raise
        s = stats.to_dict()
        log.info("share_fetch_done", target=list(target) if target else "all", fetched_bytes=s["fetched_bytes"],
                 resumed_bytes=s["had_bytes"], seconds=s["seconds"], rate_mbit=s["rate_mbit"],
                 by_holder=s["by_holder"], corrupt_pieces=s["corrupt_pieces"])
        entry = self.entry
        if entry is not None and len(entry.have) == len(entry.manifest.pieces) and not entry.complete:
            ok = await asyncio.to_thread(entry.verify_whole)
            log.info("share_whole_file_verified" if ok else "share_whole_file_mismatch",
                     identity=entry.manifest.identity)
        self.state = "done"
        self._advertise_now()
        self._own_holdings_changed()

    def _own_holdings_changed(self) -> None:
        """Our own fetch finished: a plan (ours, if we lead) may have been waiting for it."""
        self.d.debounce.poke(self.d.clock())
        me = self.d.node_id
        if me in self.waiting and self._num_layers() and self.replan_now is not None:
            first, end = self.waiting[me]
            if self.covers(me, first, end, self._num_layers()):
                self.replan_now()

    async def _fetch_until_done(self, wanted, target) -> None:
        while True:
            task = self._start_fetch(wanted, target)
            try:
                await asyncio.shield(task)
                return
            except asyncio.CancelledError:
                if not task.cancelled():
                    raise  # we were cancelled ourselves
                # replaced by a newer fetch: make sure ours is still covered
            except NoHolder:
                await asyncio.sleep(1.0)  # holders may come back; keep trying (status shows why)

    def ensure_blocking(self, first: int, end: int) -> None:
        """Called by ``PartialGGUFSource.load_stage`` on a worker thread: fetch, then return."""
        assert self._loop is not None
        fut = asyncio.run_coroutine_threadsafe(self._ensure(first, end), self._loop)
        fut.result()

    async def _ensure(self, first: int, end: int) -> None:
        source = self.source
        attempts = 0
        while source is not None and source.missing(first, end):
            task = self.set_target(first, end)
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

    # ------------------------------------------------------------------ peers
    def _holders(self) -> dict[str, Holder]:
        m = self.manifest
        if m is None:
            return {}
        out = {}
        membership = self.d.membership
        for nid, p in self.peers.items():
            a = p.advert
            if a.manifest_digest != m.digest or not a.share_port or nid in self.banned:
                continue
            state = membership.state_of(nid) if membership is not None else None
            if state is None or state.value not in ("ready", "suspect") or nid not in self.d.addresses:
                continue
            if p.pieces is None:
                p.pieces = self._pieces_held(p.holdings)
            held = p.pieces
            out[nid] = Holder(nid, held.__contains__, partial(self._get_piece, nid))
        return out

    def _pieces_held(self, h: Holdings) -> frozenset[int]:
        m = self.manifest
        if h.complete:
            return frozenset(range(len(m.pieces)))
        out: set[int] = set(m.header.piece_range) if h.header else set()
        for r in m.regions:
            if r.is_tensor and h.covers([r.name]):
                out.update(r.piece_range)
        return frozenset(out)

    async def _client(self, nid: str):
        a = self.peers[nid].advert
        host = self.d.addresses[nid][0]
        endpoint = f"tcp://{host}:{a.share_port}"
        cur = self._clients.get(nid)
        if cur is not None and cur[0] == endpoint:
            return cur[1]
        if cur is not None:
            await cur[1].close()
        peer = await self.d.link.node.connect(endpoint, server_key=self.d.members[nid].public_key,
                                              timeout=REQUEST_TIMEOUT_S)
        self._clients[nid] = (endpoint, peer)
        return peer

    async def _get_piece(self, nid: str, i: int) -> bytes:
        m = self.manifest
        peer = await self._client(nid)
        reply = await peer.request(PieceRequest(m.sha256, i), timeout=REQUEST_TIMEOUT_S)
        if not isinstance(reply, PieceReply) or reply.index != i or reply.sha256 != m.sha256 or reply.data is None:
            raise ShareError("bad_reply", f"{nid} answered piece {i} with {type(reply).__name__}")
        data = reply.data.tobytes()
        self.moved["piece_bytes"] += len(data)
        return data

    def on_control(self, sender: str, msg: Any) -> bool:
        """Adverts and targets arriving on the control link; False for anything else."""
        if isinstance(msg, ShareAdvert):
            self._on_advert(sender, msg)
            return True
        if isinstance(msg, ShareTarget):
            self._on_target(sender, msg)
            return True
        return False

    def _on_advert(self, sender: str, a: ShareAdvert) -> None:
        try:
            holdings = advert_holdings(a)
        except (ValueError, TypeError) as exc:
            log.warning("share_advert_rejected", peer=sender, error=str(exc))
            return
        old = self.peers.get(sender)
        self.peers[sender] = PeerShare(a, holdings)
        mode = (a.fetch or {}).get("mode")
        if old is None or old.holdings != holdings or old.advert.identity != a.identity \
                or old.advert.manifest_digest != a.manifest_digest or (old.advert.fetch or {}).get("mode") != mode:
            self.d.debounce.poke(self.d.clock())  # who can serve which layers changed
        if sender in self.waiting:
            first, end = self.waiting[sender]
            num_layers = self._num_layers()
            if num_layers and self.covers(sender, first, end, num_layers):
                if self.replan_now is not None:
                    self.replan_now()  # the plan was waiting for exactly this
            elif (a.fetch or {}).get("target") != [first, end] and a.header:
                self._send_target(sender, first, end)  # lost, or it restarted

    def _on_target(self, sender: str, t: ShareTarget) -> None:
        if self.mode == "off":
            return
        if self.identity and t.identity != self.identity:
            log.info("share_target_ignored", peer=sender, identity=t.identity, ours=self.identity)
            return
        if self.target != (t.first, t.end) or self._fetch_task is None or self._fetch_task.done():
            log.info("share_target", leader=sender, first=t.first, end=t.end)
        self.set_target(int(t.first), int(t.end))

    def _send_target(self, nid: str, first: int, end: int) -> None:
        model = self.identity
        num_layers = self._num_layers()
        if nid == self.d.node_id:
            self.set_target(first, end)
        elif self.d.link is not None:
            self.d.link.send(nid, ShareTarget(model, first, end, num_layers))

    # ------------------------------------------------------------------ the leader's gate
    def covers(self, nid: str, first: int, end: int, num_layers: int) -> bool:
        if nid == self.d.node_id:
            h = self.holdings()
            whole_pending = self.mode == "whole" and not h.complete
        else:
            p = self.peers.get(nid)
            if p is None:
                return False
            h = p.holdings
            whole_pending = (p.advert.fetch or {}).get("mode") == "whole" and not h.complete
        if h.complete:
            return True
        if whole_pending or self.tensor_names is None:
            return False  # a whole-file fetch is planned once whole, like a download
        return h.covers(needed_tensors(self.tensor_names, num_layers, first, end))

    def gate(self, candidate, current, members: list[str], model: str, plan_over: Callable[[list[str]], Any]):
        """The plan to adopt now (None: keep the current one); sends fetch targets."""
        if not model or model != self.identity:
            self.waiting = {}
            return candidate  # model-less engines, or we cannot judge another model's files
        n = candidate.num_layers
        covers = lambda nid, f, e: self.covers(nid, f, e, n)  # noqa: E731
        targets: dict[str, tuple[int, int]] = {}
        ready = set(self.d.membership.ready_ids()) if self.d.membership else set()
        extra = sorted(nid for nid, p in self.peers.items() if nid not in members and nid in ready
                       and p.advert.identity == model and p.holdings.header)
        if self.d.node_id not in members and self.holdings().header:
            extra.append(self.d.node_id)  # the leader itself may be the one still loading
        if extra:  # members still loading the header: start their fetch for the plan they will join
            prospective = plan_over(sorted({*members, *extra}))
            targets.update({s.node_id: (s.first, s.end) for s in prospective.stages
                            if s.node_id in extra and not covers(s.node_id, s.first, s.end)})
        complete = [nid for nid in members if (self.holdings().complete if nid == self.d.node_id else
                                               nid in self.peers and self.peers[nid].holdings.complete)]
        decision = gate_plan(candidate, current, members, covers, plan_over, complete)
        targets.update(decision.waiting)
        if targets != self.waiting or decision.reason != self.wait_reason:
            log.info("plan_waits_for_fetch" if decision.waiting else "plan_fetch_targets",
                     waiting={k: list(v) for k, v in targets.items()}, reason=decision.reason,
                     keeping_current=decision.adopt is None)
        self.waiting, self.wait_reason = targets, decision.reason
        for nid, (f, e) in targets.items():
            self._send_target(nid, f, e)
        return decision.adopt

    # ------------------------------------------------------------------ serving pieces
    async def _handle(self, msg: Any, req) -> Any:
        m = self.manifest
        match msg:
            case ManifestRequest(sha256=sha):
                if m is None or m.sha256 != sha:
                    self.served["refused"] += 1
                    raise ShareError("not_held", f"no manifest for {str(sha)[:16]} here")
                self.served["manifests"] += 1
                return ManifestReply(sha, np.frombuffer(m.data, dtype=np.uint8))
            case PieceRequest(sha256=sha, index=i):
                if m is None or m.sha256 != sha:
                    self.served["refused"] += 1
                    raise ShareError("not_held", f"model {str(sha)[:16]} is not held here")
                if not 0 <= i < len(m.pieces):
                    self.served["refused"] += 1
                    raise ShareError("bad_request", f"piece {i} does not exist ({len(m.pieces)} pieces)")
                if not self._holds_piece(i):
                    self.served["refused"] += 1
                    raise ShareError("not_held", f"piece {i} is not held here")
                await self.up.take(m.pieces[i].length)
                data = await asyncio.to_thread(self._read_checked, i)
                self.served["pieces"] += 1
                self.served["bytes"] += len(data)
                return PieceReply(sha, i, np.frombuffer(data, dtype=np.uint8))
            case _:
                raise ShareError("unexpected", f"the share endpoint does not take {type(msg).__name__}")

    def _read_checked(self, i: int) -> bytes:
        m = self.manifest
        p = m.pieces[i]
        if self.local_path is not None:
            if self._local_fd is None:
                self._local_fd = os.open(self.local_path, os.O_RDONLY)
            data = os.pread(self._local_fd, p.length, p.offset)
        else:
            data = self.entry.read_piece(i)
        if hashlib.sha256(data).hexdigest() != p.sha256:
            log.error("share_local_corrupt", piece=i, tensor=m.regions[m.region_of_piece[i]].name,
                      path=str(self.local_path or self.entry.path))
            if self.entry is not None:
                self._loop.call_soon_threadsafe(self.entry.forget, [i])
            raise ShareError("corrupt_here", f"piece {i} is damaged on this device's disk; ask another member")
        return data

    # ------------------------------------------------------------------ status
    def status(self) -> dict[str, Any]:
        """What ``meshd status`` shows; no file paths (it reaches API clients; the log has them)."""
        h = self.holdings()
        m = self.manifest
        held = (m.size if h.complete else self.entry.held_bytes() if self.entry is not None else 0) if m else None
        fetch = self.fetch_progress()
        if self.fetch is not None:
            fetch.update(self.fetch.stats.to_dict())
        fetch["bytes_moved"] = self.moved["manifest_bytes"] + self.moved["piece_bytes"]
        fetch["fetched_bytes_total"] = self._fetched_before + (self.fetch.stats.fetched_bytes if self.fetch else 0)
        fetch["resumed_bytes"] = self.resumed_bytes
        by = dict(self._by_holder_before)
        for nid, n in (self.fetch.stats.by_holder.items() if self.fetch else ()):
            by[nid] = by.get(nid, 0) + n
        fetch["by_holder_total"] = by
        return {
            "mode": self.mode, "share_port": self.port,
            "rate_limit_mbit": round(self.rate * 8 / 1e6, 3) if self.rate else None,
            "model": self.identity or None, "sha256": m.sha256 if m else None,
            "size_bytes": m.size if m else None, "manifest": m.digest if m else None,
            "holds": {"complete": h.complete, "header": h.header, "layers": to_runs(h.layers),
                      "tensors": sorted(h.tensors), "bytes": held,
                      "fraction": round(held / m.size, 4) if m and held is not None else None},
            "fetch": fetch,
            "served": dict(self.served),
            "banned": dict(self.banned),
            "peers": {nid: {"model": p.advert.identity or None, "complete": p.holdings.complete,
                            "layers": to_runs(p.holdings.layers), "fetch": p.advert.fetch}
                      for nid, p in sorted(self.peers.items())},
            "plan_waits_for": {nid: list(r) for nid, r in sorted(self.waiting.items())},
        }


async def start_sharing(daemon, replan_now: Callable[[], None] | None = None) -> ShareService:
    service = ShareService(daemon, replan_now)
    await service.start()
    return service
