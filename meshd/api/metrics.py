"""Requests in flight and recent speed, as the API sees them.

The API is where a request enters and leaves this daemon, so it is the one
place that can time what a user experiences: time to first token (TTFT) and
decode speed. ``meshd status`` shows these next to the planner's prediction.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class RequestRecord:
    finished_at: float
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float | None
    decode_s: float  # first token to last token


class ApiMetrics:
    """Counts requests in flight and keeps the last ``window`` finished ones."""

    def __init__(self, window: int = 32, clock=time.monotonic):
        self.in_flight = 0
        self.served = 0
        self.failed = 0
        self._recent: deque[RequestRecord] = deque(maxlen=window)
        self._clock = clock

    def started(self) -> float:
        self.in_flight += 1
        return self._clock()

    def finished(
        self, started_at: float, first_token_at: float | None, prompt_tokens: int,
        completion_tokens: int, *, ok: bool = True,
    ) -> RequestRecord:
        now = self._clock()
        self.in_flight -= 1
        if not ok:
            self.failed += 1
        self.served += 1
        rec = RequestRecord(
            finished_at=now,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            ttft_s=None if first_token_at is None else first_token_at - started_at,
            decode_s=0.0 if first_token_at is None else now - first_token_at,
        )
        if ok and completion_tokens:
            self._recent.append(rec)
        return rec

    def recent(self) -> dict:
        """Aggregate speed over the recent window (``None`` when nothing was served).

        tokens/s counts tokens after the first over the time after the first,
        so it measures decoding and is not diluted by prefill (that is TTFT).
        """
        recs = list(self._recent)
        decode_tokens = sum(max(r.completion_tokens - 1, 0) for r in recs)
        decode_s = sum(r.decode_s for r in recs)
        ttfts = sorted(r.ttft_s for r in recs if r.ttft_s is not None)
        return {
            "requests": len(recs),
            "tokens_per_s": round(decode_tokens / decode_s, 2) if decode_s > 0 else None,
            "ttft_s": round(ttfts[len(ttfts) // 2], 3) if ttfts else None,
            "served": self.served,
            "failed": self.failed,
        }
