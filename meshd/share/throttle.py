"""The token bucket behind ``--share-rate``: sharing a model must not starve the requests being served.

Pure: ``delay(n, now)`` says how long to wait before ``n`` more bytes may go and
books them, so a test drives it with a fake clock. The daemon awaits the delay
before each piece it requests (downloads) and before each piece it sends
(uploads); a piece is booked whole, so the burst is one piece.
"""

from __future__ import annotations

import asyncio
import time

from meshd.errors import MeshdError


class RateError(MeshdError, ValueError):
    pass


def parse_rate(text: str | None) -> float | None:
    """``"50mbit"``, ``"1gbit"``, ``"12.5MB/s"`` or a bare number of Mbit/s → bytes per second.

    None, "", "0", "none" and "unlimited" mean no limit (None).
    """
    raw = (text or "").strip()
    if raw.lower() in ("", "0", "none", "unlimited", "off"):
        return None
    from partition.errors import PartitionError
    from partition.link import parse_bandwidth

    try:
        return float(raw) * 1e6 / 8 if _is_number(raw) else parse_bandwidth(raw)
    except (PartitionError, ValueError) as exc:
        raise RateError(f"--share-rate: {exc}") from None


def _is_number(text: str) -> bool:
    try:
        return float(text) > 0
    except ValueError:
        return False


class TokenBucket:
    """``rate`` bytes per second, bursts up to ``burst`` bytes (at least one request's worth)."""

    def __init__(self, rate: float, burst: float):
        if rate <= 0 or burst <= 0:
            raise ValueError("rate and burst must be positive")
        self.rate = float(rate)
        self.burst = float(burst)
        self._tokens = float(burst)
        self._at: float | None = None

    def delay(self, n: int, now: float) -> float:
        """Seconds until ``n`` bytes may be sent; they are booked (the bucket may go negative)."""
        if self._at is not None:
            self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
        self._at = now
        self._tokens -= n
        return 0.0 if self._tokens >= 0 else -self._tokens / self.rate


class AsyncLimiter:
    """An optional :class:`TokenBucket` for coroutines (None rate: no limit)."""

    def __init__(self, rate: float | None, burst: float, clock=time.monotonic):
        self.bucket = TokenBucket(rate, burst) if rate else None
        self.clock = clock

    @property
    def rate(self) -> float | None:
        return self.bucket.rate if self.bucket is not None else None

    async def take(self, n: int) -> None:
        if self.bucket is None:
            return
        wait = self.bucket.delay(n, self.clock())
        if wait > 0:
            await asyncio.sleep(wait)
