"""A model file's digest manifest: enough to fetch and verify any part of the file from anyone.

Built once, by a member holding the whole file verified, in one read
(``meshd.share.manifest_build``): the file
is cut into *regions* — the header (metadata and tensor index, up to the first
tensor's bytes), each tensor's bytes, and any gap between them — and each
region into *pieces* of at most ``piece_size`` bytes. Every piece, region and
the whole file carry their sha256.

Why both levels: a fetcher checks each piece as it arrives, so it knows which
member sent a bad byte and refetches one piece, not a tensor; a loader checks
each tensor before using it, which also catches a byte that went bad on disk
after it was fetched. Pieces never straddle regions, so the pieces of a layer
range are exactly the pieces of its tensors.

The manifest is canonical JSON: every member that builds it from the same file
gets the same bytes, so its sha256 (``digest``) is what members compare.

A split GGUF set (``NAME-0000i-of-0000N.gguf``, ``decoding.loader.gguf_split``) is shared
as one model: the manifest describes the parts' bytes one after the other, as if they
were one file (``parts`` lists each part's name and size; its sha256 is the model's
identity hash), and each part's header is a region of its own (``@header`` for the
first, ``@header:2`` … for the others). Regions never straddle parts, so no piece does.
A single file's manifest has no ``parts`` and is byte for byte what it always was.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property

from meshd.errors import MeshdError

FORMAT = 1
PIECE_SIZE = 1 << 20  # 1 MiB: a piece is one request; big enough to amortise a round trip
MAX_PIECE_SIZE = 16 << 20  # a manifest asking for larger pieces is refused (bounds our memory)
HEADER = "@header"
PART_HEADER = "@header:"  # + the part's number (2 …): the header of a later part of a split set
GAP = "@gap"
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


class ManifestError(MeshdError):
    """A manifest that is malformed or does not describe the file it claims to."""


@dataclass(frozen=True)
class Piece:
    offset: int
    length: int
    sha256: str


@dataclass(frozen=True)
class Region:
    name: str  # a GGUF tensor name, HEADER, or GAP
    offset: int
    length: int
    sha256: str
    first_piece: int
    pieces: int

    @property
    def end(self) -> int:
        return self.offset + self.length

    @property
    def piece_range(self) -> range:
        return range(self.first_piece, self.first_piece + self.pieces)

    @property
    def is_tensor(self) -> bool:
        return not self.name.startswith("@")


@dataclass(frozen=True)
class Part:
    """One file of a split set, at ``offset`` in the manifest's concatenation of the parts."""

    name: str
    offset: int
    size: int

    @property
    def end(self) -> int:
        return self.offset + self.size


@dataclass(frozen=True)
class Manifest:
    name: str  # the file's name (part of the model identity); a split set's first part
    sha256: str  # the whole file (a split set: its parts' bytes in order)
    size: int
    piece_size: int
    regions: tuple[Region, ...]
    pieces: tuple[Piece, ...]
    parts: tuple[Part, ...] = ()  # a split set's files, in order; () for a single file

    # -- identity ---------------------------------------------------------
    @property
    def identity(self) -> str:
        """The identity heartbeats and plans carry (the same as ``GGUFSource.identity``)."""
        return f"{self.name}@{self.sha256[:16]}"

    @cached_property
    def data(self) -> bytes:
        """The canonical bytes (what travels and what ``digest`` hashes)."""
        doc = {
            "format": FORMAT, "name": self.name, "sha256": self.sha256, "size": self.size,
            "piece_size": self.piece_size,
            "regions": [[r.name, r.offset, r.length, r.sha256] for r in self.regions],
            "pieces": [p.sha256 for p in self.pieces],
        }
        if self.parts:
            doc["parts"] = [[p.name, p.size] for p in self.parts]
        return json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()

    @cached_property
    def digest(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    # -- lookups ------------------------------------------------------------
    @cached_property
    def by_name(self) -> dict[str, Region]:
        return {r.name: r for r in self.regions if r.name != GAP}

    @property
    def header(self) -> Region:
        return self.regions[0]

    @cached_property
    def files(self) -> tuple[Part, ...]:
        """The files this manifest describes: a split set's parts, or the one file."""
        return self.parts or (Part(self.name, 0, self.size),)

    @cached_property
    def header_regions(self) -> tuple[Region, ...]:
        """Every file's header (one for a single file): what a reader must have before anything."""
        return tuple(r for r in self.regions if r.name == HEADER or r.name.startswith(PART_HEADER))

    @cached_property
    def header_pieces(self) -> frozenset[int]:
        return frozenset(i for r in self.header_regions for i in r.piece_range)

    def headers_in(self, held: set[str]) -> bool:
        """Are all the files' headers among the ``held`` region names?"""
        return all(r.name in held for r in self.header_regions)

    def file_at(self, offset: int) -> tuple[int, int]:
        """(file index, offset in that file) of a byte of the manifest's whole."""
        for i, p in enumerate(self.files):
            if p.offset <= offset < p.end:
                return i, offset - p.offset
        raise ValueError(f"offset {offset} outside {self.identity}")

    @cached_property
    def tensor_names(self) -> tuple[str, ...]:
        return tuple(r.name for r in self.regions if r.is_tensor)

    @cached_property
    def num_layers(self) -> int:
        """Decoder layers, from the tensor names (``blk.N.…``): known before the header is parsed."""
        return 1 + max((b for n in self.tensor_names if (b := block_of(n)) is not None), default=-1)

    @cached_property
    def region_of_piece(self) -> tuple[int, ...]:
        out = []
        for i, r in enumerate(self.regions):
            out += [i] * r.pieces
        return tuple(out)

    def pieces_of(self, names: Iterable[str]) -> list[int]:
        """Sorted piece indices of the named regions (KeyError on an unknown name)."""
        return sorted(i for n in set(names) for i in self.by_name[n].piece_range)

    def bytes_of(self, pieces: Iterable[int]) -> int:
        return sum(self.pieces[i].length for i in set(pieces))

    def regions_within(self, have: set[int]) -> list[Region]:
        """The regions every piece of which is in ``have``."""
        return [r for r in self.regions if all(i in have for i in r.piece_range)]

    # -- wire form ----------------------------------------------------------
    @staticmethod
    def from_data(data: bytes) -> Manifest:
        """Parse and check the canonical bytes; raises ManifestError on anything inconsistent."""
        try:
            doc = json.loads(data)
            if doc.get("format") != FORMAT:
                raise ManifestError(f"unknown manifest format {doc.get('format')!r}")
            name, sha, size, piece_size = doc["name"], doc["sha256"], doc["size"], doc["piece_size"]
            spans = [(str(n), int(o), int(ln), str(s)) for n, o, ln, s in doc["regions"]]
            piece_shas = [str(s) for s in doc["pieces"]]
            parts = [(str(n), int(z)) for n, z in doc.get("parts", [])]
        except ManifestError:
            raise
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise ManifestError(f"malformed manifest: {exc}") from None
        if not isinstance(name, str) or not _safe_name(name):
            raise ManifestError(f"bad file name in manifest: {name!r}")
        if not isinstance(size, int) or not isinstance(piece_size, int) or not 0 < piece_size <= MAX_PIECE_SIZE:
            raise ManifestError("bad size or piece size in manifest")
        m = assemble(name, sha, size, piece_size, spans, piece_shas, parts)
        if m.data != data:
            raise ManifestError("manifest is not in canonical form")
        return m


def split(spans: list[tuple[str, int, int]], piece_size: int) -> list[tuple[int, int, int]]:
    """Cut each region into pieces of at most ``piece_size``: ``(region index, offset, length)``."""
    out = []
    for i, (_, off, n) in enumerate(spans):
        for start in range(off, off + n, piece_size):
            out.append((i, start, min(piece_size, off + n - start)))
    return out


def _safe_name(name: str) -> bool:
    return bool(name) and "/" not in name and not name.startswith(".")


def _check_parts(name: str, size: int, parts: list[tuple[str, int]], spans) -> tuple[Part, ...]:
    """A split set's parts: at least two, named as its parts, filling the whole, each opening with its header."""
    if not parts:
        return ()
    from decoding.loader.gguf_split import parse_name

    first = parse_name(name)
    if len(parts) < 2 or first is None or first.no != 1 or first.count != len(parts):
        raise ManifestError(f"manifest parts do not make a split set named {name!r}")
    out, pos = [], 0
    starts = {o: n for n, o, _, _ in spans}
    for i, (pname, psize) in enumerate(parts):
        if pname != first.part(i + 1) or psize <= 0:
            raise ManifestError(f"manifest part {i + 1} is {pname!r} ({psize} bytes): not part of {name!r}")
        if starts.get(pos) != (HEADER if i == 0 else f"{PART_HEADER}{i + 1}"):
            raise ManifestError(f"manifest part {pname} does not open with its header")
        out.append(Part(pname, pos, psize))
        pos += psize
    if pos != size:
        raise ManifestError("manifest parts do not add up to its size")
    return tuple(out)


def assemble(name: str, sha256: str, size: int, piece_size: int, spans: list[tuple[str, int, int, str]],
             piece_shas: list[str], parts: list[tuple[str, int]] = ()) -> Manifest:
    """A checked Manifest from regions ``(name, offset, length, sha256)`` and per-piece digests
    (and, for a split set, its parts ``(file name, size)`` in order)."""
    if not _HEX64.match(sha256) or not all(_HEX64.match(s) for _, _, _, s in spans) \
            or not all(isinstance(s, str) and _HEX64.match(s) for s in piece_shas):
        raise ManifestError("manifest digests must be lowercase hex sha256")
    pos = 0
    seen: set[str] = set()
    for n, off, ln, _ in spans:
        if off != pos or ln <= 0:
            raise ManifestError(f"regions must tile the file: {n} at {off} (expected {pos})")
        if n != GAP and n in seen:
            raise ManifestError(f"region {n} appears twice")
        seen.add(n)
        pos += ln
    if pos != size or not spans or spans[0][0] != HEADER:
        raise ManifestError("regions must start with the header and cover the whole file")
    cuts = split([(n, o, ln) for n, o, ln, _ in spans], piece_size)
    if len(cuts) != len(piece_shas):
        raise ManifestError(f"manifest lists {len(piece_shas)} piece digests for {len(cuts)} pieces")
    pieces = tuple(Piece(o, ln, s) for (_, o, ln), s in zip(cuts, piece_shas))
    counts = [0] * len(spans)
    for ri, _, _ in cuts:
        counts[ri] += 1
    checked = _check_parts(name, size, list(parts), spans)
    if not checked and any(n.startswith(PART_HEADER) for n, _, _, _ in spans):
        raise ManifestError("a part header in the manifest of a single file")
    bounds = {p.offset for p in checked} | {p.end for p in checked}
    if checked and any(off < b < off + ln for n, off, ln, _ in spans for b in bounds):
        raise ManifestError("a manifest region straddles two parts")
    regions, first = [], 0
    for (n, off, ln, s), count in zip(spans, counts):
        regions.append(Region(n, off, ln, s, first, count))
        first += count
    return Manifest(name, sha256, size, piece_size, tuple(regions), pieces, checked)


def needed_tensors(names: Iterable[str], num_layers: int, first: int, end: int) -> set[str]:
    """The GGUF tensors a stage serving layers ``[first, end)`` reads.

    Its blocks' tensors; the token embedding on the first stage (and on the last
    when the head is tied to it); the final norm and head on the last;
    ``rope_freqs`` everywhere. Mirrors ``decoding.models.llama.loader.load_stage``
    (a test checks it against the tensors that loader actually reads).
    """
    if not 0 <= first < end <= num_layers:
        raise ValueError(f"invalid layer range [{first}, {end}) for {num_layers} layers")
    names = set(names)
    last = end == num_layers
    tied = "output.weight" not in names
    need = {n for n in names if (b := block_of(n)) is not None and first <= b < end}
    if first == 0 or (last and tied):
        need.add("token_embd.weight")
    if last:
        need.add("output_norm.weight")
        if not tied:
            need.add("output.weight")
    if "rope_freqs.weight" in names:
        need.add("rope_freqs.weight")
    return need & names


def block_of(name: str) -> int | None:
    """The layer index of a ``blk.N.…`` tensor name, else None."""
    parts = name.split(".")
    if len(parts) >= 3 and parts[0] == "blk" and parts[1].isdigit():
        return int(parts[1])
    return None
