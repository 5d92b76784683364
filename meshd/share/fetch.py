"""Fetching a model's pieces from the members that hold them: in parallel, verified, resumable.

Each holder gets a few requests in flight (``per_holder``); every worker takes
the first missing piece its holder has, so pieces stream in file order and a
faster holder simply takes more of them. A piece is written only after its
sha256 matched the manifest; the cache records it (``CachedModel.mark``), so a
fetch that is interrupted resumes where its last record left off.

Failures, by kind:

- a piece that fails its digest: the holder that sent it is logged
  (``share_peer_corrupt``) and never asked again (``banned``); the piece goes
  back to the queue for the others;
- a timeout or transport error: the piece goes back; after ``MAX_FAILURES`` in a
  row the holder rests for ``COOLDOWN_S``;
- nobody holds what is still missing for ``stall_s``: :class:`NoHolder`, naming
  the tensors.

``--share-rate`` is a shared token bucket: each request waits for its bytes
before it is sent, however many holders there are.
"""

from __future__ import annotations

import asyncio
import bisect
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from meshd.errors import MeshdError
from meshd.log import get_logger
from meshd.share.store import CachedModel, PieceCorrupt
from meshd.share.throttle import AsyncLimiter
from transport.errors import TransportError
from partition.ids import NodeId

log = get_logger("meshd.share.fetch")

MAX_FAILURES = 3
COOLDOWN_S = 5.0


class NoHolder(MeshdError):
    """No reachable member holds pieces this device still needs."""


@dataclass
class Holder:
    node_id: NodeId
    has: Callable[[int], bool]  # does it hold piece i (from its advert)
    get: Callable[[int], Awaitable[bytes]]  # request piece i


@dataclass
class FetchStats:
    wanted_bytes: int = 0
    had_bytes: int = 0  # already on disk when the fetch started (resumed)
    fetched_bytes: int = 0  # received and verified by this fetch
    pieces: int = 0
    corrupt: int = 0
    retries: int = 0
    by_holder: dict[str, int] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)
    finished: float | None = None

    @property
    def done_bytes(self) -> int:
        return self.had_bytes + self.fetched_bytes

    def seconds(self) -> float:
        return (self.finished or time.monotonic()) - self.started

    def to_dict(self) -> dict:
        secs = self.seconds()
        rate = self.fetched_bytes / secs if secs > 0 else 0.0
        left = self.wanted_bytes - self.done_bytes
        return {
            "wanted_bytes": self.wanted_bytes, "done_bytes": self.done_bytes, "had_bytes": self.had_bytes,
            "fetched_bytes": self.fetched_bytes, "pieces": self.pieces, "corrupt_pieces": self.corrupt,
            "retries": self.retries, "by_holder": dict(self.by_holder), "seconds": round(secs, 3),
            "rate_mbit": round(rate * 8 / 1e6, 2),
            "progress": round(self.done_bytes / self.wanted_bytes, 4) if self.wanted_bytes else 1.0,
            "eta_s": round(left / rate, 1) if rate > 0 and left > 0 and self.finished is None else None,
        }


class Fetch:
    def __init__(self, entry: CachedModel, wanted: list[int], holders: Callable[[], dict[str, Holder]],
                 limiter: AsyncLimiter | None = None, banned: dict[str, str] | None = None,
                 per_holder: int = 4, stall_s: float = 30.0, piece_timeout_s: float = 60.0):
        self.entry = entry
        self.wanted = sorted(set(wanted))
        self.holders = holders
        self.limiter = limiter or AsyncLimiter(None, 1)
        self.banned = banned if banned is not None else {}
        self.per_holder = per_holder
        self.stall_s = stall_s
        self.piece_timeout_s = piece_timeout_s
        m = entry.manifest
        self.stats = FetchStats(wanted_bytes=m.bytes_of(self.wanted),
                                had_bytes=m.bytes_of(i for i in self.wanted if i in entry.have))
        self._pending = [i for i in self.wanted if i not in entry.have]
        self._in_flight: set[int] = set()
        self._failures: dict[str, int] = {}
        self._resting: dict[str, float] = {}
        self._workers: dict[str, set[asyncio.Task]] = {}
        self._wake = asyncio.Event()

    def _take(self, h: Holder) -> int | None:
        if h.node_id in self.banned:
            return None
        for k, i in enumerate(self._pending):
            if h.has(i):
                del self._pending[k]
                self._in_flight.add(i)
                return i
        return None

    def _give_back(self, i: int) -> None:
        self._in_flight.discard(i)
        bisect.insort(self._pending, i)

    async def run(self) -> FetchStats:
        """Fetch every wanted piece not yet on disk; raises NoHolder when the rest cannot be had."""
        last_progress = time.monotonic()
        done = self.stats.pieces
        try:
            while self._pending or self._in_flight:
                now = time.monotonic()
                holders = self.holders()
                for nid in [n for n in self._workers if n not in holders and self._workers[n]]:
                    for t in self._workers[nid]:  # it left the home: its pieces go back to the others now
                        t.cancel()
                for nid, h in holders.items():
                    if nid in self.banned or self._resting.get(nid, 0.0) > now:
                        continue
                    tasks = self._workers.setdefault(nid, set())
                    if len(tasks) < self.per_holder and self._has_any(h):
                        for _ in range(self.per_holder - len(tasks)):
                            t = asyncio.create_task(self._work(h), name=f"share-fetch-{nid}")
                            tasks.add(t)
                            t.add_done_callback(tasks.discard)
                if self.stats.pieces != done:
                    done, last_progress = self.stats.pieces, now
                elif now - last_progress > self.stall_s and not self._in_flight:
                    raise NoHolder(self._stall_message())
                self._wake.clear()
                # asyncio.timeout, not wait_for: on 3.11, wait_for can swallow a cancel that lands
                # as the wait completes, and a cancelled fetch then kept looping forever.
                try:
                    async with asyncio.timeout(0.25):
                        await self._wake.wait()
                except TimeoutError:
                    pass
        finally:
            workers = [t for ts in self._workers.values() for t in ts]
            for t in workers:
                t.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
            self.stats.finished = time.monotonic()
            self.entry.flush()
        return self.stats

    def _has_any(self, h: Holder) -> bool:
        return any(h.has(i) for i in self._pending)

    def _stall_message(self) -> str:
        m = self.entry.manifest
        names = sorted({m.regions[m.region_of_piece[i]].name for i in self._pending})
        shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
        banned = f"; not asking {', '.join(sorted(self.banned))} (sent corrupt pieces)" if self.banned else ""
        return (f"no reachable member holds {len(self._pending)} piece(s) of {m.identity} this device "
                f"needs ({shown}) for {self.stall_s:g} s{banned}")

    async def _work(self, h: Holder) -> None:
        while True:
            i = self._take(h)
            if i is None:
                return
            piece = self.entry.manifest.pieces[i]
            try:
                await self.limiter.take(piece.length)
                async with asyncio.timeout(self.piece_timeout_s):
                    data = await h.get(i)
                await asyncio.to_thread(self.entry.write_piece, i, data)
            except PieceCorrupt as exc:
                self._give_back(i)
                self.stats.corrupt += 1
                m = self.entry.manifest
                self.banned[h.node_id] = f"sent piece {i} ({m.regions[m.region_of_piece[i]].name}) " \
                                         f"that failed its sha256"
                log.warning("share_peer_corrupt", peer=h.node_id, piece=i,
                            tensor=m.regions[m.region_of_piece[i]].name, error=str(exc))
                self._wake.set()
                return
            except (TransportError, MeshdError, asyncio.TimeoutError, OSError) as exc:
                self._give_back(i)
                self.stats.retries += 1
                n = self._failures[h.node_id] = self._failures.get(h.node_id, 0) + 1
                log.info("share_piece_failed", peer=h.node_id, piece=i, failures=n,
                         error=f"{type(exc).__name__}: {exc}")
                self._wake.set()
                if n >= MAX_FAILURES:
                    self._resting[h.node_id] = time.monotonic() + COOLDOWN_S
                    self._failures[h.node_id] = 0
                    return
                continue
            except BaseException:
                self._give_back(i)
                raise
            self._in_flight.discard(i)
            self._failures[h.node_id] = 0
            self.entry.mark(i)
            self.stats.pieces += 1
            self.stats.fetched_bytes += piece.length
            self.stats.by_holder[h.node_id] = self.stats.by_holder.get(h.node_id, 0) + piece.length
            self._wake.set()
