"""Tensor-parallel groups in the plan: priced beside replicas and pipelines, chosen only where the link's
round trips leave the split a win, and carried by the plan's wire and file forms."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from partition.layers import stage_memory_bytes
from partition.layout import Workload, brute_force_layout, choose_layout, price_tensor_group
from partition.link import parse_link
from partition.plan import Plan
from partition.planner import make_layout_plan
from partition.stages import StageAssignment
from partition.synthetic import small_model, synthetic_profile

MODEL = small_model(8)
MAX_SEQ = 2048
WHOLE = stage_memory_bytes(synthetic_profile("x", model=MODEL), 0, 8, MAX_SEQ)
FAST = parse_link("1gbit,0.1ms")
WIFI = parse_link("100mbit,2ms")
VOICE = Workload(512, 64, 0.9, 1)


def device(name, speed=1.0, holds=3.0):
    return replace(synthetic_profile(name, model=MODEL, speed=speed), memory_budget_bytes=int(WHOLE * holds))


def test_a_fast_link_splits_every_layer_over_both_devices():
    lay = choose_layout([device("a"), device("b")], FAST, VOICE, MAX_SEQ, tensor=True)
    assert lay.kind == "tensor" and lay.groups[0].members == ("a", "b")
    assert "tensor group over a, b" in lay.reason


def test_wifi_round_trips_make_the_split_lose_and_the_planner_declines_it():
    lay = choose_layout([device("a"), device("b")], WIFI, VOICE, MAX_SEQ, tensor=True)
    assert lay.kind != "tensor" and lay.alternatives["tensor"] > lay.latency_s


def test_a_group_is_priced_as_its_share_of_compute_plus_two_exchanges_a_layer():
    a, b = device("a"), device("b")
    group = price_tensor_group([a, b], FAST, VOICE, exchange_overhead_s=0.0)
    context = VOICE.prompt_tokens + VOICE.answer_tokens // 2
    exchange = float(FAST.activation_transfer_s(1, MODEL.hidden_size, 4))
    assert group.step_s[0] == pytest.approx(a.decode_step(context) / 2 + (2 * 8 + 1) * exchange)


def test_a_link_with_a_real_round_trip_holds_the_attention_whole():
    """One exchange a layer instead of two, for ~a tenth more reading on each member: the 0.3 ms round trip
    of a wired LAN pays for it; with exchanges free, splitting the attention reads less and wins."""
    a, b = device("a"), device("b")
    lan = price_tensor_group([a, b], parse_link("1gbit,0.3ms"), VOICE)
    assert lan.tensor_attention == "whole"
    free = price_tensor_group([a, b], parse_link("100gbit,0ms"), VOICE, exchange_overhead_s=0.0)
    assert free.tensor_attention == "split"
    split_only = price_tensor_group([a, b], parse_link("1gbit,0.3ms"), VOICE, attentions=("split",))
    assert split_only.tensor_attention == "split" and split_only.step_s[0] > lan.step_s[0]


def test_the_attention_whole_is_priced_as_every_head_on_each_member_and_one_exchange_a_layer():
    from partition.tensor_layout import attention_share

    a, b = device("a"), device("b")
    group = price_tensor_group([a, b], FAST, VOICE, exchange_overhead_s=0.0, attentions=("whole",))
    context = VOICE.prompt_tokens + VOICE.answer_tokens // 2
    exchange = float(FAST.activation_transfer_s(1, MODEL.hidden_size, 4))
    share = attention_share(a)
    assert 0.0 < share < 0.5
    assert group.step_s[0] == pytest.approx(a.decode_step(context) * (share + (1 - share) / 2) + (8 + 1) * exchange)


def test_a_group_that_would_be_only_a_little_faster_is_not_formed():
    """A group ties both devices to every token; a predicted gain of a few percent does not pay for that."""
    devices = [device("a"), device("b")]
    plain = choose_layout(devices, FAST, VOICE, MAX_SEQ, tensor=False)
    lay = choose_layout(devices, FAST, VOICE, MAX_SEQ, tensor=True, tensor_margin=0.0)
    assert lay.kind == "tensor"
    gain = 1 - lay.latency_s / plain.latency_s
    assert choose_layout(devices, FAST, VOICE, MAX_SEQ, tensor=True, tensor_margin=gain + 0.01).kind != "tensor"
    assert choose_layout(devices, FAST, VOICE, MAX_SEQ, tensor=True, tensor_margin=gain - 0.01).kind == "tensor"


def test_a_faster_member_gets_the_larger_share():
    group = price_tensor_group([device("fast", 3.0), device("slow", 1.0)], FAST, VOICE)
    assert group.tensor == ("fast", "slow") and group.tensor_speeds[0] == pytest.approx(0.75, rel=1e-3)


def test_a_home_whose_daemons_serve_no_groups_is_never_planned_one():
    """Until every member serves tensor groups, the daemon's planner leaves them out, however well they
    would price."""
    lay = choose_layout([device("a"), device("b")], FAST, VOICE, MAX_SEQ)
    assert lay.kind != "tensor" and "tensor" not in lay.alternatives


def test_members_that_cannot_hold_their_share_form_no_group():
    tiny = [device("a", holds=0.3), device("b", holds=0.3)]  # a third of the model each: not half
    with pytest.raises(Exception):
        choose_layout(tiny, FAST, VOICE, MAX_SEQ, force="tensor")


def test_the_chosen_layout_is_the_brute_force_optimum_with_tensor_groups_on_fast_links():
    rng = random.Random(11)
    checked = 0
    for _ in range(14):
        profiles = [device(f"d{i}", rng.choice([0.5, 1, 2]), rng.choice([0.6, 1.3, 3])) for i in range(rng.randint(2, 4))]
        work = Workload(rng.choice([128, 512]), rng.choice([16, 64]), rng.choice([0, 0.9]), rng.choice([1, 2, 4]))
        link = rng.choice([FAST, parse_link("1gbit,0.3ms"), WIFI])
        best = brute_force_layout(profiles, link, work, MAX_SEQ, tensor=True)
        if best == float("inf"):
            continue
        assert choose_layout(profiles, link, work, MAX_SEQ, margin=0.0, tensor=True,
                             tensor_margin=0.0).latency_s == pytest.approx(best, rel=1e-9)
        checked += 1
    assert checked >= 8


@pytest.fixture
def tensor_plan():
    return make_layout_plan([device("a"), device("b")], FAST, MAX_SEQ, workload=VOICE, layout="tensor")


def test_a_tensor_plan_has_one_stage_led_by_the_first_member_of_its_group(tensor_plan):
    (stage,) = tensor_plan.stages
    assert stage.group == ("a", "b") and stage.node_id == "a" and stage.layers == (0, 8)
    assert tensor_plan.group_of("b") == (stage, 1) and tensor_plan.group_of("a") == (stage, 0)
    assert tensor_plan.layers_of("b") == (0, 8) and tensor_plan.devices == ("a", "b")
    assert tensor_plan.layout == "tensor"


def test_the_group_travels_on_the_wire_and_in_the_file(tensor_plan):
    from transport.messages import PlanUpdate, decode, encode

    wire = Plan.from_assignment(7, tensor_plan.to_assignment())
    assert wire.stages[0].group == ("a", "b") and wire.stages[0].group_speeds == tensor_plan.stages[0].group_speeds
    msg = decode(encode(PlanUpdate(7, tensor_plan.to_assignment()))).message
    assert Plan.from_assignment(msg.plan_version, msg.assignment).digest() == tensor_plan.digest()
    assert Plan.from_dict(tensor_plan.to_dict()).stages == tensor_plan.stages


def test_how_the_group_holds_the_attention_travels_and_is_part_of_the_plan(tensor_plan):
    from transport.messages import PlanUpdate, decode, encode

    stage = tensor_plan.stages[0]
    whole = replace(tensor_plan, stages=(replace(stage, group_attention="whole"),))
    split = replace(tensor_plan, stages=(replace(stage, group_attention="split"),))
    assert whole.digest() != split.digest()
    assert "group_attention" not in str(split.to_assignment())  # split: rows every version reads alike
    assert "group_attention" in str(whole.to_assignment())
    msg = decode(encode(PlanUpdate(7, whole.to_assignment()))).message
    assert Plan.from_assignment(msg.plan_version, msg.assignment).stages[0].group_attention == "whole"
    assert Plan.from_dict(whole.to_dict()).stages == whole.stages
    assert whole.to_status()["stages"][0]["tensor_attention"] == "whole"
    with pytest.raises(ValueError, match="split or whole"):
        replace(tensor_plan, stages=(replace(stage, group_attention="halves"),)).check()


def test_a_group_and_a_replica_over_the_same_layers_are_different_plans(tensor_plan):
    replica = replace(tensor_plan, stages=(StageAssignment("a", 0, 8),))
    assert replica.digest() != tensor_plan.digest()


def test_a_node_in_a_group_cannot_hold_another_stage_too(tensor_plan):
    both = replace(tensor_plan, stages=(*tensor_plan.stages, StageAssignment("b", 0, 8, route=1)))
    with pytest.raises(ValueError, match="two stages"):
        both.check()
    headless = replace(tensor_plan, stages=(replace(tensor_plan.stages[0], group=("b", "a")),))
    with pytest.raises(ValueError, match="led by"):
        headless.check()
