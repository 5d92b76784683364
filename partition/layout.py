"""Layouts: whole-model replicas, one pipeline, or both — priced end to end for a workload.

One pipeline over every member wins a lone long prompt (its prefill is split over the
devices) but loses everything else: every decoded token crosses every stage and every
hop, and with several requests in flight each stage reads its weights for the same rows
the others do, so the home batches no better than its best device. Members that can hold
the whole model can instead each run it alone (replicas), batching their own requests;
members that only hold it together form a pipeline group beside them (mixed).

This module prices each layout for a :class:`Workload` — prefill of the prompt's new
tokens after what the prefix cache holds, plus answer tokens × the decode step at the
batch the group would run, plus the wait behind the other requests' prefills — and
keeps the cheapest. A request router spreads the workload's in-flight requests over the
layout's groups the way the coordinator does per request (each to the group where it
adds least), so the price is the mean latency a request would see. Pure: profiles, a
link and a workload in, a :class:`Layout` out; :func:`brute_force_layout` is the
exhaustive reference the tests hold it against.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import numpy as np

from partition.ids import NodeId
from partition.layers import PlanError, partition_layers, stage_memory_bytes
from partition.link import LinkModel
from partition.profile import DeviceProfile
from partition.sequence import equal_starts, flow_shop_latency, pipeline_timings
from partition.stagecount import MIN_COMPARE_CHUNK, plan_layers

LAYOUT_KINDS = ("auto", "pipeline", "replicas", "tensor")

#: bytes of one activation element between a tensor group's members (float32: the group adds exactly
#: what an in-process group adds; decoding.tensor_group)
TENSOR_ACTIVATION_BYTES = 4
#: what one exchange of partial sums costs beyond the link's round trip: the sockets, the encryption and
#: the hand-off into and out of the compute thread. Measured (bench/tensor_parallel.py: 108 us an exchange
#: between two pinned processes on loopback, AMD EPYC VM); a group that measures its own replaces it.
TENSOR_EXCHANGE_OVERHEAD_S = 100e-6

#: predicted prices this close count as a tie (the prediction is not finer than that)
SIMPLER_MARGIN = 0.03


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


@dataclass(frozen=True)
class Layout:
    """Routes the home serves on, the requests the router would give each, and the predicted price."""

    kind: str  # "pipeline" | "replicas" | "mixed"
    groups: tuple[Group, ...]
    shares: tuple[int, ...]  # requests of the workload routed to each group
    latency_s: float  # mean predicted latency of a request at the workload
    workload: Workload
    unused: tuple[NodeId, ...] = ()
    reason: str = ""
    alternatives: dict = field(default_factory=dict, compare=False)  # kind -> predicted latency

    @property
    def routes(self) -> tuple[tuple[tuple[NodeId, int, int], ...], ...]:
        return tuple(g.stages for g in self.groups)


def replica_fits(profile: DeviceProfile, max_seq: int) -> bool:
    """Whether ``profile``'s device holds the whole model with a ``max_seq``-token KV cache."""
    return stage_memory_bytes(profile, 0, profile.num_layers, max_seq) <= profile.memory_budget_bytes


def _batch_ratio(p: DeviceProfile, rows: int, context: int) -> float:
    """How much longer a layer takes for ``rows`` decoding rows than for one (weights are read once)."""
    one = float(p.q_layer(1, context))
    return float(p.q_layer(rows, context)) / one if one > 0 else float(rows)


def _prefill_s(stages: list[tuple[DeviceProfile, int, int]], link: LinkModel, work: Workload) -> float:
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


def _step_s(stages: list[tuple[DeviceProfile, int, int]], link: LinkModel, work: Workload) -> tuple[float, ...]:
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
            total += float(p.decode_step(context)) * share * _batch_ratio(p, rows, context)
            if len(stages) > 1:
                total += p.chunk_overhead_s
            if k < len(stages) - 1:
                total += float(link.activation_transfer_s(rows, p.model.hidden_size, p.dtype_bytes))
        out.append(total)
    return tuple(out)


def price_group(stages: list[tuple[DeviceProfile, int, int]], link: LinkModel, work: Workload) -> Group:
    """A route's :class:`Group` from its stages (profile, first, end) in order."""
    return Group(tuple((NodeId(p.device_id), f, e) for p, f, e in stages),
                 _prefill_s(stages, link, work), _step_s(stages, link, work))


def tensor_fits(members: list[DeviceProfile], max_seq: int) -> bool:
    """Whether ``members`` hold the whole model between them, each its speed's share of every layer,
    and the model's heads split over that many (partition.tensor_split, blocks of one element: the
    file's own block widths are checked where the members load it)."""
    from partition.tensor_split import LayerShape, SplitError, split_layers

    m = members[0].model
    speeds = _tensor_speeds(members, 1)
    try:
        split_layers(LayerShape(m.num_heads, m.num_kv_heads, m.head_dim, m.intermediate_size, m.vocab_size),
                     len(members), speeds)
    except SplitError:
        return False
    whole = [stage_memory_bytes(p, 0, p.num_layers, max_seq) for p in members]
    return all(need * s / sum(speeds) <= p.memory_budget_bytes for p, need, s in zip(members, whole, speeds))


def _tensor_speeds(members: list[DeviceProfile], context: int) -> tuple[float, ...]:
    """Each member's relative speed: decode steps per second on its own (the split gives it that share)."""
    return tuple(1.0 / max(float(p.decode_step(context)), 1e-9) for p in members)


#: homes up to this size price a tensor group over every subset of members; larger ones over the k fastest
TENSOR_SUBSETS_UP_TO = 6


def _tensor_candidates(ranked: list[DeviceProfile]) -> list[list[DeviceProfile]]:
    """The member sets a tensor group may be formed of (each fastest first)."""
    if len(ranked) <= TENSOR_SUBSETS_UP_TO:
        return [list(c) for k in range(2, len(ranked) + 1) for c in itertools.combinations(ranked, k)]
    return [ranked[:k] for k in range(2, len(ranked) + 1)]


def price_tensor_group(members: list[DeviceProfile], link: LinkModel, work: Workload,
                       exchange_overhead_s: float = TENSOR_EXCHANGE_OVERHEAD_S) -> Group:
    """A tensor-parallel group over ``members`` holding every layer: each computes its speed's share of
    every product (so all finish together), and every layer waits for two exchanges of partial sums, the
    head for one more. An exchange is priced as one of the link's round trips plus its bytes — on a
    LAN the round trips are the cost, which is why a group pays for big models on fast links only."""
    context = work.prompt_tokens + work.answer_tokens // 2
    speeds = _tensor_speeds(members, context)
    total = sum(speeds)
    lead = members[0]
    L, hidden = lead.num_layers, lead.model.hidden_size
    syncs = 2 * L + 1

    def exchanges_s(rows: int) -> float:
        return syncs * (float(link.activation_transfer_s(rows, hidden, TENSOR_ACTIVATION_BYTES))
                        + exchange_overhead_s)

    steps = []
    for rows in range(1, work.requests + 1):
        compute = max(float(p.decode_step(context)) * (sp / total) * _batch_ratio(p, rows, context)
                      for p, sp in zip(members, speeds))
        steps.append(compute + exchanges_s(rows))
    prefill = max(_prefill_s([(p, 0, L)], link, work) * (sp / total) for p, sp in zip(members, speeds))
    prefill += exchanges_s(work.new_tokens)
    return Group(((NodeId(lead.device_id), 0, L),), prefill, tuple(steps),
                 tuple(NodeId(p.device_id) for p in members), tuple(round(sp / total, 6) for sp in speeds))


def route_requests(groups: tuple[Group, ...], work: Workload) -> tuple[tuple[int, ...], float]:
    """(requests per group, mean latency): each of the workload's requests goes where it adds least,
    as the coordinator routes them one by one."""
    shares = [0] * len(groups)
    total = 0.0
    for _ in range(work.requests):
        costs = [g.latency_s(s + 1, work.answer_tokens) * (s + 1) - g.latency_s(s, work.answer_tokens) * s
                 for g, s in zip(groups, shares)]
        k = min(range(len(groups)), key=lambda i: (costs[i], i))
        shares[k] += 1
        total += costs[k]
    return tuple(shares), total / work.requests


def _pipeline_groups(profiles: list[DeviceProfile], link: LinkModel, work: Workload, max_seq: int,
                     cache: dict) -> list[Group]:
    """Pipelines over ``profiles`` by two layer DPs: the one whose device count makes the prompt's
    prefill fastest (it may leave members out: a short prompt runs on one device) and the
    bottleneck DP over every member ([] if they cannot hold the model; one if both agree)."""
    key = frozenset(p.device_id for p in profiles)
    if key not in cache and len(profiles) == 1:
        # one member: the DPs can only give it every layer (when it holds them), and running them
        # costs a one-device home ~0.5 s of its start (tests/partition check the two agree)
        cache[key] = [price_group([(profiles[0], 0, profiles[0].num_layers)], link, work)] \
            if replica_fits(profiles[0], max_seq) else []
    if key not in cache:
        options: list[Group] = []
        for plan in (plan_layers, partition_layers):
            try:
                res = plan(profiles, link, work.prompt_tokens, max_seq)
            except PlanError:
                continue
            group = price_group([(profiles[d], i, j) for d, i, j in res.split.stages], link, work)
            if all(g.stages != group.stages for g in options):
                options.append(group)
        cache[key] = options
    return cache[key]


def _layout(groups: list[Group], work: Workload, everyone: list[DeviceProfile]) -> Layout:
    groups_t = tuple(groups)
    shares, latency = route_requests(groups_t, work)
    used = {n for g in groups_t for n in g.members}
    replicas = sum(1 for g in groups_t if g.is_replica)
    tensors = sum(1 for g in groups_t if g.tensor)
    kind = ("tensor" if tensors == len(groups_t) else "pipeline" if replicas == 0 and not tensors
            else "replicas" if replicas == len(groups_t) else "mixed")
    return Layout(kind, groups_t, shares, latency, work,
                  tuple(NodeId(p.device_id) for p in everyone if p.device_id not in used))


def _pick(layouts: list[Layout], margin: float, served: Layout | None, keep_margin: float) -> Layout:
    """Among layouts within ``margin`` of the cheapest, the one with the most routes (spare routes
    take a burst, and stay when a device leaves) — but the routes the home serves now (``served``)
    while within ``keep_margin`` of the cheapest and with as many routes (a re-plan reloads weights
    and replays what is in flight; a member that joined is still put to use)."""
    best = min(layouts, key=lambda lay: lay.latency_s)
    close = [lay for lay in layouts if lay.latency_s <= best.latency_s * (1 + margin)]
    pick = min(close, key=lambda lay: (-len(lay.groups), lay.latency_s))
    if served is not None and served.latency_s <= best.latency_s * (1 + keep_margin) \
            and len(served.groups) >= len(pick.groups):
        return served
    return pick


def _served(prefer, profiles: list[DeviceProfile], link: LinkModel, work: Workload, max_seq: int,
            everyone: list[DeviceProfile]) -> Layout | None:
    """The routes served now, priced for ``work`` (None: none, or they no longer fit these members)."""
    if not prefer:
        return None
    by_id = {p.device_id: p for p in profiles}
    L = profiles[0].num_layers
    groups = []
    for route in prefer:
        stages = [(by_id.get(n), f, e) for n, f, e in route]
        if any(p is None or stage_memory_bytes(p, f, e, max_seq) > p.memory_budget_bytes for p, f, e in stages):
            return None
        if [f for _, f, _ in stages] != [0, *[e for _, _, e in stages[:-1]]] or stages[-1][2] != L:
            return None
        groups.append(price_group(stages, link, work))
    return _layout(groups, work, everyone)


def choose_layout(profiles: list[DeviceProfile], link: LinkModel, work: Workload, max_seq: int,
                  force: str = "auto", *, margin: float = SIMPLER_MARGIN, prefer=None,
                  keep_margin: float | None = None, tensor: bool = False) -> Layout:
    """The layout with the lowest predicted mean latency for ``work``.

    Candidates: one pipeline over every member (the layer DP, which may leave slow members out);
    the k fastest members that hold the whole model as replicas (k = 1..all of them), each with or
    without a pipeline group of the members left. ``force``: "pipeline" keeps only the first,
    "replicas" only replicas of every member that holds the model (the pipeline when none does).
    ``prefer``: the routes served now (``Layout.routes``), priced too and kept while within
    ``keep_margin`` (default ``margin``) of the best; ``margin``: ties, see :func:`_pick`.
    ``tensor``: tensor-parallel groups are candidates too (a home whose members all serve them; always
    with ``force="tensor"``).
    Raises :class:`PlanError` when no candidate holds the model.
    """
    if force not in LAYOUT_KINDS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUT_KINDS)}, not {force!r}")
    cache: dict = {}
    L = profiles[0].num_layers
    fits = [p for p in profiles if replica_fits(p, max_seq)]
    solo = {p.device_id: price_group([(p, 0, L)], link, work) for p in fits}
    fits.sort(key=lambda p: (solo[p.device_id].latency_s(1, work.answer_tokens), p.device_id))
    candidates: list[Layout] = []
    for pipe in _pipeline_groups(profiles, link, work, max_seq, cache):
        candidates.append(_layout([pipe], work, profiles))
    if force == "replicas" and fits:
        candidates = [_layout([solo[p.device_id] for p in fits], work, profiles)]
    elif force == "auto":
        for k in range(1, len(fits) + 1):
            replicas = [solo[p.device_id] for p in fits[:k]]
            candidates.append(_layout(replicas, work, profiles))
            rest = [p for p in profiles if p not in fits[:k]]
            for group in _pipeline_groups(rest, link, work, max_seq, cache) if len(rest) > 1 else ():
                if not group.is_replica:
                    candidates.append(_layout([*replicas, group], work, profiles))
    if force == "tensor" or (force == "auto" and tensor):  # a tensor group, the fastest others as replicas
        ranked = sorted(profiles, key=lambda p: (float(p.decode_step(work.prompt_tokens)), p.device_id))
        for group in _tensor_candidates(ranked):
            if not tensor_fits(group, max_seq):
                continue
            tensor = price_tensor_group(group, link, work)
            rest = [solo[p.device_id] for p in fits if p not in group]
            for k in range(0, len(rest) + 1 if force == "auto" else 1):
                candidates.append(_layout([tensor, *rest[:k]], work, profiles))
        if force == "tensor":
            candidates = [c for c in candidates if any(g.tensor for g in c.groups)] or candidates
    served = _served(prefer, profiles, link, work, max_seq, profiles) if force == "auto" else None
    if served is not None:
        candidates.append(served)
    if not candidates:
        raise PlanError("no member, and no pipeline of members, holds the model")
    chosen = _pick(candidates, margin, served, margin if keep_margin is None else keep_margin)
    alternatives: dict[str, float] = {}
    for lay in candidates:
        alternatives[lay.kind] = min(alternatives.get(lay.kind, math.inf), lay.latency_s)
    return _explained(chosen, alternatives, fits, force, profiles, link, max_seq)


def _explained(lay: Layout, alternatives: dict, fits: list[DeviceProfile], force: str,
               profiles: list[DeviceProfile], link: LinkModel, max_seq: int) -> Layout:
    work = lay.workload
    replicas = [g.members[0] for g in lay.groups if g.is_replica]
    pipes = [g for g in lay.groups if not g.is_replica and not g.tensor]
    parts = []
    if replicas:
        parts.append(f"{len(replicas)} replica(s) ({', '.join(replicas)}): each holds the whole model")
    for g in pipes:
        parts.append(f"a pipeline over {', '.join(g.members)}")
    for g in lay.groups:
        if g.tensor:
            parts.append(f"a tensor group over {', '.join(g.members)} (every layer split "
                         f"{':'.join(f'{x:.2f}' for x in g.tensor_speeds)}; {2 * profiles[0].num_layers + 1} "
                         f"exchanges of {link.describe()} a token)")
    others = ", ".join(f"{k} {v:.2f} s" for k, v in sorted(alternatives.items()) if k != lay.kind)
    why = (f"{'; '.join(parts)}; predicted {lay.latency_s:.2f} s per request at {work.describe()}"
           + (f" (best {others})" if others else ""))
    if force != "auto":
        why += f"; layout forced to {force}"
    if not fits:
        why += "; no member holds the whole model alone, so the pipeline is the only layout"
    elif replicas and not pipes:
        n = crossover_prompt(profiles, link, work, max_seq, lay)
        if n is not None:
            why += f"; a pipeline would pay for prompts of more than {n} new tokens at this load"
    return Layout(lay.kind, lay.groups, lay.shares, lay.latency_s, lay.workload, lay.unused, why, alternatives)


def crossover_prompt(profiles: list[DeviceProfile], link: LinkModel, work: Workload, max_seq: int,
                     chosen: Layout) -> int | None:
    """The fewest new prompt tokens (doubling, up to ``max_seq``) at which one pipeline would beat
    ``chosen`` at the same load (None: never within ``max_seq``)."""
    if len(profiles) < 2:
        return None  # no pipeline of one device
    n = 128
    while n <= max_seq:
        w = Workload(n, work.answer_tokens, 0.0, work.in_flight)
        here = [price_group([(next(p for p in profiles if p.device_id == nid), f, e) for nid, f, e in g.stages],
                            link, w) for g in chosen.groups]
        if any(len(pipe.stages) > 1 and route_requests((pipe,), w)[1] < route_requests(tuple(here), w)[1]
               for pipe in _pipeline_groups(profiles, link, w, max_seq, {})):
            return n
        n *= 2
    return None


def brute_force_layout(profiles: list[DeviceProfile], link: LinkModel, work: Workload,
                       max_seq: int, tensor: bool = False) -> float:
    """The least predicted mean latency over every way to give each member a role — replica (if it
    holds the model), member of the one pipeline group (laid out by the layer DP), member of the one
    tensor group (its members fastest first; not beside a pipeline), or unused.
    Exponential: the tests' reference for :func:`choose_layout`."""
    L = profiles[0].num_layers
    best = math.inf
    cache: dict = {}
    for roles in itertools.product("rptu" if tensor else "rpu", repeat=len(profiles)):
        if any(r == "r" and not replica_fits(p, max_seq) for r, p in zip(roles, profiles)):
            continue
        groups = [price_group([(p, 0, L)], link, work) for r, p in zip(roles, profiles) if r == "r"]
        tensor = [p for r, p in zip(roles, profiles) if r == "t"]
        if tensor:
            if len(tensor) < 2 or not tensor_fits(tensor, max_seq) or any(r == "p" for r in roles):
                continue
            tensor.sort(key=lambda p: (float(p.decode_step(work.prompt_tokens)), p.device_id))
            groups.append(price_tensor_group(tensor, link, work))
        pipe_members = [p for r, p in zip(roles, profiles) if r == "p"]
        options = _pipeline_groups(pipe_members, link, work, max_seq, cache) if pipe_members else [None]
        for g in options:
            layout = [*groups, g] if g is not None else groups
            if layout:
                best = min(best, route_requests(tuple(layout), work)[1])
    return best


def kv_handoff_s(profile: DeviceProfile, link: LinkModel, tokens: int) -> float:
    """Seconds to move ``tokens`` positions of every layer's keys and values over ``link``: what a
    pipeline that prefilled a long prompt would pay to hand its decoding to a replica. It pays only
    when it is less than the prefill time the pipeline saved (it is priced, and measured in
    ``bench/layouts.py``, rather than built)."""
    return float(link.transfer_s(profile.kv_bytes_per_token_per_layer * profile.num_layers * tokens))
