"""The shared-model cache in the state dir: one directory per model digest.

    models/<sha256 of the file>/
        <file name>            the model, same size and layout as the original; a
                               sparse file while partial (only fetched pieces filled);
                               a split set: each of its parts, named as they are
        share-manifest.json    the manifest, byte for byte as received (its digest)
        share-state.json       which pieces are on disk and verified (as runs), whether
                               the whole file was verified, the last fetch target

A piece is recorded only after its bytes matched the manifest and were written;
the record is flushed (data fsync'd first) at most every ``FLUSH_EVERY_S`` and at
the end of a fetch, so an interrupted fetch resumes from its last flush and at
worst refetches a few pieces. Because the file keeps the original layout, the
ordinary GGUF reader opens it unchanged; ``meshd.share.source`` makes sure it
only reads what is recorded here.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import time
from pathlib import Path

from meshd.errors import MeshdError
from meshd.log import get_logger
from meshd.share.gate import Holdings, holdings_of
from meshd.share.manifest import Manifest, ManifestError
from meshd.share.runs import from_runs, to_runs
from meshd.state import atomic_write

log = get_logger("meshd.share.store")

MANIFEST_FILE = "share-manifest.json"
STATE_FILE = "share-state.json"
FLUSH_EVERY_S = 0.5


class PieceCorrupt(MeshdError):
    """A piece's bytes do not match the manifest's digest."""


class CachedModel:
    """One model in the cache: a (possibly sparse) file and what of it is verified."""

    def __init__(self, directory: Path, manifest: Manifest, have: set[int], complete: bool,
                 target: tuple[int, int] | None):
        self.dir = Path(directory)
        self.manifest = manifest
        self.have = have
        self.complete = complete
        self.target = target
        self._fds: dict[int, int] = {}
        self._lock = threading.Lock()  # the file descriptors
        self._state = threading.RLock()  # ``have`` and its record (the loop, loaders and readers share them)
        self._dirty = False
        self._flushed_at = 0.0

    @property
    def path(self) -> Path:
        return self.dir / self.manifest.name

    @property
    def paths(self) -> tuple[Path, ...]:
        """Every file of the model (a split set's parts, in order; else just ``path``)."""
        return tuple(self.dir / p.name for p in self.manifest.files)

    # -- opening ------------------------------------------------------------
    @classmethod
    def create(cls, root: Path, manifest: Manifest) -> CachedModel:
        d = Path(root) / manifest.sha256
        d.mkdir(parents=True, exist_ok=True)
        atomic_write(d / MANIFEST_FILE, manifest.data, mode=0o644)
        for part in manifest.files:
            with open(d / part.name, "ab") as f:  # sparse: size without blocks
                f.truncate(part.size)
        entry = cls(d, manifest, set(), False, None)
        entry.flush(force=True)
        return entry

    @classmethod
    def open(cls, directory: Path) -> CachedModel:
        """Reopen an entry; an unreadable record means nothing is trusted (all refetched)."""
        d = Path(directory)
        try:
            manifest = Manifest.from_data((d / MANIFEST_FILE).read_bytes())
        except (OSError, ManifestError) as exc:
            raise ManifestError(f"{d}: no usable manifest ({exc})") from None
        if d.name != manifest.sha256:
            raise ManifestError(f"{d}: directory name does not match the manifest's sha256")
        have, complete, target = set(), False, None
        try:
            state = json.loads((d / STATE_FILE).read_text())
            have = from_runs(state.get("have", []), len(manifest.pieces))
            complete = bool(state.get("complete", False))
            t = state.get("target")
            target = (int(t[0]), int(t[1])) if t else None
        except (OSError, ValueError, TypeError, IndexError) as exc:
            log.warning("share_state_unreadable", dir=str(d), error=str(exc))
        for part in manifest.files:
            path = d / part.name
            if not path.is_file() or path.stat().st_size != part.size:
                have, complete = set(), False
                with open(path, "ab") as f:
                    f.truncate(part.size)
        if complete:
            have = set(range(len(manifest.pieces)))
        return cls(d, manifest, have, complete, target)

    # -- writing --------------------------------------------------------------
    def _file(self, index: int = 0) -> int:
        with self._lock:
            if index not in self._fds:
                self._fds[index] = os.open(self.dir / self.manifest.files[index].name, os.O_RDWR)
            return self._fds[index]

    def _at(self, offset: int) -> tuple[int, int]:
        """(descriptor, offset in its file) of a byte of the model (pieces never straddle files)."""
        index, local = self.manifest.file_at(offset)
        return self._file(index), local

    def check_piece(self, index: int, data: bytes) -> None:
        p = self.manifest.pieces[index]
        if len(data) != p.length or hashlib.sha256(data).hexdigest() != p.sha256:
            raise PieceCorrupt(f"piece {index} of {self.manifest.identity} does not match its digest")

    def write_piece(self, index: int, data: bytes) -> None:
        """Verify then write one piece (thread-safe; call :meth:`mark` on the loop afterwards)."""
        self.check_piece(index, data)
        fd, local = self._at(self.manifest.pieces[index].offset)
        os.pwrite(fd, data, local)

    def mark(self, index: int) -> None:
        with self._state:
            self.have.add(index)
            self._dirty = True
            if time.monotonic() - self._flushed_at >= FLUSH_EVERY_S:
                self.flush()

    def forget(self, pieces) -> None:
        """Drop pieces from the record (found bad on disk): they will be fetched again."""
        with self._state:
            self.have.difference_update(pieces)
            self.complete = False
            self._dirty = True
            self.flush()

    def set_target(self, target: tuple[int, int] | None) -> None:
        with self._state:
            if target != self.target:
                self.target = target
                self._dirty = True
                self.flush()

    def flush(self, force: bool = False) -> None:
        """Data to disk first, then the record that vouches for it."""
        with self._state:
            if not (self._dirty or force):
                return
            for fd in list(self._fds.values()):
                os.fsync(fd)
            state = {"have": to_runs(self.have), "complete": self.complete,
                     "target": list(self.target) if self.target else None}
            atomic_write(self.dir / STATE_FILE, json.dumps(state).encode(), mode=0o644)
            self._dirty = False
            self._flushed_at = time.monotonic()

    def close(self) -> None:
        with self._lock:
            if self._fds:
                try:
                    self.flush()
                finally:
                    for fd in self._fds.values():
                        os.close(fd)
                    self._fds = {}

    # -- reading ----------------------------------------------------------------
    def read_piece(self, index: int) -> bytes:
        if index not in self.have:
            raise KeyError(f"piece {index} is not held")
        p = self.manifest.pieces[index]
        fd, local = self._at(p.offset)
        return os.pread(fd, p.length, local)

    def verify_whole(self) -> bool:
        """All pieces held and the file's sha256 right: mark it complete."""
        if len(self.have) != len(self.manifest.pieces):
            return False
        from decoding.loader.files import sha256_of_files

        ok = sha256_of_files(self.paths) == self.manifest.sha256
        if ok and not self.complete:
            self.complete = True
            self._dirty = True
            self.flush()
        return ok

    # -- summaries ------------------------------------------------------------------
    def held_regions(self) -> set[str]:
        with self._state:
            return {r.name for r in self.manifest.regions_within(self.have)}

    def holdings(self) -> Holdings:
        held = self.held_regions()
        return holdings_of(self.manifest.tensor_names, held, self.manifest.headers_in(held), self.complete)

    def has_headers(self) -> bool:
        """Every file's header is here, verified (a reader can parse the model)."""
        return self.manifest.headers_in(self.held_regions())

    def held_bytes(self) -> int:
        with self._state:
            return self.manifest.bytes_of(self.have)

    def describe(self) -> dict:
        h = self.holdings()
        return {
            "name": self.manifest.name, "identity": self.manifest.identity, "sha256": self.manifest.sha256,
            "path": str(self.path), "size_bytes": self.manifest.size, "held_bytes": self.held_bytes(),
            "complete": self.complete, "layers": to_runs(h.layers), "tensors": sorted(h.tensors),
            "disk_bytes": _disk_bytes(self.dir),
        }


def _disk_bytes(d: Path) -> int:
    total = 0
    for p in d.iterdir():
        try:
            total += p.stat().st_blocks * 512
        except OSError:
            pass
    return total


class ModelCache:
    """``state_dir/models``: the cached (whole or partial) models, by sha256."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def entries(self) -> list[CachedModel]:
        out = []
        if self.root.is_dir():
            for d in sorted(self.root.iterdir()):
                if d.is_dir() and (d / MANIFEST_FILE).is_file():
                    try:
                        out.append(CachedModel.open(d))
                    except ManifestError as exc:
                        log.warning("share_cache_entry_unusable", dir=str(d), error=str(exc))
        return out

    def get(self, sha256: str) -> CachedModel | None:
        d = self.root / sha256
        if not (d / MANIFEST_FILE).is_file():
            return None
        try:
            return CachedModel.open(d)
        except ManifestError as exc:
            log.warning("share_cache_entry_unusable", dir=str(d), error=str(exc))
            return None

    def most_recent(self) -> CachedModel | None:
        """The entry whose record changed last (the model this device ran most recently)."""
        entries = self.entries()
        return max(entries, key=lambda e: (e.dir / STATE_FILE).stat().st_mtime
                   if (e.dir / STATE_FILE).exists() else 0.0, default=None)

    def create(self, manifest: Manifest) -> CachedModel:
        return self.get(manifest.sha256) or CachedModel.create(self.root, manifest)

    def remove(self, sha256: str) -> int:
        """Delete an entry; returns the bytes it used on disk."""
        d = self.root / sha256
        if not d.is_dir() or not (d / MANIFEST_FILE).is_file():
            return 0
        used = _disk_bytes(d)
        shutil.rmtree(d)
        return used
