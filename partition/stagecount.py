"""How many devices a prompt should cross: fewer when one more would not pay for itself.

The layer DP minimises the slowest stage, and almost any extra device lowers that
a little. But a pipelined prefill pays every stage once more while the pipeline
fills and drains (Σ h + (N−1)·max h for equal stages), each stage adds a link hop
and a per-chunk message cost, and every decoded token crosses every hop. So a slow
device, or one behind a slow link, can lower the bottleneck and still make the
prompt slower. This module plans the layers once per device count and keeps the
count whose *predicted prefill* (the sequence planner's flow-shop model over
the chunkings it would choose) is lowest — a device joins the plan only when it
cuts that prediction by at least ``MIN_GAIN``. Pure: profiles and a link in, a
:class:`~partition.layers.LayerPlanResult` out.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from partition.layers import (
    LayerPlanResult,
    LayerSplit,
    PlanError,
    partition_layers,
)
from partition.link import LinkModel
from partition.profile import DeviceProfile
from partition.sequence import StageTiming, equal_starts, flow_shop_latency, pipeline_timings

#: share of the predicted prefill one more device must save to be used
MIN_GAIN = 0.02

#: shortest chunk the stage-count comparison cuts prompts into (tokens)
MIN_COMPARE_CHUNK = 16


def split_timings(split: LayerSplit, profiles: list[DeviceProfile], link: LinkModel) -> list[StageTiming]:
    """The sequence planner's per-stage timing model for a layer split."""
    return pipeline_timings(((profiles[d], first, end) for d, first, end in split.stages), link)


def predicted_prefill_s(stages: list[StageTiming], seq_len: int, k_max: int | None = None) -> tuple[float, int]:
    """(least predicted prefill, chunk count) of a ``seq_len``-token prompt over equal chunks.

    Equal chunks are within a few per cent of the sequence DP's cuts (RESULTS.md,
    "Pipeline"), and cost one flow-shop evaluation per chunk count instead of a
    table over every prompt length: cheap enough to compare every device count.
    """
    k_max = k_max or 4 * len(stages)
    y = np.array([seq_len])
    best, best_k = float("inf"), 1
    for k in range(1, k_max + 1):
        if k > 1 and seq_len // k < MIN_COMPARE_CHUNK:
            break
        t = float(flow_shop_latency(stages, equal_starts(k, seq_len + 1)[-1:], y)[0])
        if t < best:
            best, best_k = t, k
    return best, best_k


def plan_layers(
    profiles: list[DeviceProfile],
    link: LinkModel,
    seq_len: int,
    max_seq: int,
    *,
    min_gain: float = MIN_GAIN,
    **kw,
) -> LayerPlanResult:
    """The layer plan over the number of devices that makes a ``seq_len`` prompt fastest.

    Raises what :func:`partition_layers` raises when even the full device set
    cannot hold the model.
    """
    full = partition_layers(profiles, link, seq_len, max_seq, **kw)
    n_full = len(full.split.stages)
    if n_full == 1:
        return full
    options: dict[int, tuple[LayerPlanResult, float]] = {}
    options[n_full] = (full, predicted_prefill_s(split_timings(full.split, profiles, link), seq_len)[0])
    for n in range(n_full - 1, 0, -1):
        try:
            res = partition_layers(profiles, link, seq_len, max_seq, max_stages=n, **kw)
        except PlanError:
            continue  # these many devices cannot hold the model (the heuristic may still find fewer)
        options[len(res.split.stages)] = (
            res, predicted_prefill_s(split_timings(res.split, profiles, link), seq_len)[0])
    # Walk up from the fewest devices; move to a larger count only when it beats the count
    # held so far by min_gain. So fewer devices are never predicted faster than the choice,
    # and no larger count saves min_gain over it.
    counts = sorted(options)
    chosen = counts[0]
    for n in counts[1:]:
        if options[n][1] < options[chosen][1] * (1 - min_gain):
            chosen = n
    res, t = options[chosen]
    if chosen == n_full:
        return res
    used = {profiles[d].device_id for d, _, _ in res.split.stages}
    left = [p.device_id for p in profiles if p.device_id not in used
            and any(profiles[d].device_id == p.device_id for d, _, _ in full.split.stages)]
    why = (f"{', '.join(left)} left out: a {seq_len}-token prompt is predicted to take {t:.3f} s "
           f"on {chosen} device(s) and {options[n_full][1]:.3f} s on {n_full} (pipeline fill, "
           f"link hops and per-chunk costs outweigh the compute they would take over)")
    return replace(res, explanation=f"{res.explanation}; {why}", left_out=why)
