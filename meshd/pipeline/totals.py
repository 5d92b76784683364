"""What this device's engine has decoded, summed over every request since start (``meshd status``).

Owned by the :class:`~meshd.pipeline.engine.PipelineEngine` and fed from each
request's own results — a speculation session's statistics when its answer (or
outline point) ends, an outline decision or outcome when it is made — so nothing
below the engine (coordinator, verify rounds) keeps books for the status page.
A long answer's rounds therefore show once it ends, not round by round.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from decoding.speculative.params import SpeculativeStats

__all__ = ["DecodingTotals", "ExitCount", "ExitTotals", "OutlineTotals", "SpeculationTotals"]


@dataclass
class SpeculationTotals:
    requests: int = 0  # answers that speculated; each outline point that speculated counts as one
    rounds: int = 0  # verify rounds that carried candidates
    drafted: int = 0
    accepted: int = 0
    steps: int = 0  # passes through the model that produced tokens
    tokens: int = 0
    constrained: Counter = field(default_factory=Counter)  # under a grammar: requests, drafted, accepted, forced…

    def add(self, stats: SpeculativeStats) -> None:
        self.requests += 1
        self.rounds += stats.rounds
        self.drafted += stats.drafted
        self.accepted += stats.accepted
        self.steps += stats.steps
        self.tokens += stats.tokens
        if stats.constrained:
            self.constrained.update(requests=1, drafted=stats.drafted, accepted=stats.accepted,
                                    forced_drafted=stats.forced_drafted, forced_accepted=stats.forced_accepted,
                                    steps=stats.steps, tokens=stats.tokens)

    def to_dict(self) -> dict[str, Any]:
        g = self.constrained
        return {"requests": self.requests, "rounds": self.rounds, "drafted": self.drafted,
                "accepted": self.accepted,
                "accepted_per_round": round((self.accepted + self.rounds) / self.rounds, 3) if self.rounds else 0.0,
                "steps_per_token": round(self.steps / self.tokens, 3) if self.tokens else 0.0,
                "under_grammar": {**{k: g[k] for k in ("requests", "drafted", "accepted", "forced_drafted",
                                                       "forced_accepted", "tokens")},
                                  "steps_per_token": round(g["steps"] / g["tokens"], 3) if g["tokens"] else 0.0}}


@dataclass
class OutlineTotals:
    requests: int = 0  # attempts: used + fallbacks
    used: int = 0
    fallbacks: int = 0
    points: int = 0
    fallback_reasons: Counter = field(default_factory=Counter)
    declined: Counter = field(default_factory=Counter)  # "auto" answered plainly, by the gate's reason

    def decline(self, reason: str) -> None:
        self.declined[reason] += 1

    def attempt(self) -> None:
        self.requests += 1

    def use(self, points: int) -> None:
        self.used += 1
        self.points += points

    def fall_back(self, reason: str) -> None:
        self.fallbacks += 1
        self.fallback_reasons[reason] += 1

    def to_dict(self) -> dict[str, Any]:
        return {"requests": self.requests, "used": self.used, "fallbacks": self.fallbacks, "points": self.points,
                "fallback_reasons": dict(self.fallback_reasons), "declined": dict(self.declined)}


@dataclass
class ExitCount:
    """One answer's early exits: its decode steps, and where the tokens that left early left."""

    threshold: float
    tokens: int = 0
    by_layer: Counter = field(default_factory=Counter)

    def add(self, exit_layer: int) -> None:
        self.tokens += 1
        if exit_layer:
            self.by_layer[int(exit_layer)] += 1

    @property
    def exited(self) -> int:
        return sum(self.by_layer.values())

    def to_dict(self) -> dict[str, Any]:
        return {"threshold": self.threshold, "tokens": self.tokens, "exited": self.exited,
                "by_layer": {str(k): v for k, v in sorted(self.by_layer.items())},
                "rate": round(self.exited / self.tokens, 4) if self.tokens else 0.0}


@dataclass
class ExitTotals:
    requests: int = 0  # answers decoded with early exits
    tokens: int = 0
    by_layer: Counter = field(default_factory=Counter)

    def add(self, count: ExitCount) -> None:
        self.requests += 1
        self.tokens += count.tokens
        self.by_layer.update(count.by_layer)

    def to_dict(self) -> dict[str, Any]:
        exited = sum(self.by_layer.values())
        return {"requests": self.requests, "tokens": self.tokens, "exited": exited,
                "by_layer": {str(k): v for k, v in sorted(self.by_layer.items())},
                "rate": round(exited / self.tokens, 4) if self.tokens else 0.0}


@dataclass
class DecodingTotals:
    speculative: SpeculationTotals = field(default_factory=SpeculationTotals)
    outline: OutlineTotals = field(default_factory=OutlineTotals)
    exits: ExitTotals = field(default_factory=ExitTotals)
