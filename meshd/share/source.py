"""A GGUF model source over a cached (possibly partial) file: it reads only what was verified.

The file has the original layout, so the ordinary GGUF reader parses its
header and finds every tensor where it always is. What this adds:

- a tensor whose pieces are not on disk raises ``ModelLoadError`` naming it
  (a hole in a sparse file reads as zeros: a loader must never see those);
- every tensor is checked against its manifest digest before first use, so a
  byte that went bad on disk is caught (its pieces are dropped from the record
  and fetched again by the next ``load_stage``);
- ``load_stage(first, end)`` first asks ``ensure(first, end)`` (the sharing
  service: fetch what the range needs, blocking) when one is given;
- the identity is the original file's (name@sha256 prefix), not a hash of the
  sparse file.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

import torch

from decoding.errors import ModelLoadError
from decoding.loader.gguf_source import GGUFSource
from meshd.share.manifest import ManifestError, needed_tensors
from meshd.share.manifest_build import check_against_header
from meshd.share.store import CachedModel


class TensorCorrupt(ModelLoadError):
    """A fetched tensor's bytes on disk no longer match the manifest (its pieces were dropped: fetch them again)."""


class PartialGGUFSource(GGUFSource):
    def __init__(self, entry: CachedModel, cache_root: Path | None = None,
                 ensure: Callable[[int, int], None] | None = None):
        if not entry.has_headers():
            raise ModelLoadError(f"{entry.path}: the header has not been fetched yet")
        super().__init__(entry.path, cache_root=cache_root)
        try:
            check_against_header(entry.manifest, entry.path, self.gguf_files[0], self.parts, self.gguf_files)
        except ManifestError as exc:
            raise ModelLoadError(str(exc)) from None
        self.entry = entry
        self.ensure = ensure
        self._verified: set[str] = set()
        self._gguf_name = {canon: t.name for canon, t in self._tensors.items()}

    @property
    def identity(self) -> str:  # type: ignore[override]
        return self.entry.manifest.identity

    def _cache_dir(self) -> Path | None:
        """Keyed by the model's digest: the sparse file's mtime changes with every piece."""
        if self._cache_root is None:
            return None
        return self._cache_root / f"{self.path.stem}-{self.entry.manifest.sha256[:16]}"

    def needed(self, first: int, end: int) -> set[str]:
        return needed_tensors(self.entry.manifest.tensor_names, self.config.num_layers, first, end)

    def missing(self, first: int, end: int) -> set[str]:
        held = self.entry.held_regions()
        return {n for n in self.needed(first, end) if n not in held}

    def read_tensor(self, name: str) -> torch.Tensor:
        self._verify(name)
        return super().read_tensor(name)

    def read_int4_groups(self, name: str):
        self._verify(name)
        return super().read_int4_groups(name)

    def read_int8_planes(self, name: str):
        self._verify(name)
        return super().read_int8_planes(name)

    def read_row_blocks(self, name: str):
        self._verify(name)
        return super().read_row_blocks(name)

    def _verify(self, name: str) -> None:
        """Refuse a tensor that is not all here, or whose bytes do not match its digest (once per tensor)."""
        gname = self._gguf_name.get(name)
        if gname is not None and gname not in self._verified:
            region = self.entry.manifest.by_name[gname]
            if not all(i in self.entry.have for i in region.piece_range):
                raise ModelLoadError(f"{self.path}: tensor {gname} ({name}) has not been fetched to this "
                                     f"device; only verified tensors can be loaded")
            t = self._tensors[name]
            if hashlib.sha256(memoryview(t.data).cast("B")).hexdigest() != region.sha256:
                self.entry.forget(region.piece_range)
                raise TensorCorrupt(f"{self.path}: tensor {gname} does not match its digest on disk; "
                                     f"its pieces will be fetched again")
            self._verified.add(gname)

    def load_stage(self, first: int, end: int, dtype: torch.dtype = torch.float32,
                   device: torch.device | str | None = None, packed: str | bool = ""):
        """Fetch what ``[first, end)`` lacks (if a fetcher is attached), then load it; one retry
        after a tensor failed its digest on disk (it was dropped and is fetched again)."""
        for attempt in (1, 2):
            if self.ensure is not None and self.missing(first, end):
                self.ensure(first, end)
            try:
                return super().load_stage(first, end, dtype, device, packed)
            except TensorCorrupt:
                if attempt == 2 or self.ensure is None:
                    raise
        raise AssertionError("unreachable")
