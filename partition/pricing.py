"""The price of one route for a workload: what every layout is made of (``partition.layout`` compares them).

A route's :class:`Group` is the workload's prefill on it alone and its decode step at each batch size,
from the members' measured profiles and the link between them; a replica, a pipeline and a tensor group
(``partition.tensor_layout``) are all priced into one. Pure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from partition.ids import NodeId
from partition.layers import stage_memory_bytes
from partition.link import LinkModel
from partition.profile import DeviceProfile
from partition.sequence import equal_starts, flow_shop_latency, pipeline_timings
from partition.stagecount import MIN_COMPARE_CHUNK


@dataclass(frozen=True)
class Workload:
    """What the home asks of its mesh, as the planner prices it.

    ``prompt_tokens`` of which ``cached_fraction`` the prefix cache already holds,
    ``answer_tokens`` decoded, ``in_flight`` requests at once on average (1: one at a
    time). Observed by the coordinators; the defaults are a home's voice request.
    """

    prompt_tokens: int = 512
    answer_tokens: int = 64
    cached_fraction: float = 0.0
    in_flight: float = 1.0

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1 or self.answer_tokens < 0 or self.in_flight <= 0:
            raise ValueError(f"a workload needs a prompt, answers and requests: {self}")
        if not 0.0 <= self.cached_fraction < 1.0:
            raise ValueError(f"cached_fraction must be in [0, 1): {self.cached_fraction}")

    @property
    def new_tokens(self) -> int:
        """Prompt tokens a request prefills (the rest is reused from the prefix cache)."""
        return max(1, round(self.prompt_tokens * (1.0 - self.cached_fraction)))

    @property
    def cached_tokens(self) -> int:
        return self.prompt_tokens - self.new_tokens

    @property
    def requests(self) -> int:
        """Requests in flight the price is computed for (whole requests)."""
        return max(1, math.ceil(self.in_flight - 1e-9))

    def describe(self) -> str:
        cached = f", {self.cached_fraction:.0%} cached" if self.cached_fraction else ""
        return (f"{self.in_flight:g} request(s) in flight, {self.prompt_tokens}-token prompts{cached}, "
                f"{self.answer_tokens} answer tokens")


@dataclass(frozen=True)
class Group:
    """One route of a layout: a replica (one member, every layer) or a pipeline (``[first, end)`` each).

    ``prefill_s``: the workload's new tokens, alone on the group; ``step_s[b - 1]``: one
    decode step with ``b`` requests decoding on it at once.
    """

    stages: tuple[tuple[NodeId, int, int], ...]
    prefill_s: float
    step_s: tuple[float, ...]
    # a tensor-parallel group holds the (one) stage: its members in rank order, their relative speeds
    tensor: tuple[NodeId, ...] = ()
    tensor_speeds: tuple[float, ...] = ()
    tensor_attention: str = ""  # how the group holds the attention (partition.tensor_split.ATTENTIONS)

    @property
    def members(self) -> tuple[NodeId, ...]:
        return self.tensor or tuple(n for n, _, _ in self.stages)

    @property
    def is_replica(self) -> bool:
        return len(self.stages) == 1 and not self.tensor

    def latency_s(self, requests: int, answer_tokens: int) -> float:
        """Mean latency of ``requests`` arriving together: prefills queue one behind another
        (the k-th waits for k-1), decode steps batch all of them."""
        if requests <= 0:
            return 0.0
        step = self.step_s[min(requests, len(self.step_s)) - 1]
        return self.prefill_s * (requests + 1) / 2 + answer_tokens * step


def replica_fits(profile: DeviceProfile, max_seq: int) -> bool:
    """Whether ``profile``'s device holds the whole model with a ``max_seq``-token KV cache."""
    return stage_memory_bytes(profile, 0, profile.num_layers, max_seq) <= profile.memory_budget_bytes


def batch_ratio(p: DeviceProfile, rows: int, context: int) -> float:
    """How much longer a layer takes for ``rows`` decoding rows than for one (weights are read once)."""
    one = float(p.q_layer(1, context))
    return float(p.q_layer(rows, context)) / one if one > 0 else float(rows)


def prefill_s(stages: list[tuple[DeviceProfile, int, int]], link: LinkModel, work: Workload) -> float:
    """The workload's new tokens after its cached ones, pipelined over equal chunks (best count)."""
    timings = pipeline_timings(stages, link)
    new, cached = work.new_tokens, work.cached_tokens
    best = math.inf
    for k in range(1, 4 * len(stages) + 1):
        if k > 1 and new // k < MIN_COMPARE_CHUNK:
            break
        starts = cached + equal_starts(k, new + 1)[-1:]
        best = min(best, float(flow_shop_latency(timings, starts, np.array([cached + new]))[0]))
    return best


def step_s(stages: list[tuple[DeviceProfile, int, int]], link: LinkModel, work: Workload) -> tuple[float, ...]:
    """Decode step for 1..requests rows: each stage's share of its device's measured step, scaled by
    what extra rows cost there, plus its per-message cost and one hop per boundary.

    Rows of a pipeline travel together (the stages' schedulers batch what arrives together), so
    a step costs the sum of the stages: a pipeline batches no better than one device does.
    """
    context = work.prompt_tokens + work.answer_tokens // 2
    out = []
    for rows in range(1, work.requests + 1):
        total = 0.0
        for k, (p, first, end) in enumerate(stages):
            layers = float(p.q_layer(1, context))
            ends = float(p.embed_time(1)), float(p.head_time(1))
            whole = p.num_layers * layers + sum(ends)
            part = (end - first) * layers + (ends[0] if first == 0 else 0.0) \
                + (ends[1] if end == p.num_layers else 0.0)
            share = part / whole if whole > 0 else (end - first) / p.num_layers
            total += float(p.decode_step(context)) * share * batch_ratio(p, rows, context)
            if len(stages) > 1:
                total += p.chunk_overhead_s
            if k < len(stages) - 1:
                total += float(link.activation_transfer_s(rows, p.model.hidden_size, p.dtype_bytes))
        out.append(total)
    return tuple(out)


def price_group(stages: list[tuple[DeviceProfile, int, int]], link: LinkModel, work: Workload) -> Group:
    """A route's :class:`Group` from its stages (profile, first, end) in order."""
    return Group(tuple((NodeId(p.device_id), f, e) for p, f, e in stages),
                 prefill_s(stages, link, work), step_s(stages, link, work))
