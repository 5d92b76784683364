"""A manifest from the model file(s) on disk: their layout, the manifest built in one read, a header check.

Only a member holding the whole file verified builds a manifest (:func:`build`): it
reads the GGUF header's tensor index (:func:`gguf_layout`; a split set's parts laid
end to end, :func:`set_layout`), cuts the file into regions (:func:`layout`) and
hashes every piece in one sequential read. A member that fetched a header checks the
manifest against it (:func:`check_against_header`). The manifest type and its wire
form are ``meshd.share.manifest``; this module is the part that reads files.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

from meshd.share.manifest import GAP, HEADER, PART_HEADER, PIECE_SIZE, Manifest, ManifestError, assemble, split

__all__ = ["build", "check_against_header", "gguf_layout", "layout", "set_layout"]


def layout(size: int, data_offset: int, tensors: Iterable[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    """``(name, offset, length)`` regions covering ``[0, size)``: header, tensors in file order, gaps.

    Raises ManifestError when tensors overlap, start inside the header, or run past the end.
    """
    if not 0 < data_offset <= size:
        raise ManifestError(f"data offset {data_offset} outside a {size}-byte file")
    out = [(HEADER, 0, data_offset)]
    pos = data_offset
    for name, off, n in sorted(tensors, key=lambda t: t[1]):
        if n <= 0 or off < pos or off + n > size:
            raise ManifestError(f"tensor {name} at [{off}, {off + n}) overlaps or leaves the file")
        if off > pos:
            out.append((GAP, pos, off - pos))
        out.append((name, off, n))
        pos = off + n
    if pos < size:
        out.append((GAP, pos, size - pos))
    return out


def gguf_layout(path: Path, reader=None) -> tuple[int, list[tuple[str, int, int]]]:
    """(data offset, [(tensor name, absolute offset, bytes)]) as the GGUF header states them.

    ``reader``: ``path``'s parsed header (``decoding.loader.gguf_file.GGUFFile``), when the caller has it.
    """
    from decoding.errors import ModelLoadError
    from decoding.loader.gguf_file import GGUFFile

    try:
        reader = reader or GGUFFile(path)
    except ModelLoadError as exc:
        raise ManifestError(str(exc)) from exc
    tensors = [(t.name, int(t.data_offset), int(t.n_bytes)) for t in reader.tensors]
    if not tensors:
        raise ManifestError(f"{path}: GGUF has no tensors")
    return min(off for _, off, _ in tensors), tensors


def set_layout(paths: list[Path], readers=None) -> tuple[int, list[tuple[str, int, int]], list[tuple[str, int]]]:
    """(size, regions, parts) of files laid one after the other: each file's own layout moved to
    where it starts, its header named ``@header`` (first) or ``@header:N``; parts: () for one file."""
    readers = readers or [None] * len(paths)
    spans, parts, base = [], [], 0
    for i, (p, r) in enumerate(zip(paths, readers)):
        size = Path(p).stat().st_size
        data_offset, tensors = gguf_layout(Path(p), r)
        own = layout(size, data_offset, tensors)
        head = HEADER if i == 0 else f"{PART_HEADER}{i + 1}"
        spans += [(head if n == HEADER else n, base + o, ln) for n, o, ln in own]
        parts.append((Path(p).name, size))
        base += size
    return base, spans, parts if len(paths) > 1 else []


def build(path: Path, piece_size: int = PIECE_SIZE, name: str | None = None, reader=None,
          parts: tuple[Path, ...] | None = None, readers=None) -> Manifest:
    """The manifest of a whole local GGUF file (or of a split set's ``parts``, ``path`` first), in one
    sequential read."""
    path = Path(path)
    files = [Path(p) for p in parts] if parts and len(parts) > 1 else [path]
    size, spans, part_list = set_layout(files, readers if len(files) > 1 else [reader])
    cuts = split(spans, piece_size)
    whole = hashlib.sha256()
    region_h = [hashlib.sha256() for _ in spans]
    piece_shas = []
    handles = [open(f, "rb") for f in files]
    bases = [0]
    for f in files[:-1]:
        bases.append(bases[-1] + f.stat().st_size)
    try:
        for ri, off, n in cuts:
            k = max(i for i, b in enumerate(bases) if b <= off)
            handles[k].seek(off - bases[k])
            block = handles[k].read(n)
            if len(block) != n:
                raise ManifestError(f"{files[k]}: file changed while building its manifest")
            whole.update(block)
            region_h[ri].update(block)
            piece_shas.append(hashlib.sha256(block).hexdigest())
    finally:
        for h in handles:
            h.close()
    return assemble(name or files[0].name, whole.hexdigest(), size, piece_size,
                    [(n, o, ln, h.hexdigest()) for (n, o, ln), h in zip(spans, region_h)], piece_shas, part_list)


def check_against_header(manifest: Manifest, path: Path, reader=None, parts=None, readers=None) -> None:
    """The manifest's tensor regions are exactly what the (fetched, verified) header says
    (every part's header, for a split set: ``parts`` and their ``readers``).

    The header bytes were checked against the manifest; this closes the loop, so a
    manifest cannot point a loader at bytes its own header does not describe.
    """
    files = [Path(p) for p in parts] if parts and len(parts) > 1 else [Path(path)]
    if [f.name for f in files] != [p.name for p in manifest.files]:
        raise ManifestError(f"{manifest.identity}: the files on disk are not the manifest's")
    _, want, _ = set_layout(files, readers if len(files) > 1 else [reader])
    got = [(r.name, r.offset, r.length) for r in manifest.regions]
    if want != got:
        raise ManifestError(f"{manifest.identity}: the manifest's regions do not match the file's header")
