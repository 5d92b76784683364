"""Glue: device profiles + link → a :class:`~partition.plan.Plan` (layers, then chunks).

Pure function of its inputs (apart from measuring its own planning time), so a
plan is reproducible from the profiles the daemon has gathered.
"""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np

from partition.layers import check_same_model, stage_memory_bytes
from partition.link import LinkModel
from partition.ids import NodeId, PlanVersion
from partition.cuttable import CutTable
from partition.plan import Plan
from partition.profile import DeviceProfile
from partition.sequence import StageTiming, build_cut_table, flow_shop_latency, pipeline_timings
from partition.stagecount import plan_layers
from partition.layout import Layout, Workload, choose_layout
from partition.stages import StageAssignment
from partition.tensor_split import ATTENTIONS

#: how much faster another layout must be predicted than the one served now to re-plan for it
REPLAN_MARGIN = 0.15


def stage_timings(stages: tuple[StageAssignment, ...], profiles: dict[str, DeviceProfile],
                  link: LinkModel) -> list[StageTiming]:
    """The timing model of a plan's stages (profiles by node id)."""
    return pipeline_timings(((profiles[s.node_id], s.first, s.end) for s in stages), link)


def make_plan(
    profiles: list[DeviceProfile],
    link: LinkModel,
    max_seq: int = 2048,
    *,
    plan_seq_len: int | None = None,
    with_cut_table: bool = True,
    k_max: int | None = None,
    exact_limit: int | None = None,
    version: PlanVersion = PlanVersion(0),
) -> Plan:
    """Plan layers for prompts of ``plan_seq_len`` tokens (default ``max_seq``) and chunks.

    The layer split balances stage times at ``plan_seq_len``; the KV cache for
    ``max_seq`` tokens must fit each stage's device. The cut table then covers
    every prompt length up to ``max_seq`` for that split.
    """
    t0 = time.perf_counter()
    check_same_model(profiles)
    seq = plan_seq_len or max_seq
    kw = {} if exact_limit is None else {"exact_limit": exact_limit}
    res = plan_layers(profiles, link, seq, max_seq, **kw)
    L = profiles[0].num_layers
    stages = tuple(
        StageAssignment(
            node_id=NodeId(profiles[d].device_id),
            first=i,
            end=j,
            compute_s=res.compute_s[k],
            transfer_s=res.transfer_s[k],
            memory_bytes=res.memory_bytes[k],
            memory_budget_bytes=profiles[d].memory_budget_bytes,
        )
        for k, (d, i, j) in enumerate(res.split.stages)
    )
    bottleneck = max(range(len(stages)), key=lambda k: stages[k].time_s)
    used = {s.node_id for s in stages}
    by_id = {p.device_id: p for p in profiles}
    table = plan_cut_table(stages, by_id, link, max_seq, k_max) if with_cut_table else None
    # the bottleneck's kind with the planner's own words on it, so `meshd status` explains a
    # plan instead of printing a bare code word
    reason = f"{res.reason}: {res.explanation}" + (f"; {res.left_out}" if res.left_out else "")
    return Plan(
        version=version,
        stages=stages,
        num_layers=L,
        predicted_bottleneck_s=res.split.bottleneck_s,
        reason=reason,
        model=profiles[0].model.identity,
        cut_table=table,
        plan_seq_len=seq,
        max_seq=max_seq,
        link=link,
        bottleneck_stage=bottleneck,
        bottleneck_reason=res.reason,
        explanation=res.explanation,
        unused_devices=tuple(NodeId(p.device_id) for p in profiles if p.device_id not in used),
        exact_search=res.exact,
        planning_seconds=time.perf_counter() - t0,
    )


def make_layout_plan(
    profiles: list[DeviceProfile],
    link: LinkModel,
    max_seq: int = 2048,
    *,
    workload: Workload | None = None,
    layout: str = "auto",
    plan_seq_len: int | None = None,
    with_cut_table: bool = True,
    version: PlanVersion = PlanVersion(0),
    prefer=None,
    tensor: bool = False,
    tensor_attentions: tuple[str, ...] = ATTENTIONS,
) -> Plan:
    """The plan of the layout :func:`partition.layout.choose_layout` picks for ``workload`` (``tensor``:
    tensor-parallel groups among the candidates).

    A pipeline is :func:`make_plan` over the members it uses (so its account is the layer DP's);
    replicas and mixed layouts number their routes, replicas first, and say why in ``reason``.
    ``prefer``: the routes served now (``Layout.routes``), kept unless another layout is predicted
    REPLAN_MARGIN faster (a re-plan reloads weights and replays the requests in flight).
    """
    t0 = time.perf_counter()
    check_same_model(profiles)
    work = workload or Workload(plan_seq_len or max_seq)
    chosen = choose_layout(profiles, link, work, max_seq, force=layout, prefer=prefer, keep_margin=REPLAN_MARGIN,
                           tensor=tensor, tensor_attentions=tensor_attentions)
    by_id = {p.device_id: p for p in profiles}
    if chosen.kind == "pipeline":
        used = [by_id[n] for n in chosen.groups[0].members]
        plan = make_plan(used, link, max_seq, plan_seq_len=plan_seq_len, with_cut_table=with_cut_table,
                         version=version)
        if prefer is not None and chosen.routes == tuple(tuple(r) for r in prefer):
            plan = kept_stages(plan, chosen.routes[0], by_id, link, max_seq, with_cut_table)
        return replace(plan, layout="pipeline", reason=f"{chosen.reason}; {plan.reason}",
                       unused_devices=tuple(NodeId(p.device_id) for p in profiles
                                            if p.device_id not in plan.devices),
                       extras={**plan.extras, "layout": layout_account(chosen)})
    stages = []
    # Routes numbered in a fixed order (replicas by node id, then pipeline groups): the same layout
    # chosen again is the same plan, whatever the workload made fastest first.
    ordered = sorted(chosen.groups, key=lambda g: (not g.is_replica, g.members))
    for r, group in enumerate(ordered):
        for node, first, end in group.stages:
            stages.append(StageAssignment(node, first, end, memory_budget_bytes=by_id[node].memory_budget_bytes,
                                          route=r, group=group.tensor, group_speeds=group.tensor_speeds,
                                          group_attention=group.tensor_attention or "split"))
    stages_t = tuple(stages)
    pipe = next((g for g in ordered if not g.is_replica and not g.tensor), None)
    table = None
    if with_cut_table and pipe is not None:
        pipe_stages = tuple(s for s in stages_t if s.route == ordered.index(pipe))
        table = plan_cut_table(pipe_stages, by_id, link, max_seq)
    return Plan(
        version=version, stages=stages_t, num_layers=profiles[0].num_layers,
        predicted_bottleneck_s=None, reason=chosen.reason, model=profiles[0].model.identity,
        cut_table=table, plan_seq_len=plan_seq_len or max_seq, max_seq=max_seq, link=link,
        bottleneck_reason="layout", explanation=chosen.reason,
        unused_devices=chosen.unused, planning_seconds=time.perf_counter() - t0,
        extras={"layout": layout_account(chosen)}, layout=chosen.kind)


def kept_stages(plan: Plan, served: tuple, profiles: dict[str, DeviceProfile], link: LinkModel, max_seq: int,
                with_cut_table: bool) -> Plan:
    """``plan`` (the layer DP's over the served pipeline's members) with the served stages ``served``
    (``(node, first, end)`` each) kept as they are. The DP may give the same members their layers in
    another order — two equal devices swap halves just as well — and a plan that only swaps them
    would drop every stage's prefix cache and replay what is in flight for nothing. The kept
    stages' times and memory are priced again with the same timing model, for the plan's prompt."""
    if tuple((s.node_id, s.first, s.end) for s in plan.stages) == tuple(served):
        return plan
    bare = tuple(StageAssignment(NodeId(n), f, e, memory_budget_bytes=profiles[n].memory_budget_bytes)
                 for n, f, e in served)
    seq = plan.plan_seq_len
    stages = []
    for s, t in zip(bare, stage_timings(bare, profiles, link)):
        p = profiles[s.node_id]
        transfer = float(t.link.activation_transfer_s(seq, p.model.hidden_size, p.dtype_bytes)) if t.link else 0.0
        stages.append(replace(s, compute_s=float(t.chunk_time(seq, 0)) - transfer, transfer_s=transfer,
                              memory_bytes=stage_memory_bytes(p, s.first, s.end, max_seq)))
    stages_t = tuple(stages)
    table = plan_cut_table(stages_t, profiles, link, max_seq) if with_cut_table else None
    bottleneck = max(range(len(stages_t)), key=lambda k: stages_t[k].time_s)
    return replace(plan, stages=stages_t, cut_table=table, bottleneck_stage=bottleneck,
                   predicted_bottleneck_s=stages_t[bottleneck].time_s)


def layout_account(chosen: Layout) -> dict:
    """The layout's prices as ``meshd plan`` prints them: what it predicts and what it compared."""
    w = chosen.workload
    return {"kind": chosen.kind, "predicted_latency_s": chosen.latency_s, "shares": list(chosen.shares),
            "alternatives_s": dict(chosen.alternatives),
            "workload": {"prompt_tokens": w.prompt_tokens, "answer_tokens": w.answer_tokens,
                         "cached_fraction": w.cached_fraction, "in_flight": w.in_flight}}


def plan_cut_table(stages: tuple[StageAssignment, ...], profiles: dict[str, DeviceProfile], link: LinkModel,
                   max_seq: int, k_max: int | None = None) -> CutTable:
    """The sequence planner's cut table for ``stages`` (profiles by node id): seconds of work,
    so the leader builds it once, off its event loop, and ships it with the plan."""
    return build_cut_table(stage_timings(stages, profiles, link), max_seq, k_max=k_max)


def predict_prefill_s(plan: Plan, profiles: list[DeviceProfile], prompt_len: int,
                      cuts: tuple[int, ...] | None = None) -> float:
    """Predicted prefill latency (≈ TTFT) of ``prompt_len`` tokens split at ``cuts``.

    ``cuts`` defaults to the plan's own cut table; pass other cut points (e.g.
    an equal split) to compare.
    """
    if cuts is None:
        cuts = plan.cut_table.lookup(prompt_len) if plan.cut_table else ()
    by_id = {p.device_id: p for p in profiles}
    st = stage_timings(plan.stages, by_id, plan.link)
    starts = np.array([[0, *cuts]], dtype=np.int64)
    return float(flow_shop_latency(st, starts, np.array([prompt_len]))[0])


def predict_decode_step_s(plan: Plan, profiles: list[DeviceProfile], context: int) -> float:
    """One decode step through the whole pipeline: each stage's share of its device's
    measured whole-model step (its share of the single-token time per the q grid and
    the embedding/head rows) + one hop per stage boundary for one token's hidden state."""
    by_id = {p.device_id: p for p in profiles}
    total = 0.0
    for k, s in enumerate(plan.stages):
        p = by_id[s.node_id]
        layer = float(p.q_layer(1, context))
        ends = float(p.embed_time(1)), float(p.head_time(1))
        whole = p.num_layers * layer + sum(ends)
        part = s.num_layers * layer + (ends[0] if s.has_embedding else 0.0) \
            + (ends[1] if s.has_head_of(p.num_layers) else 0.0)
        total += float(p.decode_step(context)) * (part / whole if whole > 0 else s.num_layers / p.num_layers)
        if k < len(plan.stages) - 1:
            total += float(plan.link.activation_transfer_s(1, p.model.hidden_size, p.dtype_bytes))
    return total


def prediction_error(plan: Plan, profiles: list[DeviceProfile], prompt_len: int,
                     measured_ttft_s: float) -> dict:
    """Hook for the pipeline benchmark: predicted vs measured prefill latency.

    Returns ``{"prompt_len", "predicted_s", "measured_s", "rel_error"}``; the
    issue's target is ``abs(rel_error) <= 0.15``.
    """
    pred = predict_prefill_s(plan, profiles, prompt_len)
    return {"prompt_len": prompt_len, "predicted_s": pred, "measured_s": measured_ttft_s,
            "rel_error": (pred - measured_ttft_s) / measured_ttft_s}
