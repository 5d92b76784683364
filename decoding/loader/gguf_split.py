"""Split GGUF sets (llama.cpp's gguf-split): ``NAME-00001-of-0000N.gguf`` … read as one model.

The Hub publishes most 7B+ GGUFs this way. Each part is a GGUF file of its own;
the first carries the model's metadata, every part carries ``split.no`` (0-based),
``split.count`` and ``split.tensors.count`` (all parts together), and each tensor
lives in exactly one part. This module finds the parts of a set, checks that they
belong together, and names the set: its identity is the first part's file name and
the sha256 of the parts' bytes in order, so a changed part changes the model.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from decoding.errors import ModelLoadError

_PART = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
SPLIT_NO = "split.no"
SPLIT_COUNT = "split.count"
SPLIT_TENSORS = "split.tensors.count"


@dataclass(frozen=True)
class SplitName:
    """What a part's file name says: the set's stem, this part's number (1-based) and the count."""

    stem: str
    no: int
    count: int

    def part(self, no: int) -> str:
        return f"{self.stem}-{no:05d}-of-{self.count:05d}.gguf"


def parse_name(name: str) -> SplitName | None:
    """The split fields of a file name, or None when it is not named as a part of a set."""
    m = _PART.match(name)
    if m is None:
        return None
    no, count = int(m["no"]), int(m["count"])
    if not 1 <= no <= count:
        return None
    return SplitName(m["stem"], no, count)


def part_paths(path: Path) -> tuple[Path, ...]:
    """Every part of the set ``path`` belongs to, in order (just ``path`` for a plain GGUF).

    Any part may be named; a missing part is a clear error naming it.
    """
    path = Path(path)
    name = parse_name(path.name)
    if name is None or name.count == 1:
        return (path,)
    parts = tuple(path.with_name(name.part(i)) for i in range(1, name.count + 1))
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise ModelLoadError(f"{path}: split GGUF set is incomplete: {', '.join(missing)} "
                             f"missing beside it ({name.count} parts)")
    return parts


def check_parts(parts: tuple[Path, ...], readers) -> None:
    """The parts' own ``split.*`` metadata agree with their names and hold every tensor once.

    ``readers``: each part's parsed header (``decoding.loader.gguf_file.GGUFFile``), in order.
    A plain GGUF (one part, no ``split.count`` or a count of 1) passes.
    """
    def value(reader, key):
        v = reader.field(key)
        return None if v is None else int(v)

    count = len(parts)
    if count == 1:
        declared = value(readers[0], SPLIT_COUNT)
        if declared not in (None, 1):
            raise ModelLoadError(f"{parts[0]}: this GGUF is part 1 of a {declared}-part split set; "
                                 f"open it by its split file name (NAME-00001-of-{declared:05d}.gguf)")
        return
    seen: dict[str, Path] = {}
    for i, (p, r) in enumerate(zip(parts, readers)):
        no, n = value(r, SPLIT_NO), value(r, SPLIT_COUNT)
        if no != i or n != count:
            raise ModelLoadError(f"{p}: split metadata says part {no} of {n}, its name says part "
                                 f"{i} of {count} (0-based); the set is mixed up")
        for t in r.tensors:
            if t.name in seen:
                raise ModelLoadError(f"{p}: tensor {t.name} is also in {seen[t.name].name}")
            seen[t.name] = p
    total = value(readers[0], SPLIT_TENSORS)
    if total is not None and total != len(seen):
        raise ModelLoadError(f"{parts[0]}: the split set declares {total} tensors, its parts hold {len(seen)}")


__all__ = ["SplitName", "parse_name", "part_paths", "check_parts"]
