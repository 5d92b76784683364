"""The arithmetic on measured timings: reading between a profile's points, and cleaning them.

A profile holds latencies at a few measured points; the planners need them anywhere
(``interp1`` along one axis, ``bilinear`` on the (x, y) grid of a decoder layer, both
extrapolating linearly and never below zero). The profiler cleans what it measured
(``monotone_envelope``: interference only ever adds time) and picks the shortest chunk
that is still efficient (``min_efficient_chunk``). Plain numpy, no model: the profile
type (``partition.profile``), the synthetic profiles and the profiler share it.
"""

from __future__ import annotations

import numpy as np

#: A chunk is "efficient" when its per-token latency is within this factor of the best.
EFFICIENT_CHUNK_SLACK = 1.10


def _bracket(grid, v):
    """Index of the left grid point of the segment used for ``v`` and the position in it."""
    g = np.asarray(grid, dtype=float)
    v = np.asarray(v, dtype=float)
    i = np.clip(np.searchsorted(g, v, side="right") - 1, 0, len(g) - 2)
    t = (v - g[i]) / (g[i + 1] - g[i])
    return i, t


def interp1(xs, ys, x):
    """Piecewise-linear interpolation with linear extrapolation at both ends (floored at 0)."""
    ys = np.asarray(ys, dtype=float)
    if len(xs) == 1:  # one calibration point: assume proportional to length
        return np.maximum(ys[0] * np.asarray(x, dtype=float) / float(xs[0]), 0.0)
    i, t = _bracket(xs, x)
    return np.maximum(ys[i] + t * (ys[i + 1] - ys[i]), 0.0)


def bilinear(xs, ys, grid, x, y):
    """Bilinear interpolation on a rectangular grid, linear extrapolation outside it."""
    g = np.asarray(grid, dtype=float)
    i, tx = _bracket(xs, x)
    j, ty = _bracket(ys, y)
    v = ((1 - tx) * (1 - ty) * g[i, j] + tx * (1 - ty) * g[i + 1, j]
         + (1 - tx) * ty * g[i, j + 1] + tx * ty * g[i + 1, j + 1])
    return np.maximum(v, 0.0)


def min_efficient_chunk(xs, per_chunk_s, slack: float = EFFICIENT_CHUNK_SLACK) -> int:
    """b: the shortest chunk whose per-token latency is within ``slack`` of the best."""
    xs = np.asarray(xs, dtype=float)
    per_token = np.asarray(per_chunk_s, dtype=float) / xs
    best = per_token.min()
    ok = np.nonzero(per_token <= best * slack)[0]
    return int(xs[ok[0]])


def monotone_envelope(t: np.ndarray, axes: tuple[int, ...] | None = None) -> np.ndarray:
    """Make timings non-decreasing along every axis, trusting the *faster* reading.

    Interference on a shared device only ever adds time, so when a point with
    more work (longer chunk, longer cache) was measured faster than one with
    less, the slower reading was disturbed: ``t[i, j] = min(t[i', j'] for
    i' ≥ i, j' ≥ j)``. Applied after taking the fastest of several repeats.
    """
    out = np.asarray(t, dtype=float).copy()
    for axis in range(out.ndim) if axes is None else axes:
        flipped = np.flip(out, axis=axis)
        out = np.flip(np.minimum.accumulate(flipped, axis=axis), axis=axis)
    return out
