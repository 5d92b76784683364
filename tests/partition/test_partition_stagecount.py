"""Stage count: a device joins the plan only when it makes a prompt faster (issue #15)."""

import dataclasses
import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from partition.layers import InsufficientMemoryError, partition_layers
from partition.link import LOCAL, parse_link
from partition.planner import make_plan
from partition.stagecount import MIN_GAIN, plan_layers, predicted_prefill_s, split_timings
from partition.synthetic import small_model, synthetic_profile

MiB = 2**20


@st.composite
def homes(draw):
    L = draw(st.integers(2, 8))
    model = small_model(L)
    profiles = [synthetic_profile(f"d{d}", model=model, speed=draw(st.floats(0.05, 4.0)),
                                  memory_bytes=draw(st.sampled_from([150, 400, 4096])) * MiB)
                for d in range(draw(st.integers(1, 4)))]
    link = draw(st.sampled_from([LOCAL, parse_link("1gbit,0.5ms"), parse_link("100mbit,2ms"),
                                 parse_link("5mbit,30ms")]))
    return profiles, link, draw(st.sampled_from([64, 512, 2048]))


def prefill_of(result, profiles, link, seq):
    return predicted_prefill_s(split_timings(result.split, profiles, link), seq)[0]


def planned_prefill(plan, profiles, link, seq, **kw):
    """(plan, its predicted prefill), or (None, None) when the devices cannot hold the model."""
    try:
        result = plan(profiles, link, seq, 2048, **kw)
    except InsufficientMemoryError:
        return None, None
    return result, prefill_of(result, profiles, link, seq)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(homes())
def test_a_device_is_added_only_when_it_pays_and_no_fewer_devices_or_member_alone_is_faster(home):
    profiles, link, seq = home
    chosen, t = planned_prefill(plan_layers, profiles, link, seq)
    if chosen is None:
        return
    n = len(chosen.split.stages)
    for m in range(1, len(profiles) + 1):
        other, t_other = planned_prefill(partition_layers, profiles, link, seq, max_stages=m)
        if other is None:
            continue
        if len(other.split.stages) < n:
            assert t <= t_other * (1 + 1e-9)  # fewer devices would be slower
        elif len(other.split.stages) > n:
            assert t * (1 - MIN_GAIN) <= t_other * (1 + 1e-9)  # more would not save MIN_GAIN
    for p in profiles:  # never predicted slower than its fastest member alone
        alone, t_alone = planned_prefill(partition_layers, [p], link, seq)
        if alone is not None:
            assert t <= t_alone * (1 + 1e-9)


def test_max_stages_finds_the_best_split_over_subsets_of_that_size():
    model = small_model(4)
    profiles = [synthetic_profile(f"d{i}", model=model, speed=s) for i, s in enumerate((1.0, 3.0, 0.5, 2.0))]
    for m in (1, 2, 3):
        res = partition_layers(profiles, LOCAL, 512, 2048, max_stages=m)
        assert len(res.split.stages) <= m
        best = min(partition_layers([profiles[i] for i in subset], LOCAL, 512, 2048).split.bottleneck_s
                   for subset in itertools.combinations(range(4), m))
        assert res.split.bottleneck_s == pytest.approx(best, rel=1e-9)


def test_a_slow_device_that_lowers_the_bottleneck_but_slows_the_prompt_is_left_out_and_the_plan_says_why():
    model = small_model(8)
    fast, slow = synthetic_profile("fast", model=model, speed=1.0), synthetic_profile("slow", model=model, speed=0.3)
    link = parse_link("100mbit,2ms")
    assert len(partition_layers([fast, slow], link, 512, 2048).split.stages) == 2  # the bottleneck DP alone
    plan = make_plan([fast, slow], link, 2048, plan_seq_len=512)
    assert [s.node_id for s in plan.stages] == ["fast"]
    assert plan.unused_devices == ("slow",)
    assert "slow left out" in plan.explanation and "512-token prompt" in plan.explanation


def test_equal_devices_on_a_fast_link_are_all_used():
    model = small_model(8)
    profiles = [synthetic_profile(f"d{i}", model=model) for i in range(4)]
    plan = make_plan(profiles, parse_link("1gbit,0.5ms"), 2048, plan_seq_len=1024)
    assert len(plan.stages) == 4 and not plan.unused_devices


def test_a_large_per_chunk_cost_makes_pipelining_a_prompt_pay_less():
    model = small_model(8)
    cheap = [synthetic_profile(f"d{i}", model=model) for i in range(2)]
    costly = [dataclasses.replace(p, message_overhead_s=0.5) for p in cheap]
    k_cheap = predicted_prefill_s(split_timings(partition_layers(cheap, LOCAL, 1024, 2048).split, cheap,
                                                LOCAL), 1024)[1]
    k_costly = predicted_prefill_s(split_timings(partition_layers(costly, LOCAL, 1024, 2048).split, costly,
                                                 LOCAL), 1024)[1]
    assert k_costly < k_cheap


def test_a_device_count_too_small_to_hold_the_model_says_so():
    model = small_model(8)
    half = [synthetic_profile(f"d{i}", model=model, memory_bytes=400 * MiB) for i in range(2)]
    partition_layers(half, LOCAL, 512, 2048)  # both together hold it
    with pytest.raises(InsufficientMemoryError, match="at most 1 device"):
        partition_layers(half, LOCAL, 512, 2048, max_stages=1)
