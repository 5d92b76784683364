"""Sequence partitioner: where to cut a prompt into chunks for pipelined prefill.

Jupiter's DP, vectorised with numpy::

    W(1→y, k) = min_l max{ W(1→l, k−1), T*(y−l, l) }
    T*(x, l)  = +inf if x < b else h(x, l)

for every prompt length ``y ≤ S_max`` and ``k ≤ 4·|D|`` chunks. ``h(x, l)`` is
the pipeline's step time for a chunk of ``x`` tokens whose first token sits at
position ``l``: the **slowest stage's** time for it, where a stage's time is its
decoder-layer count × the per-layer ``q(x, l)`` of its device (+ embedding /
head for the end stages) + sending the chunk's activations over the link.
(Simplification: all decoder layers of a device share one measured ``q``; they
are architecturally identical.) Every chunk also pays each stage a fixed cost
the layer timings miss (the message in and out: ``DeviceProfile.chunk_overhead_s``),
which is what keeps the DP from cutting prompts into slivers; ``b`` is only a
floor (``MIN_CHUNK_FLOOR``), since the model prices short chunks itself.

For each ``k`` we take the DP's min-max split, and — so the planner is never
worse than the naive choice — the equal-length split, then predict each
candidate's prefill latency with the exact flow-shop recurrence over chunks ×
stages (``C[i,s] = max(C[i−1,s], C[i,s−1]) + h_s(chunk i)``). When every stage
has the same time per chunk this is exactly Jupiter's
``Σ h_i + (|D|−1)·max h_i``; with unequal stages it is more accurate. The
candidate with the lowest predicted latency wins, per prompt length.

The chunk-cost matrix ``T*[y, l]`` is (S_max+1)² and each ``k`` is one
``maximum`` + ``argmin`` over it; the whole table for S_max = 2048 and 4
devices (k ≤ 16), candidates and predictions included, takes 1.5–2 s on one
core of the reference machine (bench/RESULTS.md). The result is a
:class:`CutTable`: row ``y``
holds the cut points, so run-time lookup is O(1).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from partition.link import LinkModel
from partition.cuttable import CutTable
from partition.profile import DeviceProfile

INF = np.inf

#: Shortest chunk the DP may cut. The chunk-cost model prices short chunks itself (their
#: per-token cost from q(x, y) and the fixed per-chunk cost), so this is a floor against
#: degenerate cuts, not Jupiter's efficiency threshold b: with 8 stages the best cut of a
#: 2048-token prompt has ~85-token chunks, below any device's "efficient" 128.
MIN_CHUNK_FLOOR = 16


@dataclass(frozen=True)
class StageTiming:
    """How long one pipeline stage takes for a chunk (per its device's profile)."""

    profile: DeviceProfile
    num_layers: int
    has_embedding: bool
    has_head: bool
    link: LinkModel | None  # None for the last stage (nothing to send)

    def chunk_time(self, x, cached, q_layer=None):
        """Seconds for a chunk of ``x`` tokens after ``cached`` tokens (numpy-vectorised).

        ``q_layer``: the per-layer q(x, cached) when the caller already has it (stages on
        devices of one profile share it; interpolating it is most of the planner's time).
        """
        p = self.profile
        x = np.asarray(x, dtype=float)
        t = self.num_layers * (p.q_layer(x, cached) if q_layer is None else q_layer)
        if self.has_embedding:
            t = t + p.embed_time(x)
        if self.has_head:
            t = t + p.head_time(x)
        if self.link is not None:
            t = t + self.link.activation_transfer_s(x, p.model.hidden_size, p.dtype_bytes)
        return t + p.chunk_overhead_s


def pipeline_timings(stages, link: LinkModel) -> list[StageTiming]:
    """The timing model of a pipeline from ``(profile, first, end)`` per stage, in order: the
    first stage embeds, the one ending at the last layer runs the head, all but the last send."""
    stages = list(stages)
    last = len(stages) - 1
    return [StageTiming(p, end - first, first == 0, end == p.num_layers, None if k == last else link)
            for k, (p, first, end) in enumerate(stages)]


def chunk_cost_matrix(stages: list[StageTiming], max_seq: int, block: int = 256) -> np.ndarray:
    """``T[y, l]`` = slowest stage's time for the chunk [l, y); +inf where y ≤ l.

    Built in row blocks to keep temporaries small (S_max² floats per array).
    """
    n = max_seq + 1
    T = np.full((n, n), INF)
    l_all = np.arange(n)
    for y0 in range(1, n, block):
        y = np.arange(y0, min(n, y0 + block))[:, None]
        x = y - l_all[None, :]
        valid = x >= 1
        xs = np.where(valid, x, 1)
        ls = np.broadcast_to(l_all[None, :], xs.shape)
        qs = _SharedQ(xs, ls)
        h = stages[0].chunk_time(xs, ls, qs(stages[0]))
        for st in stages[1:]:
            h = np.maximum(h, st.chunk_time(xs, ls, qs(st)))
        T[y0:y0 + len(y)] = np.where(valid, h, INF)
    return T


class _SharedQ:
    """q(x, y) of one set of chunks, interpolated once per distinct profile grid."""

    def __init__(self, x, y):
        self.x, self.y, self._by_grid = x, y, {}

    def __call__(self, stage: StageTiming):
        grid = stage.profile.q
        if grid not in self._by_grid:
            self._by_grid[grid] = grid(self.x, self.y)
        return self._by_grid[grid]


def minmax_table(T: np.ndarray, k_max: int, b: int):
    """Jupiter's W table: ``W[k, y]`` = least possible slowest chunk over k chunks.

    Chunks shorter than ``b`` are not allowed (T* = +inf), except that a prompt
    may always be one chunk (``single[y]``), so short prompts still have a plan.
    Returns ``(W, arg, single)``; ``arg[k, y]`` is the start of the last chunk.
    """
    n = T.shape[0]
    y = np.arange(n)
    Tstar = np.where(np.tri(n, n, k=-b, dtype=bool), T, INF)  # l <= y - b
    W = np.full((k_max + 1, n), INF)
    arg = np.zeros((k_max + 1, n), dtype=np.int64)
    W[1] = Tstar[:, 0]
    for k in range(2, k_max + 1):
        m = np.maximum(W[k - 1][None, :], Tstar)
        a = m.argmin(axis=1)
        arg[k] = a
        W[k] = m[y, a]
    single = T[:, 0].copy()
    return W, arg, single


def backtrack_starts(arg: np.ndarray, k: int, n: int) -> np.ndarray:
    """Chunk start positions for every prompt length: array [n, k] (row y)."""
    starts = np.zeros((n, k), dtype=np.int64)
    cur = np.arange(n)
    for j in range(k, 1, -1):
        cur = arg[j][cur]
        starts[:, j - 1] = cur
    return starts


def equal_starts(k: int, n: int) -> np.ndarray:
    """Equal-length split (first chunks one shorter when y is not a multiple of k)."""
    y = np.arange(n)[:, None]
    j = np.arange(k)[None, :]
    return (j * y) // k


def flow_shop_latency(stages: list[StageTiming], starts: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Predicted prefill latency of chunks ``starts`` (rows) through the stage pipeline.

    ``starts[r]`` are chunk start positions of a prompt of length ``y[r]``.
    """
    rows, k = starts.shape
    ends = np.concatenate([starts[:, 1:], y[:, None]], axis=1)
    done = np.zeros((len(stages), rows))
    for i in range(k):
        x = np.maximum(ends[:, i] - starts[:, i], 1)
        qs = _SharedQ(x, starts[:, i])
        for s, st in enumerate(stages):
            h = st.chunk_time(x, starts[:, i], qs(st))
            prev = done[s - 1] if s else 0.0
            done[s] = np.maximum(done[s], prev) + h
    return done[-1]


def jupiter_latency(chunk_times, num_stages: int) -> float:
    """Jupiter's closed form ``Σ h_i + (|D|−1)·max h_i`` (stages of equal time per chunk)."""
    h = np.asarray(chunk_times, dtype=float)
    return float(h.sum() + (num_stages - 1) * h.max())


def build_cut_table(
    stages: list[StageTiming],
    max_seq: int,
    *,
    k_max: int | None = None,
    min_chunk: int | None = None,
) -> CutTable:
    """The cut table for every prompt length 1..max_seq (row 0 is the empty prompt)."""
    n_stages = len(stages)
    k_max = k_max or 4 * n_stages
    b = min_chunk or min(MIN_CHUNK_FLOOR, max(st.profile.min_chunk for st in stages))
    n = max_seq + 1
    T = chunk_cost_matrix(stages, max_seq)
    W, arg, _ = minmax_table(T, k_max, b)
    y = np.arange(n)

    best_lat = flow_shop_latency(stages, np.zeros((n, 1), dtype=np.int64), y)
    best_lat[0] = 0.0
    best_k = np.ones(n, dtype=np.int64)
    best_kind = np.zeros(n, dtype=np.int64)  # 0 = DP split, 1 = equal split
    for k in range(2, k_max + 1):
        ok = np.isfinite(W[k])
        if not ok.any():
            break
        for kind, starts in ((0, backtrack_starts(arg, k, n)), (1, equal_starts(k, n))):
            valid = ok if kind == 0 else (y // k >= b)
            if not valid.any():
                continue
            lat = flow_shop_latency(stages, starts[valid], y[valid])
            idx = np.nonzero(valid)[0]
            better = lat < best_lat[idx] * (1 - 1e-12)
            upd = idx[better]
            best_lat[upd] = lat[better]
            best_k[upd] = k
            best_kind[upd] = kind
    cuts = []
    cache: dict[tuple[int, int], np.ndarray] = {}
    for yy in range(n):
        k, kind = int(best_k[yy]), int(best_kind[yy])
        if k == 1:
            cuts.append(())
            continue
        key = (k, kind)
        if key not in cache:
            cache[key] = backtrack_starts(arg, k, n) if kind == 0 else equal_starts(k, n)
        cuts.append(tuple(int(v) for v in cache[key][yy, 1:]))
    return CutTable(
        max_seq=max_seq,
        k_max=k_max,
        min_chunk=b,
        cuts=tuple(cuts),
        latency_s=tuple(float(v) for v in best_lat),
    )


def round_cost_slope(stages: list[StageTiming], context: int = 256, m: int = 8) -> float:
    """What each extra token of an m-token decode round costs, relative to a 1-token step.

    A speculative verify round pushes the root and m−1 candidates through every
    stage at once; from the profiles' q(x, y) this is (T(m) − T(1)) / ((m − 1)·T(1)).
    The coordinator starts from this prior and then learns from the rounds it runs.
    """
    t1 = float(sum(s.chunk_time(1, context) for s in stages))
    tm = float(sum(s.chunk_time(m, context) for s in stages))
    if t1 <= 0 or m <= 1:
        return 0.0
    return max(0.0, (tm - t1) / ((m - 1) * t1))
