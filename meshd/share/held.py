"""What this device holds of the model: a whole local file, or a cache entry filling in piece by piece.

One object owns it, so the endpoint lending pieces, the fetcher filling the
cache and the leader judging coverage all read the same facts. A local file's
manifest is built once, in the background, and cached by path, size and mtime
(a model file of gigabytes takes a while to hash); until it is there, nothing
is lent.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from meshd.log import get_logger
from meshd.share import manifest as mf
from meshd.share import manifest_build as mb
from meshd.share.deps import ShareError
from meshd.share.gate import NOTHING, Holdings
from meshd.share.manifest import Manifest, ManifestError
from meshd.share.store import CachedModel, ModelCache

log = get_logger("meshd.share")

LOCAL_MANIFESTS = ".local-manifests"  # under the cache root: manifests of local files, by path/size/mtime


class HeldModel:
    def __init__(self, cache: ModelCache):
        self.cache = cache
        self.source: Any = None  # the model source serving uses, once there is one
        self.local_path: Path | None = None  # a whole local file outside the cache (a split set's first part)
        self.local_parts: tuple[Path, ...] = ()  # every file of a local split set (its parts); () for one file
        self._local_readers: list[Any] = []
        self.manifest: Manifest | None = None
        self.entry: CachedModel | None = None  # the cache entry of a model fetched from the home
        self.tensor_names: tuple[str, ...] | None = None
        self.resumed_bytes = 0  # verified bytes the cache already held when this daemon started
        self._local_fds: dict[int, int] = {}

    # -- facts ----------------------------------------------------------------
    @property
    def identity(self) -> str:
        if self.source is not None:
            return str(getattr(self.source, "identity", "") or "")
        return self.manifest.identity if self.manifest is not None else ""

    @property
    def num_layers(self) -> int:
        if self.manifest is not None:
            return self.manifest.num_layers
        cfg = getattr(self.source, "config", None)
        return int(getattr(cfg, "num_layers", 0) or 0)

    @property
    def complete(self) -> bool:
        return self.holdings().complete

    def holdings(self) -> Holdings:
        if self.local_path is not None or (self.source is not None and self.entry is None):
            return Holdings(complete=True, header=True)
        if self.entry is not None:
            return self.entry.holdings()
        return NOTHING

    def held_bytes(self) -> int | None:
        m = self.manifest
        if m is None:
            return None
        return m.size if self.holdings().complete else self.entry.held_bytes() if self.entry is not None else 0

    def holds_piece(self, i: int) -> bool:
        return self.local_path is not None or (self.entry is not None and i in self.entry.have)

    # -- a local file -----------------------------------------------------------
    def adopt_local(self, source: Any) -> Any | None:
        """Serve from ``source``; returns its first file's parsed GGUF header when its file can be lent
        (None: only GGUF is)."""
        self.source = source
        path = Path(getattr(source, "path", ""))
        readers = list(getattr(source, "gguf_files", ()) or ())  # decoding.loader.gguf_file.GGUFFile
        reader = readers[0] if readers else None
        if reader is None or not path.is_file():
            log.info("share_not_shareable", model=str(path), reason="only GGUF files are shared")
            return None
        self.local_path = path
        parts = tuple(getattr(source, "parts", ()) or ())
        if len(parts) > 1 and len(readers) == len(parts):  # a split set: lent as one model
            self.local_parts, self._local_readers = parts, readers
        self.tensor_names = tuple(t.name for r in (self._local_readers or [reader]) for t in r.tensors)
        return reader

    async def build_local_manifest(self, identity: str, reader: Any = None,
                                   before_building: Callable[[], Awaitable[None]] | None = None) -> bool:
        """Build (once; cached by path, size and mtime) the manifest this device lends from;
        ``before_building`` is awaited before a build (not before reading the kept one)."""
        path = self.local_path
        files = self.local_parts or (path,)
        stamp = ";".join(f"{p.resolve()}:{st.st_size}:{st.st_mtime_ns}" for p in files for st in [p.stat()])
        key = hashlib.sha256(stamp.encode()).hexdigest()[:24]
        cached = self.cache.root / LOCAL_MANIFESTS / f"{key}.json"
        try:
            try:
                m = Manifest.from_data(cached.read_bytes())
            except (OSError, ManifestError):
                if before_building is not None:
                    await before_building()
                m = await asyncio.to_thread(mb.build, path, mf.PIECE_SIZE, None, reader,
                                            self.local_parts or None, self._local_readers or None)
                from meshd.state import atomic_write

                atomic_write(cached, m.data, mode=0o644)
        except (OSError, ManifestError) as exc:
            log.warning("share_manifest_failed", model=str(path), error=str(exc))
            return False
        if m.identity != identity:
            log.error("share_manifest_mismatch", model=str(path), manifest=m.identity, identity=identity)
            return False
        self.manifest = m
        log.info("share_manifest_ready", identity=m.identity, pieces=len(m.pieces), digest=m.digest[:16])
        return True

    # -- a cache entry --------------------------------------------------------------
    def adopt_entry(self, entry: CachedModel) -> None:
        self.entry, self.manifest = entry, entry.manifest
        self.tensor_names = entry.manifest.tensor_names
        self.resumed_bytes = entry.held_bytes()

    # -- reading pieces to lend -------------------------------------------------------
    def read_checked(self, i: int, loop: asyncio.AbstractEventLoop) -> bytes:
        """Piece ``i`` from disk, refused unless it still matches the manifest (a worker thread calls it)."""
        m = self.manifest
        p = m.pieces[i]
        if self.local_path is not None:
            k, local = m.file_at(p.offset)
            if k not in self._local_fds:
                self._local_fds[k] = os.open((self.local_parts or (self.local_path,))[k], os.O_RDONLY)
            data = os.pread(self._local_fds[k], p.length, local)
        else:
            data = self.entry.read_piece(i)
        if hashlib.sha256(data).hexdigest() != p.sha256:
            log.error("share_local_corrupt", piece=i, tensor=m.regions[m.region_of_piece[i]].name,
                      path=str(self.local_path or self.entry.path))
            if self.entry is not None:
                loop.call_soon_threadsafe(self.entry.forget, [i])
            raise ShareError("corrupt_here", f"piece {i} is damaged on this device's disk; ask another member")
        return data

    def close(self) -> None:
        if self.entry is not None:
            self.entry.close()
        for fd in self._local_fds.values():
            os.close(fd)
        self._local_fds = {}
