"""Link settings of an emulated home network: a rate and a round-trip time.

One string describes a link everywhere (CLI flags, benchmark JSON, RESULTS.md):
``"100mbit,4ms"`` is 100 Mbit/s with 4 ms RTT, ``"1gbit,1ms"`` gigabit Ethernet,
``"none"``/``"unshaped"`` the raw veth path. Rate and RTT are independent: either
part may be given alone (``"100mbit"``, ``"4ms"``). An asymmetric link, as a home's
WAN uplink is, gives both rates: ``"20mbit/100mbit,40ms"`` is 20 Mbit/s up (the
host's egress), 100 Mbit/s down.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from meshd.errors import MeshdError

_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}
_TIME_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
_RATE_RE = re.compile(r"^(\d+(?:\.\d+)?)\s*(bit|kbit|mbit|gbit)$")
_TIME_RE = re.compile(r"^(\d+(?:\.\d+)?)\s*(us|ms|s)$")
_UNSHAPED = {"", "none", "unshaped"}

# tbf burst: ~4 ms of traffic at the configured rate, but never less than two
# full-size frames. A small bucket keeps the link from sending long line-rate
# bursts (a Wi-Fi link cannot) while staying large enough that the token
# bucket's timer granularity does not cap throughput below the rate.
BURST_SECONDS = 0.004
MTU = 1500
# tbf queue: packets waiting longer than this are dropped, like a home router's
# modest buffer. Large enough for TCP to fill the link, small enough that a
# bulk transfer adds at most this much queueing delay to other traffic.
QUEUE_LATENCY_S = 0.020


class LinkSpecError(MeshdError, ValueError):
    """A link string that is not ``RATE[,RTT]`` / ``RTT`` / ``none``."""


@dataclass(frozen=True)
class LinkSpec:
    """``rate_bps`` is None for no rate limit; ``rtt_s`` 0.0 for no added delay; ``down_bps`` is the
    downlink's rate when it differs from the uplink's (``rate_bps``)."""

    rate_bps: int | None = None
    rtt_s: float = 0.0
    down_bps: int | None = None

    @classmethod
    def parse(cls, text: str | None) -> "LinkSpec":
        raw = (text or "").strip().lower()
        if raw in _UNSHAPED:
            return cls()
        rate: int | None = None
        down: int | None = None
        rtt: float | None = None
        for part in (p.strip() for p in raw.split(",")):
            rates = [r.strip() for r in part.split("/")]
            if all(_RATE_RE.match(r) for r in rates) and len(rates) <= 2:
                if rate is not None:
                    raise LinkSpecError(f"link {text!r}: two rates")
                rate, *rest = [_rate(r) for r in rates]
                down = rest[0] if rest and rest[0] != rate else None
                if rate <= 0 or (down is not None and down <= 0):
                    raise LinkSpecError(f"link {text!r}: rate must be positive")
            elif m := _TIME_RE.match(part):
                if rtt is not None:
                    raise LinkSpecError(f"link {text!r}: two round-trip times")
                rtt = float(m.group(1)) * _TIME_UNITS[m.group(2)]
            else:
                raise LinkSpecError(
                    f"link {text!r}: expected RATE[,RTT] like '100mbit,4ms' or 'none' "
                    f"(rates: bit/kbit/mbit/gbit, times: us/ms/s), got {part!r}"
                )
        return cls(rate_bps=rate, rtt_s=rtt or 0.0, down_bps=down)

    @property
    def shaped(self) -> bool:
        return self.rate_bps is not None

    @property
    def delayed(self) -> bool:
        return self.rtt_s > 0

    @property
    def one_way_delay_s(self) -> float:
        return self.rtt_s / 2.0

    @property
    def downlink_bps(self) -> int | None:
        return self.down_bps if self.down_bps is not None else self.rate_bps

    def burst_bytes(self, down: bool = False) -> int:
        rate = self.downlink_bps if down else self.rate_bps
        assert rate is not None
        return max(int(rate / 8 * BURST_SECONDS), 2 * MTU)

    def tbf_args(self, down: bool = False) -> list[str]:
        """Arguments after ``tc qdisc add dev DEV root`` for this link's uplink (or downlink) rate."""
        assert self.rate_bps is not None, "unshaped link has no tbf"
        return [
            "tbf",
            "rate", f"{self.downlink_bps if down else self.rate_bps}bit",
            "burst", str(self.burst_bytes(down)),
            "latency", f"{int(QUEUE_LATENCY_S * 1000)}ms",
        ]

    def __str__(self) -> str:
        parts = []
        if self.rate_bps is not None:
            parts.append(_fmt_rate(self.rate_bps) + (f"/{_fmt_rate(self.down_bps)}" if self.down_bps else ""))
        if self.rtt_s > 0:
            parts.append(_fmt_time(self.rtt_s))
        return ",".join(parts) or "unshaped"

    def describe(self) -> str:
        """Human wording for banners: '100 Mbit/s, 4 ms RTT'."""
        rate = f"{self.rate_bps / 1e6:g} Mbit/s" if self.rate_bps else "unshaped rate"
        if self.down_bps:
            rate = f"{self.rate_bps / 1e6:g} Mbit/s up, {self.down_bps / 1e6:g} Mbit/s down"
        rtt = f"{self.rtt_s * 1e3:g} ms RTT" if self.rtt_s else "no added delay"
        return f"{rate}, {rtt}"


def _rate(text: str) -> int:
    m = _RATE_RE.match(text)
    assert m is not None
    return int(round(float(m.group(1)) * _RATE_UNITS[m.group(2)]))


def _fmt_rate(bps: int) -> str:
    for unit, mult in (("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3)):
        if bps % mult == 0:
            return f"{bps // mult}{unit}"
    return f"{bps}bit"


def _fmt_time(s: float) -> str:
    us = round(s * 1e6)
    if us % 1000 == 0:
        return f"{us // 1000}ms"
    return f"{us}us"
