"""Measure one device running one model and produce a :class:`DeviceProfile`.

What is timed, and how (all through the stage runtime's public forward, with
the real weights and shapes, ``torch.set_num_threads(threads)``):

* **Units as stages.** The whole model is loaded once; each unit is timed as a
  ``StageModel`` *view* sharing those weights: an embedding-only first stage, a
  one-decoder-layer middle stage per layer, a head-only last stage (prefill
  asks for the last position's logits only, ``all_logits=False``, as the
  pipeline does). A view also pays the stage's fixed overhead (RoPE tables, KV
  bookkeeping, < 1 % of a layer), so t_l is a faithful per-layer cost.
* **t_l** – every unit at each calibration length (``layer_repeats`` times).
* **q(x, y)** – one representative decoder layer on the (x, y) grid, fastest
  of ``repeats`` (short runs repeated more, see ``MIN_SAMPLE_S``), then made
  monotone in x and y (:func:`partition.interpolate.monotone_envelope`). The y cached tokens are written straight into the KV cache as
  random keys/values (attention cost does not depend on their values), which
  saves a prefill per grid row. Off-grid points are measured too, and the
  bilinear interpolation error is stored in ``q_error``.
* **Decode** – a whole-model single-token step at several context lengths
  (cache filled the same way).
* **b** – the shortest grid chunk whose whole-model per-token latency is within
  10 % of the best.
* **Memory** – weight bytes per unit from the loaded tensors, KV bytes per
  token per layer from the cache, budget = total RAM × (1 − headroom).

A warm-up pass over the grid shapes comes first so first-call allocations are
not timed. Timings are the fastest of several runs around ``forward``, on the
thread's CPU clock when torch uses one thread (see :func:`measurement_clock`),
so a profile taken on a busy machine still describes the device itself.

It runs the model (``decoding``), so it lives above the lower floors, beside the
daemon's self-profile that uses it; what it writes (``partition.profile``), the
settings it takes (``partition.profile_settings``) and the arithmetic on its timings
(``partition.interpolate``) are pure and stay in ``partition``.
"""

from __future__ import annotations

import os
import platform
import socket
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone

import numpy as np

from meshd.log import get_logger
from partition.interpolate import bilinear, min_efficient_chunk, monotone_envelope
from partition.machine import cpu_name, default_device_id, total_memory_bytes
from partition.profile import DeviceProfile, ModelInfo, QGrid, memory_budget
from partition.profile_settings import ProfileSettings

log = get_logger("meshd.model.profiler")

#: off-grid (x, y) points used to measure the interpolation error, as fractions of max_seq
ERROR_POINTS = ((3 / 2048, 1800 / 2048), (48 / 2048, 384 / 2048), (200 / 2048, 700 / 2048),
                (700 / 2048, 1200 / 2048), (1500 / 2048, 300 / 2048))


#: short runs are repeated until their samples add up to this many seconds ...
MIN_SAMPLE_S = 0.05
#: ... or this many repeats
MAX_REPEATS = 15


def measurement_clock(threads: int):
    """The clock timings are read from.

    With one torch thread every op runs on the calling thread, so its CPU time
    (``time.thread_time``) is the run time the device would have on its own and
    does not count the moments a busy machine (other apps, other tenants)
    takes the core away. With several threads their work is spread over a
    pool, so wall time (``perf_counter``) is used and the device should be idle.
    """
    return time.thread_time if threads == 1 else time.perf_counter


@dataclass
class _Progress:
    """A tqdm bar on stderr (or nothing); counts measurements."""

    total: int
    enabled: bool = True
    _bar: object = field(default=None, init=False)

    def __post_init__(self):
        if self.enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=self.total, desc="profiling", unit="run", dynamic_ncols=True,
                             file=__import__("sys").stderr)

    def step(self, what: str, n: int = 1):
        if self._bar is not None:
            self._bar.set_postfix_str(what, refresh=False)
            self._bar.update(n)

    def close(self):
        if self._bar is not None:
            self._bar.close()


def profile_device(
    source,
    settings: ProfileSettings = ProfileSettings(),
    *,
    device_id: str | None = None,
    progress: bool = True,
) -> DeviceProfile:
    """Measure ``source`` (a ``decoding.loader.ModelSource``) on this device."""
    import torch

    s = settings.resolved()
    torch.set_num_threads(s.threads)
    dtype, packed = _numerics(s.dtype)
    cfg = source.config
    L = cfg.num_layers
    S = s.max_seq
    rng = torch.Generator().manual_seed(0)
    clock = measurement_clock(s.threads)

    n_runs = (
        1  # load
        + len(s.q_x)  # warm-up
        + len(s.q_y) * len(s.q_x) + len(ERROR_POINTS)
        + (L + 2) * len(s.calib_seq_lens)
        + len(s.decode_context)
    )
    bar = _Progress(n_runs, progress)
    t_start = time.perf_counter()
    full = source.load_stage(0, L, dtype, packed=packed)
    bar.step("load")

    def view(layers, first, end, embed=None, norm=None, head=None):
        # Same tensors as ``full``, in its numeric mode; [first, end) only decides which ends run.
        return full.view(layers, first, end, embed, norm, head)

    rep = view([full.layers[L // 2]], 1, 2)
    embed_stage = view([], 0, 0, embed=full.embed)
    head_stage = view([], L, L, norm=full.final_norm, head=full.lm_head)

    def hidden(n):
        return torch.randn(n, cfg.hidden_size, generator=rng).to(dtype)

    def token_ids(n):
        return torch.randint(0, cfg.vocab_size, (n,), generator=rng)

    def prepared_cache(stage, cached: int, extra: int):
        kv = stage.new_cache(1 << 20)
        kv.create("p", cached + extra)
        if cached and stage.num_layers:
            off = kv.reserve("p", cached)
            for li in range(stage.num_layers):
                k = torch.randn(cfg.num_kv_heads, cached, cfg.head_dim, generator=rng).to(dtype)
                kv.write("p", li, off, k, k.clone())
            kv.commit("p", cached)
        elif cached:
            kv.reserve("p", cached)
            kv.commit("p", cached)
        return kv

    def timed(stage, kv, cached, inp, reps, all_logits=False):
        """Fastest of ``reps`` runs (more for short runs, up to ~MIN_SAMPLE_S of samples)."""
        ts = []
        while len(ts) < reps or (sum(ts) < MIN_SAMPLE_S and len(ts) < MAX_REPEATS):
            kv.truncate("p", cached)
            t0 = clock()
            stage.forward(kv, "p", inp, all_logits=all_logits)
            ts.append(clock() - t0)
        return min(ts)

    # warm-up: every chunk shape once, on every kind of stage
    kv = prepared_cache(rep, 0, max(s.q_x))
    for x in s.q_x:
        timed(rep, kv, 0, hidden(x), 1)
        for st, inp in ((embed_stage, token_ids(x)), (head_stage, hidden(x))):
            timed(st, prepared_cache(st, 0, x), 0, inp, 1)
        bar.step(f"warm-up x={x}")

    # q(x, y) on the grid for the representative layer
    qgrid = np.zeros((len(s.q_x), len(s.q_y)))
    for j, y in enumerate(s.q_y):
        kv = prepared_cache(rep, y, max(s.q_x))
        for i, x in enumerate(s.q_x):
            qgrid[i, j] = timed(rep, kv, y, hidden(x), s.repeats)
            bar.step(f"q x={x} y={y}")
    qgrid = monotone_envelope(qgrid)

    # interpolation error at off-grid points
    err_points = []
    for fx, fy in ERROR_POINTS:
        x, y = max(1, round(fx * S)), round(fy * S)
        kv = prepared_cache(rep, y, x)
        meas = timed(rep, kv, y, hidden(x), s.repeats)
        pred = float(bilinear(s.q_x, s.q_y, qgrid, x, y))
        err_points.append([x, y, meas, pred, (pred - meas) / meas])
        bar.step(f"q error x={x} y={y}")
    rel = [abs(p[4]) for p in err_points]

    # t_l: every unit at every calibration length
    lat = np.zeros((L + 2, len(s.calib_seq_lens)))
    for c, n in enumerate(s.calib_seq_lens):
        kv = prepared_cache(embed_stage, 0, n)
        lat[0, c] = timed(embed_stage, kv, 0, token_ids(n), max(s.layer_repeats, 1))
        bar.step(f"t embed n={n}")
        inp = hidden(n)
        for li in range(L):
            st = view([full.layers[li]], 1, 2)
            kv = prepared_cache(st, 0, n)
            lat[1 + li, c] = timed(st, kv, 0, inp, s.layer_repeats)
            bar.step(f"t layer {li} n={n}")
        kv = prepared_cache(head_stage, 0, n)
        lat[L + 1, c] = timed(head_stage, kv, 0, inp, s.repeats)
        bar.step(f"t head n={n}")

    lat = monotone_envelope(lat, axes=(1,))  # per unit, along the sequence length

    # decode step vs context, whole model
    dec = {}
    kv = prepared_cache(full, max(s.decode_context), 1)
    for ctx in sorted(s.decode_context, reverse=True):  # the cache can only be rolled back
        dec[ctx] = timed(full, kv, ctx, token_ids(1), s.repeats)
        bar.step(f"decode ctx={ctx}")
    dec = list(monotone_envelope(np.array([dec[c] for c in s.decode_context])))
    bar.close()

    # b from the whole-model per-chunk latency at y = 0
    calib = np.asarray(s.calib_seq_lens, dtype=float)
    per_chunk = [L * qgrid[i, 0] + float(np.interp(x, calib, lat[0])) + float(np.interp(x, calib, lat[-1]))
                 for i, x in enumerate(s.q_x)]
    b = min_efficient_chunk(s.q_x, per_chunk)

    from decoding.linear import nbytes

    weight_bytes = ([nbytes(full.embed)] + [lw.nbytes() for lw in full.layers]
                    + [nbytes(full.final_norm) + nbytes(full.lm_head)])
    kv_per_token_layer = full.new_cache(1).bytes_per_token() // L
    total = s.memory_bytes if s.memory_bytes is not None else total_memory_bytes()
    elapsed = time.perf_counter() - t_start
    log.info("profiled", seconds=round(elapsed, 1), min_chunk=b, q_max_rel_error=max(rel))

    import torch as _t

    return DeviceProfile(
        device_id=device_id or default_device_id(s.threads),
        model=ModelInfo(
            identity=source.identity, arch=cfg.arch, num_layers=L, hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size, vocab_size=cfg.vocab_size,
            num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
            tie_embeddings=bool(cfg.tie_embeddings),
        ),
        dtype=s.dtype,
        threads=s.threads,
        torch_version=_t.__version__,
        measured_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        calib_seq_lens=tuple(s.calib_seq_lens),
        layer_latency_s=tuple(tuple(float(v) for v in row) for row in lat),
        q=QGrid(tuple(s.q_x), tuple(s.q_y), tuple(tuple(float(v) for v in row) for row in qgrid)),
        decode_context=tuple(s.decode_context),
        decode_step_s=tuple(float(v) for v in dec),
        min_chunk=b,
        weight_bytes=tuple(int(v) for v in weight_bytes),
        kv_bytes_per_token_per_layer=int(kv_per_token_layer),
        memory_total_bytes=int(total),
        memory_headroom=float(s.headroom),
        memory_budget_bytes=memory_budget(int(total), s.headroom),
        q_error={
            "method": "bilinear in (x, y), linear extrapolation outside the grid",
            "points": [[int(p[0]), int(p[1]), float(p[2]), float(p[3]), float(p[4])] for p in err_points],
            "columns": ["x", "y", "measured_s", "interpolated_s", "rel_error"],
            "max_abs_rel_error": float(max(rel)),
            "mean_abs_rel_error": float(sum(rel) / len(rel)),
        },
        settings=s.to_dict(),
        host={
            "hostname": socket.gethostname(),
            "machine": platform.machine(),
            "cpu": cpu_name(),
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
            "profile_seconds": round(elapsed, 1),
        },
    )


def reusable(existing: DeviceProfile, identity: str, settings: ProfileSettings) -> bool:
    """A saved profile can stand in for a new measurement: same model, settings, torch."""
    import torch

    return (
        existing.model.identity == identity
        and existing.settings == settings.to_dict()
        and existing.torch_version == torch.__version__
        and existing.threads == settings.threads
        and existing.dtype == settings.dtype
        and existing.scaled_from is None
    )


#: chunk lengths (x, y) the quick speed estimate times, as fractions of max_seq
QUICK_POINTS = ((128 / 2048, 0.0), (512 / 2048, 0.0), (512 / 2048, 0.5))


def _numerics(mode: str):
    """(activation dtype, packing) of a profile's numeric mode, as a CPU stage computes in it."""
    import torch

    from decoding.device import resolve_weights

    return resolve_weights(mode, torch.device("cpu"))


def estimate_speed(source, reference: DeviceProfile, threads: int = 1, repeats: int = 3, clock=None) -> float:
    """This device's speed relative to ``reference`` from one decoder layer (seconds, not minutes).

    Loads a single middle layer, times it at a few (x, y) points with the same
    clock as the full profiler (or ``clock``) and returns the geometric mean of
    ``reference.q(x, y) / measured``. Use with :func:`partition.scaling.scale`.
    A daemon timing itself passes the wall clock: a CPU quota (a container, a
    NAS's limits) slows what it serves but not the CPU time one thread reads.
    """
    import torch

    torch.set_num_threads(threads)
    cfg = source.config
    if cfg.num_layers != reference.num_layers or source.identity != reference.model.identity:
        log.warning("quick_profile_other_model", reference=reference.model.identity,
                    model=source.identity)
    mid = cfg.num_layers // 2
    dtype, packed = _numerics(reference.dtype)
    stage = source.load_stage(mid, mid + 1, dtype, packed=packed)
    clock = clock or measurement_clock(threads)
    S = int(reference.settings.get("max_seq", reference.q.y[-1]))
    rng = torch.Generator().manual_seed(0)
    ratios = []
    for fx, fy in QUICK_POINTS:
        x, y = max(1, round(fx * S)), round(fy * S)
        kv = stage.new_cache(1 << 20)
        kv.create("p", x + y)
        if y:
            off = kv.reserve("p", y)
            k = torch.randn(cfg.num_kv_heads, y, cfg.head_dim, generator=rng).to(dtype)
            kv.write("p", 0, off, k, k.clone())
            kv.commit("p", y)
        inp = torch.randn(x, cfg.hidden_size, generator=rng).to(dtype)
        stage.forward(kv, "p", inp, all_logits=False)  # warm-up
        ts = []
        for _ in range(repeats):
            kv.truncate("p", y)
            t0 = clock()
            stage.forward(kv, "p", inp, all_logits=False)
            ts.append(clock() - t0)
        ratios.append(float(reference.q_layer(x, y)) / min(ts))
    return float(np.exp(np.mean(np.log(ratios))))
