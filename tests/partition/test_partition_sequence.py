"""Sequence partitioner: Jupiter's chunking DP, vectorised, with an O(1) cut lookup."""

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from partition.link import LOCAL, parse_link
from partition.cuttable import CutTable, PromptTooLongError
from partition.planner import make_plan, predict_prefill_s
from partition.sequence import (
    StageTiming,
    build_cut_table,
    chunk_cost_matrix,
    equal_starts,
    flow_shop_latency,
    jupiter_latency,
    minmax_table,
)
from partition.synthetic import synthetic_profile


def brute_force_w(T, k, y, b):
    """min over all splits of [0, y) into k chunks, each >= b, of the slowest chunk."""
    best = np.inf
    for cuts in itertools.combinations(range(1, y), k - 1):
        bounds = (0, *cuts, y)
        if any(e - s < b for s, e in zip(bounds, bounds[1:])):
            continue
        best = min(best, max(T[e, s] for s, e in zip(bounds, bounds[1:])))
    return best


@st.composite
def chunk_costs(draw):
    S = draw(st.integers(1, 11))
    vals = draw(st.lists(st.floats(0.01, 10.0), min_size=(S + 1) ** 2, max_size=(S + 1) ** 2))
    T = np.array(vals).reshape(S + 1, S + 1)
    y, l = np.indices(T.shape)
    T = np.where(y > l, T, np.inf)
    return T, draw(st.integers(1, 4)), draw(st.integers(1, 3))


@settings(max_examples=150, deadline=None)
@given(chunk_costs())
def test_sequence_dp_equals_brute_force_for_every_length_and_chunk_count(case):
    T, k_max, b = case
    W, arg, single = minmax_table(T, k_max, b)
    S = T.shape[0] - 1
    for k in range(1, k_max + 1):
        for y in range(1, S + 1):
            assert W[k, y] == pytest.approx(brute_force_w(T, k, y, b)), (k, y)
    assert list(single[1:]) == list(T[1:, 0])  # one chunk is always allowed


def stages_for(speeds, layers, link=LOCAL):
    """Pipeline stages on synthetic devices (first has the embedding, last the head)."""
    out = []
    for i, (sp, n) in enumerate(zip(speeds, layers)):
        out.append(StageTiming(synthetic_profile(f"d{i}", speed=sp), n, i == 0, i == len(speeds) - 1,
                               None if i == len(speeds) - 1 else link))
    return out


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.tuples(st.floats(0.3, 3.0), st.integers(1, 12)), min_size=1, max_size=4),
    st.sampled_from([LOCAL, parse_link("100mbit,2ms"), parse_link("10mbit,10ms")]),
    st.integers(1, 48),
)
def test_equal_length_split_is_never_better_than_the_planned_split(stage_specs, link, b):
    stages = stages_for([s for s, _ in stage_specs], [n for _, n in stage_specs], link)
    S = 160
    table = build_cut_table(stages, S, min_chunk=b)
    y = np.arange(S + 1)
    planned = np.array(table.latency_s)
    for k in range(1, table.k_max + 1):
        ok = (y // k >= b) | (k == 1)
        ok[0] = False
        equal = flow_shop_latency(stages, equal_starts(k, S + 1)[ok], y[ok])
        assert (planned[ok] <= equal * (1 + 1e-9)).all(), k


def test_cut_table_rows_are_valid_chunkings():
    stages = stages_for([1.0, 2.0, 0.7], [8, 15, 7], parse_link("1gbit,0.5ms"))
    table = build_cut_table(stages, 512)
    assert table.k_max == 12
    for y in range(1, 513):
        cuts = table.lookup(y)
        bounds = (0, *cuts, y)
        assert all(b > a for a, b in zip(bounds, bounds[1:]))
        if cuts:
            assert all(b - a >= table.min_chunk for a, b in zip(bounds, bounds[1:]))
            assert len(cuts) + 1 <= table.k_max
    # long prompts are worth pipelining, a one-token prompt is not
    assert len(table.lookup(512)) >= 2
    assert table.lookup(1) == ()


def test_chunking_beats_one_chunk_on_a_pipeline():
    profiles = [synthetic_profile("a"), synthetic_profile("b")]
    plan = make_plan(profiles, parse_link("1gbit,0.5ms"), 2048)
    y = 2048
    assert plan.cut_table.predicted_latency_s(y) < 0.75 * predict_prefill_s(plan, profiles, y, cuts=())


def test_flow_shop_latency_reduces_to_jupiters_formula_for_equal_stages():
    st_ = stages_for([1.0, 1.0, 1.0], [10, 10, 10])
    # make the stages identical: no embedding/head, no link
    same = [StageTiming(s.profile, 10, False, False, None) for s in st_]
    starts = np.array([[0, 100, 250, 300]])
    y = np.array([512])
    bounds = [0, 100, 250, 300, 512]
    h = [float(same[0].chunk_time(e - s, s)) for s, e in zip(bounds, bounds[1:])]
    assert flow_shop_latency(same, starts, y)[0] == pytest.approx(jupiter_latency(h, 3))


def test_chunk_cost_is_the_slowest_stage():
    stages = stages_for([1.0, 0.5], [10, 10])
    T = chunk_cost_matrix(stages, 64)
    assert T[64, 0] == pytest.approx(max(s.chunk_time(64, 0) for s in stages))
    assert np.isinf(T[10, 10]) and np.isinf(T[3, 20])


def test_cut_lookup_is_a_table_index_and_rejects_overlong_prompts():
    table = CutTable(max_seq=4, k_max=2, min_chunk=1, cuts=((), (), (1,), (1,), (2,)),
                     latency_s=(0, 1, 2, 3, 4))
    assert table.lookup(4) == (2,)
    assert table.chunks(3) == [(0, 1), (1, 3)]
    with pytest.raises(PromptTooLongError):
        table.lookup(5)
    assert CutTable.from_dict(table.to_dict()) == table


def test_the_whole_table_is_deterministic():
    stages = stages_for([1.0, 1.5], [18, 12], parse_link("100mbit,2ms"))
    assert build_cut_table(stages, 300) == build_cut_table(stages, 300)
