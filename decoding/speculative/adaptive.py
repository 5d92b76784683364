"""How many candidates a verify round should carry, and whether to speculate at all.

A round of m tokens costs c(m) one-token steps on this mesh (measured: the
profile's q(m, context) at first, then what rounds actually take), and commits
1 + (accepted candidates) tokens. Drafters order their candidates best first,
each with an estimated probability of being accepted; the controller scales
those estimates by how this request's drafts actually fared and picks the
prefix length n that maximises expected tokens per unit of time,

    (1 + s · Σ_{i<n} v_i) / c(n + 1).

n = 0 is plain decoding. After a run of rounds that did not pay, a request
still probes with a small draft now and then, so speculation comes back when
the text turns repetitive.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class RoundCost:
    """Linear cost model c(m) = 1 + slope·(m − 1) in one-token steps, learnt from observed rounds.

    Shared by all requests of a coordinator (it is a property of the mesh, not of a request).
    """

    slope: float = 0.04  # prior: an m-token round on a CPU stage is nearly as cheap as one token
    decay: float = 0.95
    _sums: list[float] = field(default_factory=lambda: [0.0] * 5)  # w, Σm, Σt, Σm², Σmt
    by_size: dict[int, list[float]] = field(default_factory=dict)  # m -> [rounds, seconds] (for reports)

    def observe(self, m: int, seconds: float) -> None:
        seen = self.by_size.setdefault(int(m), [0, 0.0])
        seen[0] += 1
        seen[1] += seconds
        w, sm, st, smm, smt = (x * self.decay for x in self._sums)
        self._sums = [w + 1, sm + m, st + seconds, smm + m * m, smt + m * seconds]
        w, sm, st, smm, smt = self._sums
        var = smm / w - (sm / w) ** 2
        if w >= 4 and var > 0.5:  # rounds of several sizes seen: fit the line
            b = (smt / w - (sm / w) * (st / w)) / var
            a = st / w - b * sm / w
            one = a + b
            if one > 0 and b >= 0:
                self.slope = b / one

    def prior(self, slope: float) -> None:
        """A starting estimate (from the device profiles), used until rounds have been observed."""
        if self._sums[0] == 0 and slope >= 0:
            self.slope = float(slope)

    def __call__(self, m: int) -> float:
        return 1.0 + self.slope * max(0, m - 1)

    def mean_seconds(self) -> dict[int, float]:
        """Mean observed round time per round size m."""
        return {m: t / n for m, (n, t) in sorted(self.by_size.items()) if n}


@dataclass
class Controller:
    """Per-request: picks the candidate count; learns a calibration ``s`` of the drafter's estimates."""

    cost: RoundCost
    max_candidates: int = 64
    fixed: int | None = None  # the client asked for exactly this many (still capped by what is drafted)
    scale: float = 1.0
    probe_every: int = 8
    max_probe_every: int = 64
    _idle_rounds: int = 0
    _probing: bool = False
    _gap: int = 0  # plain rounds before the next probe; doubles after each probe that won nothing
    last_choice: int = 0

    def __post_init__(self):
        self._gap = self.probe_every

    def choose(self, values: Sequence[float]) -> int:
        """How many of the (best-first) candidates with acceptance estimates ``values`` to send."""
        limit = min(len(values), self.max_candidates)
        if self.fixed is not None:
            return min(limit, self.fixed)
        best_n, best = 0, 1.0
        acc = 0.0
        for n in range(1, limit + 1):
            acc += values[n - 1]
            gain = (1.0 + self.scale * acc) / self.cost(n + 1)
            if gain > best * 1.02:  # a 2 % margin: don't speculate for noise
                best_n, best = n, gain
        self.last_choice, self._probing = best_n, False
        if best_n == 0:
            self._idle_rounds += 1
            if limit and self._idle_rounds >= self._gap:  # look again: the text may have turned repetitive
                self._idle_rounds = 0
                # two candidates where a round is nearly free, one where each row costs most of a step
                self.last_choice, self._probing = min(limit, 2 if self.cost(3) < 1.5 else 1), True
        else:
            self._idle_rounds = 0
        return self.last_choice

    @property
    def probing_next(self) -> bool:
        """The next ``choose`` will send candidates even if they do not look worth it (a probe)."""
        return self._idle_rounds + 1 >= self._gap

    def observe(self, predicted: float, accepted: int) -> None:
        """After a round: ``predicted`` = Σ v_i of the candidates sent, ``accepted`` = how many were.

        A probe that won nothing doubles the wait before the next one (up to
        ``max_probe_every``): on text the drafters cannot guess, each probe is a
        round that costs more than a plain step and returns the same one token.
        A round whose accepted candidates paid for its extra rows brings the wait
        back to ``probe_every``.
        """
        # A win is a round that paid for itself: on a CPU where a round of m tokens costs c(m) steps, a
        # probe whose one accepted token did not cover its extra rows won nothing.
        won = accepted > 0 and 1 + accepted >= self.cost(self.last_choice + 1)
        if self._probing or won:
            self._gap = (min(2 * self._gap, self.max_probe_every) if self._probing and not won
                         else self.probe_every)
        if predicted <= 0:
            return
        ratio = min(4.0, accepted / predicted)
        self.scale = 0.8 * self.scale + 0.2 * ratio
