"""Which drafted chunks go to the cloud verifier (Synera's two filters), as pure functions.

A chunk is γ drafted tokens. Two cheap signals from the drafting model say
whether the big model is likely to disagree, and whether a disagreement
would matter:

- **confidence** c: the chunk's mean top-1 probability. Above the profiled
  threshold c_th, offloading tails off along a logistic (k = 10): a confident
  small model is usually right.
- **importance** i: how much attention the chunk's tokens receive from the
  rows that follow them (H2O's column sums, from the drafter's final layer,
  averaged over heads; see :func:`chunk_importance`). Below i_th/2 a chunk is
  kept local, above i_th it is offloaded, in between a logistic (θ = −10).

The budget b (0..1) is the share of chunks the home is willing to pay for.
The thresholds are calibrated so that about b of the recently seen chunks pass
both filters — Synera profiles i_th offline at the budget's percentile; we keep
a running window of (confidence, importance) so a new model pair needs no
profiling step, and the achieved share is reported next to the budget. c_th
starts at a prior and follows the mean confidence of chunks the verifier
accepted whole (Synera's offline definition, measured online); it is raised
only when a confident drafter would otherwise keep more than 1 − b local. Budget 1.0 verifies every
chunk (the lossless setting); budget 0 none; no chunk is offloaded in the last
20 % of the token budget (a correction there buys little), except at budget 1.0.
"""

from __future__ import annotations

import math
import random

import numpy as np
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

GAMMA = 4  # drafted tokens per chunk
CONF_K = 10.0
IMP_THETA = -10.0
LATE_FRACTION = 0.8  # no offload once this share of max_tokens is generated (budget < 1)
PRIOR_C_TH = 0.8
WINDOW = 512  # chunk importances remembered for the budget percentile
REFIT_EVERY = 8  # chunks between recomputations of the thresholds (every chunk while the window is short)


def p_conf(c: float, c_th: float, k: float = CONF_K) -> float:
    """Offload probability from the chunk's mean top-1 confidence ``c``."""
    if c <= c_th:
        return 1.0
    norm = (c - c_th) / max(1.0 - c_th, 1e-9) - 0.5
    return 1.0 / (1.0 + math.exp(k * norm))


def p_imp(i: float, i_th: float, theta: float = IMP_THETA) -> float:
    """Offload probability from the chunk's importance ``i`` (0 below i_th/2, 1 above i_th)."""
    if i_th <= 0:
        return 1.0
    if i <= i_th / 2:
        return 0.0
    if i > i_th:
        return 1.0
    norm = (i - i_th / 2) / (i_th / 2) - 0.5
    return 1.0 / (1.0 + math.exp(theta * norm))


def _p_conf_vec(c: np.ndarray, c_th: float, k: float = CONF_K) -> np.ndarray:
    norm = (c - c_th) / max(1.0 - c_th, 1e-9) - 0.5
    return np.where(c <= c_th, 1.0, 1.0 / (1.0 + np.exp(np.clip(k * norm, -700, 700))))


def _p_imp_vec(i: np.ndarray, i_th: float, theta: float = IMP_THETA) -> np.ndarray:
    half = i_th / 2
    norm = (i - half) / max(half, 1e-300) - 0.5
    ramp = 1.0 / (1.0 + np.exp(np.clip(theta * norm, -700, 700)))
    return np.where(i <= half, 0.0, np.where(i > i_th, 1.0, ramp))


def chunk_confidence(top1: Sequence[float]) -> float:
    return sum(top1) / len(top1) if top1 else 1.0


def chunk_importance(rows: Sequence[Sequence[float]], width: int) -> float:
    """Mean attention a chunk's tokens receive from the rows at and after them.

    ``rows[r]`` is the attention of the chunk's r-th token's row on the last
    ``width`` positions (ending at that token). Token j's column in row r (r >= j)
    is index width-1-(r-j). The newest token is only seen by itself, so each
    token's score is averaged over the rows that can see it, not summed.
    """
    n = len(rows)
    if n == 0:
        return 0.0
    scores = []
    for j in range(n):
        vals = [rows[r][width - 1 - (r - j)] for r in range(j, n) if 0 <= width - 1 - (r - j) < len(rows[r])]
        if vals:
            scores.append(sum(vals) / len(vals))
    return sum(scores) / len(scores) if scores else 0.0


@dataclass
class OffloadPolicy:
    """Per-home state of the two filters (shared by its requests, so the calibration has data)."""

    budget: float = 0.2
    c_th: float = PRIOR_C_TH
    window: deque = field(default_factory=lambda: deque(maxlen=WINDOW))  # (confidence, importance)
    offered: int = 0
    offloaded: int = 0
    _accepted_conf: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    _fit: tuple[float, float] | None = None
    _since: int = 0

    def __post_init__(self):
        if not 0.0 <= self.budget <= 1.0 or math.isnan(self.budget):
            raise ValueError(f"cloud budget must be in [0, 1], got {self.budget}")

    @property
    def verify_all(self) -> bool:
        return self.budget >= 1.0

    def thresholds(self) -> tuple[float, float]:
        """(c_th, i_th) that let about ``budget`` of the recently seen chunks through both filters.

        Expected share = mean over the window of P_conf(c, c_th) · P_imp(i, i_th). c_th starts
        at the profile (the mean confidence of chunks the verifier accepted whole) and is
        raised only when the confidence filter alone would keep more than 1 − budget of the
        chunks local (a confident drafter must not starve the budget the user set); i_th is
        then found by bisection (the share falls as i_th rises). Refit every chunk while the
        window is short, every few chunks after; vectorised, well under a millisecond.
        """
        if not self.window:
            return self.c_th, 0.0  # no data yet: the importance filter passes everything
        short = len(self.window) < 4 * REFIT_EVERY
        if self._fit is not None and self._since < (1 if short else REFIT_EVERY):
            return self._fit
        conf = np.asarray([c for c, _ in self.window], dtype=np.float64)
        imp = np.asarray([i for _, i in self.window], dtype=np.float64)
        target = self.budget
        c_th = self.c_th
        if float(_p_conf_vec(conf, c_th).mean()) < target:
            lo, hi = c_th, 1.0
            for _ in range(40):
                mid = (lo + hi) / 2
                lo, hi = (lo, mid) if float(_p_conf_vec(conf, mid).mean()) >= target else (mid, hi)
            c_th = hi
        pc = _p_conf_vec(conf, c_th)
        lo, hi = 0.0, 2.0 * float(imp.max()) + 1e-9
        for _ in range(40):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if float((pc * _p_imp_vec(imp, mid)).mean()) > target else (lo, mid)
        self._fit, self._since = (c_th, (lo + hi) / 2), 0
        return self._fit

    def decide(self, confidence: float, importance: float, generated: int, max_tokens: int,
               rng: random.Random) -> bool:
        """Offload this chunk? (Also records it for the calibration.) The budget is the share of
        the chunks that may be offloaded (those before the last 20 % of the token budget)."""
        self.offered += 1
        if self.verify_all:
            self.offloaded += 1
            return True
        if self.budget <= 0.0 or generated >= LATE_FRACTION * max_tokens:
            return False
        self.window.append((confidence, importance))
        self._since += 1
        c_th, i_th = self.thresholds()
        if rng.random() >= p_conf(confidence, c_th):
            return False  # confident: the drafter is probably right
        if rng.random() >= p_imp(importance, i_th):
            return False  # unimportant: a mistake here matters little
        self.offloaded += 1
        return True

    def observe(self, confidence: float, accepted: int, drafted: int) -> None:
        """A verified chunk: c_th follows the mean confidence of fully accepted chunks (Synera's
        offline profile, measured online), kept in the range Synera reports (0.7–0.99)."""
        if drafted and accepted >= drafted:
            self._accepted_conf.append(confidence)
            self.c_th = min(0.99, max(0.7, sum(self._accepted_conf) / len(self._accepted_conf)))
            self._fit = None

    @property
    def share(self) -> float:
        return self.offloaded / self.offered if self.offered else 0.0

    def to_dict(self) -> dict:
        c_th, i_th = self.thresholds()
        return {"budget": self.budget, "c_th": round(c_th, 3), "i_th": round(i_th, 4),
                "chunks": self.offered, "offloaded": self.offloaded, "share": round(self.share, 3)}
