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

from partition.ids import NodeId
from partition.layers import PlanError, partition_layers, stage_memory_bytes
from partition.link import LinkModel
# (Workload, Group and the route prices are partition.pricing's; imported from here by the planner's callers)
from partition.pricing import Group, Workload, price_group, replica_fits  # noqa: F401
from partition.profile import DeviceProfile
from partition.stagecount import plan_layers
from partition.tensor_layout import exchanges_per_token, fastest_first, price_tensor_group, tensor_candidates
from partition.tensor_split import ATTENTIONS

LAYOUT_KINDS = ("auto", "pipeline", "replicas", "tensor")

#: predicted prices this close count as a tie (the prediction is not finer than that)
SIMPLER_MARGIN = 0.03
#: a tensor group is chosen only when predicted this much faster than the best layout without one: it ties
#: every member to every token (a busy or leaving member stalls the stream) and gives up spare routes, so
#: a gain within the price's own error (a few percent, measured) does not pay for that
TENSOR_MARGIN = 0.10


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
                  keep_margin: float | None = None, tensor: bool = False,
                  tensor_attentions: tuple[str, ...] = ATTENTIONS, tensor_margin: float = TENSOR_MARGIN) -> Layout:
    """The layout with the lowest predicted mean latency for ``work``.

    Candidates: one pipeline over every member (the layer DP, which may leave slow members out);
    the k fastest members that hold the whole model as replicas (k = 1..all of them), each with or
    without a pipeline group of the members left. ``force``: "pipeline" keeps only the first,
    "replicas" only replicas of every member that holds the model (the pipeline when none does).
    ``prefer``: the routes served now (``Layout.routes``), priced too and kept while within
    ``keep_margin`` (default ``margin``) of the best; ``margin``: ties, see :func:`_pick`.
    ``tensor``: tensor-parallel groups are candidates too (a home whose members all serve them; always
    with ``force="tensor"``), holding the attention in the cheaper of ``tensor_attentions``, and only
    ``tensor_margin`` faster than the best layout without one (``force="auto"``).
    Raises :class:`PlanError` when no candidate holds the model.
    """
    if force not in LAYOUT_KINDS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUT_KINDS)}, not {force!r}")
    cache: dict = {}
    L = profiles[0].num_layers
    declined: list[Layout] = []  # groups under the margin: still named among the alternatives
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
        ranked = fastest_first(profiles, work)
        for group in tensor_candidates(ranked):
            grouped = price_tensor_group(group, link, work, attentions=tensor_attentions, max_seq=max_seq)
            if grouped is None:
                continue
            rest = [solo[p.device_id] for p in fits if p not in group]
            for k in range(0, len(rest) + 1 if force == "auto" else 1):
                candidates.append(_layout([grouped, *rest[:k]], work, profiles))
        if force == "tensor":
            candidates = [c for c in candidates if any(g.tensor for g in c.groups)] or candidates
        else:
            plain = [c.latency_s for c in candidates if not any(g.tensor for g in c.groups)]
            bar = min(plain, default=math.inf) * (1 - tensor_margin)
            kept: list[Layout] = []
            for c in candidates:
                (declined if any(g.tensor for g in c.groups) and c.latency_s > bar else kept).append(c)
            candidates = kept
    served = _served(prefer, profiles, link, work, max_seq, profiles) if force == "auto" else None
    if served is not None:
        candidates.append(served)
    if not candidates:
        raise PlanError("no member, and no pipeline of members, holds the model")
    chosen = _pick(candidates, margin, served, margin if keep_margin is None else keep_margin)
    alternatives: dict[str, float] = {}
    for lay in [*candidates, *declined]:
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
            whole = g.tensor_attention == "whole"
            parts.append(f"a tensor group over {', '.join(g.members)} (every layer split "
                         f"{':'.join(f'{x:.2f}' for x in g.tensor_speeds)}"
                         f"{', the attention whole on every member' if whole else ''}; "
                         f"{exchanges_per_token(profiles[0].num_layers, g.tensor_attention)} "
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
                       max_seq: int, tensor: bool = False, tensor_attentions: tuple[str, ...] = ATTENTIONS) -> float:
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
        held = [p for r, p in zip(roles, profiles) if r == "t"]
        variants: list = [None]
        if held:
            if len(held) < 2 or any(r == "p" for r in roles):
                continue
            variants = [price_tensor_group(fastest_first(held, work), link, work, attentions=(a,), max_seq=max_seq)
                        for a in tensor_attentions]
            variants = [g for g in variants if g is not None]
        pipe_members = [p for r, p in zip(roles, profiles) if r == "p"]
        options = _pipeline_groups(pipe_members, link, work, max_seq, cache) if pipe_members else [None]
        for t in variants:
            for g in options:
                layout = [*groups, *([t] if t is not None else []), *([g] if g is not None else [])]
                if layout:
                    best = min(best, route_requests(tuple(layout), work)[1])
    return best


def kv_handoff_s(profile: DeviceProfile, link: LinkModel, tokens: int) -> float:
    """Seconds to move ``tokens`` positions of every layer's keys and values over ``link``: what a
    pipeline that prefilled a long prompt would pay to hand its decoding to a replica. It pays only
    when it is less than the prefill time the pipeline saved (it is priced, and measured in
    ``bench/layouts.py``, rather than built)."""
    return float(link.transfer_s(profile.kv_bytes_per_token_per_layer * profile.num_layers * tokens))
