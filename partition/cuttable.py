"""The cut table: where to cut a prompt of every length into chunks, looked up in O(1).

The sequence planner (``partition.sequence.build_cut_table``) fills it; a plan
carries it. Its compact wire form exists because the leader ships it to every
member inside a message header, which the transport caps at 64 KiB.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

from partition.errors import PartitionError


class PromptTooLongError(PartitionError):
    """A prompt longer than the plan's ``max_seq``."""


@dataclass(frozen=True)
class CutTable:
    """Chunk cut points for every prompt length ``0..max_seq``; ``lookup`` is O(1).

    ``cuts[y]`` are the interior chunk boundaries of a prompt of ``y`` tokens:
    ``(300, 650)`` for ``y = 1000`` means chunks [0,300), [300,650), [650,1000).
    """

    max_seq: int
    k_max: int
    min_chunk: int
    cuts: tuple[tuple[int, ...], ...]
    latency_s: tuple[float, ...]

    def lookup(self, prompt_len: int) -> tuple[int, ...]:
        self._check(prompt_len)
        return self.cuts[prompt_len]

    def chunks(self, prompt_len: int) -> list[tuple[int, int]]:
        bounds = (0, *self.lookup(prompt_len), prompt_len)
        return [(a, b) for a, b in zip(bounds, bounds[1:])]

    def predicted_latency_s(self, prompt_len: int) -> float:
        self._check(prompt_len)
        return self.latency_s[prompt_len]

    def _check(self, prompt_len: int) -> None:
        if not 0 <= prompt_len <= self.max_seq:
            raise PromptTooLongError(
                f"prompt of {prompt_len} tokens is outside the plan's range 0..{self.max_seq}"
            )

    def to_dict(self) -> dict:
        return {"max_seq": self.max_seq, "k_max": self.k_max, "min_chunk": self.min_chunk,
                "cuts": [list(c) for c in self.cuts], "latency_s": list(self.latency_s)}

    @classmethod
    def from_dict(cls, d: dict) -> "CutTable":
        return cls(int(d["max_seq"]), int(d["k_max"]), int(d["min_chunk"]),
                   tuple(tuple(int(v) for v in c) for c in d["cuts"]),
                   tuple(float(v) for v in d["latency_s"]))

    def to_wire(self) -> dict[str, Any]:
        """The compact form a plan ships in (``Plan.to_assignment``).

        Messages' headers are capped at 64 KiB and the plain lists take 50 KiB and
        more. A row's cuts barely change from one prompt length to the next, so
        row-to-row deltas of the padded ``[count, cut...]`` matrix compress to a
        few KiB; the latencies travel as float64, so the table arrives exact.
        """
        import numpy as np  # (here: the daemon's CLI imports this module at start)

        n, width = len(self.cuts), max((len(c) for c in self.cuts), default=0)
        rows = np.zeros((n, width + 1), dtype="<i4")
        for y, c in enumerate(self.cuts):
            rows[y, 0] = len(c)
            rows[y, 1:1 + len(c)] = c
        deltas = np.diff(rows, axis=0, prepend=np.zeros((1, width + 1), dtype="<i4"))
        return {"max_seq": self.max_seq, "k_max": self.k_max, "min_chunk": self.min_chunk, "width": width,
                "cuts": zlib.compress(deltas.astype("<i4").tobytes(), 6),
                "latency_s": zlib.compress(np.asarray(self.latency_s, dtype="<f8").tobytes(), 6)}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> "CutTable":
        """Inverse of :meth:`to_wire`; ValueError on anything that is not a valid table."""
        import numpy as np

        try:
            max_seq, k_max, width = int(d["max_seq"]), int(d["k_max"]), int(d["width"])
            min_chunk = int(d["min_chunk"])
            if not (0 <= max_seq <= MAX_WIRE_SEQ and 0 <= width < k_max <= MAX_WIRE_CHUNKS):
                raise ValueError(f"cut table of {max_seq} tokens and {k_max} chunks is out of range")
            n = max_seq + 1
            deltas = _inflate(d["cuts"], n * (width + 1) * 4)
            latency = np.frombuffer(_inflate(d["latency_s"], n * 8), dtype="<f8")
        except (KeyError, TypeError, zlib.error) as exc:
            raise ValueError(f"malformed cut table: {exc!r}") from None
        rows = np.cumsum(np.frombuffer(deltas, dtype="<i4").reshape(n, width + 1), axis=0)
        cuts = []
        for y, row in enumerate(rows.tolist()):
            c = tuple(row[1:1 + row[0]]) if 0 <= row[0] <= width else None
            if c is None or any(not 0 < a < b for a, b in zip(c, (*c[1:], y))):
                raise ValueError(f"cut table row {y} is not a valid cutting of a {y}-token prompt")
            cuts.append(c)
        return cls(max_seq, k_max, min_chunk, tuple(cuts), tuple(latency.tolist()))


MAX_WIRE_SEQ = 1 << 16  # bounds what a received cut table may make us allocate
MAX_WIRE_CHUNKS = 1024


def _inflate(data: bytes, size: int) -> bytes:
    """``data`` decompressed, which must be exactly ``size`` bytes (never more is inflated)."""
    inflater = zlib.decompressobj()
    out = inflater.decompress(bytes(data), size + 1)
    if len(out) != size or inflater.unconsumed_tail:
        raise ValueError(f"cut table field holds {len(out)} bytes, expected {size}")
    return out
