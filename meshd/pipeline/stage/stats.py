"""A stage's counters, as ``meshd status`` and the metrics endpoint show them."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

__all__ = ["StageStats", "BATCH_HIST_MAX"]

BATCH_HIST_MAX = 16  # batch sizes counted exactly up to this; larger ones in its bucket


@dataclass
class StageStats:
    forwards: int = 0
    tokens: int = 0
    activation_bytes_out: int = 0
    activation_bytes_to: dict[str, int] = field(default_factory=dict)  # next stage's node id -> bytes
    busy_s: float = 0.0
    errors: int = 0
    late_dropped: int = 0
    reaped: int = 0
    batches: dict[int, int] = field(default_factory=dict)  # sequences in a pass -> passes
    exit_asked: int = 0  # decode steps that asked for early exits (and could take one here)
    exits: dict[int, int] = field(default_factory=dict)  # layers computed before the token left -> tokens
    started: float = field(default_factory=time.monotonic)

    def count_pass(self, sequences: int, seconds: float) -> None:
        self.forwards += 1
        self.busy_s += seconds
        size = min(sequences, BATCH_HIST_MAX)
        self.batches[size] = self.batches.get(size, 0) + 1

    def count_exit(self, layer: int) -> None:
        """A decode step that asked for early exits: ``layer`` where its token left (0: it did not)."""
        self.exit_asked += 1
        if layer:
            self.exits[layer] = self.exits.get(layer, 0) + 1

    def count_sent(self, to: str, nbytes: int) -> None:
        self.activation_bytes_out += nbytes
        self.activation_bytes_to[to] = self.activation_bytes_to.get(to, 0) + nbytes

    def to_dict(self) -> dict:
        up = max(time.monotonic() - self.started, 1e-9)
        return {"forwards": self.forwards, "tokens": self.tokens, "busy_s": round(self.busy_s, 3),
                "activation_bytes_out": self.activation_bytes_out,
                "activation_bytes_to": dict(self.activation_bytes_to),
                "utilisation": round(self.busy_s / up, 3), "errors": self.errors,
                "late_dropped": self.late_dropped, "reaped": self.reaped,
                "batch_sizes": {str(k): v for k, v in sorted(self.batches.items())},
                "exits": {"asked": self.exit_asked, "by_layer": {str(k): v for k, v in sorted(self.exits.items())},
                          "rate": round(sum(self.exits.values()) / self.exit_asked, 4) if self.exit_asked else 0.0}}
