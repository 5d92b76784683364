"""What this coordinator's requests look like: the workload the layout planner prices.

Prompt length, the share of it the prefix cache held, answer length (means over
the last requests), and how many requests were in flight when each arrived (the
concurrency a request actually meets). Heartbeats carry it; the leader adds up the
home's (``combine``) and re-plans when another layout would serve it clearly faster.
Warm-up requests are not the home's workload and are not counted.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

#: requests a mean is taken over (a home's pattern changes over minutes, not over one request)
WINDOW = 32
#: requests older than this say nothing about the home now
MAX_AGE_S = 600.0
#: fewer requests than this say nothing yet: the planner's default workload stands
MIN_REQUESTS = 4


@dataclass(frozen=True)
class Seen:
    prompt_tokens: int
    cached_tokens: int
    answer_tokens: int
    in_flight: int  # requests running here when it arrived, itself included
    at: float = 0.0  # when it ended (monotonic seconds)


class WorkloadMeter:
    def __init__(self, window: int = WINDOW, clock=time.monotonic):
        self._seen: deque[Seen] = deque(maxlen=window)
        self.clock = clock
        self.total = 0

    def record(self, prompt_tokens: int, cached_tokens: int, answer_tokens: int, in_flight: int) -> None:
        self._seen.append(Seen(max(1, prompt_tokens), max(0, min(cached_tokens, prompt_tokens)),
                               max(0, answer_tokens), max(1, in_flight), self.clock()))
        self.total += 1

    def snapshot(self) -> dict:
        """The means over the window's requests of the last MAX_AGE_S ({} under MIN_REQUESTS of them)."""
        now = self.clock()
        seen = [s for s in self._seen if now - s.at <= MAX_AGE_S]
        if len(seen) < MIN_REQUESTS:
            return {}
        n = len(seen)
        prompt = sum(s.prompt_tokens for s in seen)
        return {"requests": n, "prompt_tokens": round(prompt / n),
                "cached_fraction": round(sum(s.cached_tokens for s in seen) / prompt, 3),
                "answer_tokens": round(sum(s.answer_tokens for s in seen) / n),
                "in_flight": round(sum(s.in_flight for s in seen) / n, 2)}


def combine(snapshots: list[dict]):
    """The home's workload from its coordinators' snapshots (a ``partition.layout.Workload``; None when
    none has seen enough): means weighted by requests, concurrency added up (each coordinator's
    requests meet the others' on the same devices)."""
    from partition.layout import Workload

    good = [s for s in snapshots if s and int(s.get("requests", 0) or 0) >= MIN_REQUESTS]
    if not good:
        return None
    try:
        n = sum(int(s["requests"]) for s in good)
        mean = lambda key: sum(float(s[key]) * int(s["requests"]) for s in good) / n  # noqa: E731
        return Workload(max(1, round(mean("prompt_tokens"))), max(1, round(mean("answer_tokens"))),
                        min(0.99, max(0.0, mean("cached_fraction"))),
                        max(1.0, sum(float(s["in_flight"]) for s in good)))
    except (KeyError, TypeError, ValueError):  # a member's malformed field: the default stands
        return None
