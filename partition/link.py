"""Network links between pipeline stages: parse ``"100mbit,2ms"`` and price a transfer.

The planners only need one number per hop: how long it takes to hand a block of
activations to the next stage. We model it as ``bytes / bandwidth + rtt``. The
issue asks for the full round-trip time rather than half of it because the
transport acknowledges every activation message before the sender's slot is
free again, and because a pessimistic link term is the safer error for a
planner (it makes the plan use fewer hops, never more).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from partition.errors import PartitionError


DEFAULT_LINK = "100mbit,2ms"  # the link a home is priced over unless told: a typical home Wi-Fi hop


class LinkSpecError(PartitionError):
    """A ``--link`` value that cannot be understood."""


# bits per second for each bandwidth unit; "B" units are bytes.
_BANDWIDTH_UNITS = {
    "bit": 1.0, "bps": 1.0,
    "kbit": 1e3, "kbps": 1e3,
    "mbit": 1e6, "mbps": 1e6,
    "gbit": 1e9, "gbps": 1e9,
    "b/s": 8.0,
    "kb/s": 8e3,
    "mb/s": 8e6,
    "gb/s": 8e9,
}
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6}
_NUMBER_UNIT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[-+]?[0-9]+)?)\s*([a-zµ/]*)\s*$", re.I)


@dataclass(frozen=True)
class LinkModel:
    """A symmetric link: ``bandwidth_Bps`` bytes per second and a round-trip time."""

    bandwidth_Bps: float
    rtt_s: float

    def __post_init__(self) -> None:
        if not self.bandwidth_Bps > 0 or self.rtt_s < 0:
            raise LinkSpecError(
                f"link needs a positive bandwidth and a non-negative RTT, got "
                f"{self.bandwidth_Bps} B/s and {self.rtt_s} s"
            )

    def transfer_s(self, nbytes: float) -> float:
        """Seconds to hand ``nbytes`` to the next stage (0 bytes still cost one RTT)."""
        return nbytes / self.bandwidth_Bps + self.rtt_s

    def activation_transfer_s(self, tokens, hidden_size: int, dtype_bytes: int):
        """Transfer time of ``tokens`` hidden states (works elementwise on numpy arrays)."""
        return tokens * (hidden_size * dtype_bytes) / self.bandwidth_Bps + self.rtt_s

    def describe(self) -> str:
        if math.isinf(self.bandwidth_Bps):
            return f"unlimited bandwidth, {self.rtt_s * 1e3:g} ms RTT"
        mbit = self.bandwidth_Bps * 8 / 1e6
        return f"{mbit:g} Mbit/s, {self.rtt_s * 1e3:g} ms RTT"

    def to_dict(self) -> dict:
        """JSON-safe form; an unlimited bandwidth is written as ``null``."""
        bw = None if math.isinf(self.bandwidth_Bps) else self.bandwidth_Bps
        return {"bandwidth_Bps": bw, "rtt_s": self.rtt_s}

    @classmethod
    def from_dict(cls, data: dict) -> "LinkModel":
        bw = data.get("bandwidth_Bps")
        return cls(float("inf") if bw is None else float(bw), float(data["rtt_s"]))


#: Same host or a loopback: the cost of a stage boundary is ~zero.
LOCAL = LinkModel(float("inf"), 0.0)


def parse_bandwidth(text: str) -> float:
    """``"100mbit"`` → bytes per second. Bare numbers are bits per second."""
    m = _NUMBER_UNIT.match(text)
    if not m:
        raise LinkSpecError(f"cannot read bandwidth {text!r} (try 100mbit, 1gbit, 12.5MB/s)")
    value, unit = float(m.group(1)), m.group(2)
    key = unit.lower() if unit else "bps"
    # "MB/s" (bytes) and "Mb/s" (bits) differ only in case: honour the case there.
    if key.endswith("b/s") and unit and unit[-3] == "b":
        key = {"b/s": "bit", "kb/s": "kbit", "mb/s": "mbit", "gb/s": "gbit"}[key]
    if key not in _BANDWIDTH_UNITS:
        raise LinkSpecError(f"unknown bandwidth unit {unit!r} in {text!r}")
    bps = value * _BANDWIDTH_UNITS[key]
    if bps <= 0:
        raise LinkSpecError(f"bandwidth must be positive: {text!r}")
    return bps / 8.0


def parse_duration(text: str) -> float:
    """``"2ms"`` → 0.002. Bare numbers are milliseconds (the unit people quote for RTT)."""
    m = _NUMBER_UNIT.match(text)
    if not m:
        raise LinkSpecError(f"cannot read round-trip time {text!r} (try 2ms, 300us)")
    value, unit = float(m.group(1)), m.group(2).lower() or "ms"
    if unit not in _TIME_UNITS:
        raise LinkSpecError(f"unknown time unit {unit!r} in {text!r}")
    return value * _TIME_UNITS[unit]


def parse_link(spec: str) -> LinkModel:
    """Parse ``"BANDWIDTH[,RTT]"`` such as ``"100mbit,2ms"``; ``"local"`` is a free link.

    The RTT defaults to 1 ms when omitted.
    """
    spec = spec.strip()
    if spec.lower() in {"local", "loopback", "inf"}:
        return LOCAL
    parts = [p for p in spec.split(",")]
    if len(parts) not in (1, 2) or not parts[0].strip():
        raise LinkSpecError(f"link spec must be BANDWIDTH[,RTT], e.g. 100mbit,2ms; got {spec!r}")
    bandwidth = parse_bandwidth(parts[0])
    rtt = parse_duration(parts[1]) if len(parts) == 2 else 1e-3
    return LinkModel(bandwidth, rtt)
