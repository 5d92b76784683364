"""The plan object the daemon broadcasts, and the predictions made from it."""

import pytest

from partition.link import parse_link
from partition.plan import Plan
from partition.planner import make_plan, predict_decode_step_s, predict_prefill_s, prediction_error
from partition.synthetic import synthetic_profile


@pytest.fixture(scope="module")
def home():
    profiles = [synthetic_profile("a", speed=1.0), synthetic_profile("b", speed=1.8),
                synthetic_profile("c", speed=0.6, memory_bytes=2**30)]
    return profiles, make_plan(profiles, parse_link("200mbit,2ms"), 512)


def test_plan_round_trips_through_json(home):
    _, plan = home
    assert Plan.from_json(plan.to_json()) == plan


def test_plan_stages_tile_the_model_with_the_ends_pinned(home):
    _, plan = home
    assert plan.stages[0].first == 0 and plan.stages[0].has_embedding
    assert plan.stages[-1].end == 30 and plan.stages[-1].has_head_of(plan.num_layers)
    assert not any(s.has_head_of(plan.num_layers) for s in plan.stages[:-1])
    for a, b in zip(plan.stages, plan.stages[1:]):
        assert b.first == a.end  # half-open ranges tile [0, num_layers)
    plan.check()
    assert plan.predicted_bottleneck_s == pytest.approx(max(s.time_s for s in plan.stages))
    assert plan.stages[plan.bottleneck_stage].time_s == pytest.approx(plan.predicted_bottleneck_s)


def test_predicted_prefill_matches_the_cut_table(home):
    profiles, plan = home
    for y in (1, 100, 512):
        assert predict_prefill_s(plan, profiles, y) == pytest.approx(plan.cut_table.predicted_latency_s(y))


def test_decode_step_prediction_grows_with_context_and_hops(home):
    profiles, plan = home
    assert predict_decode_step_s(plan, profiles, 2048) > predict_decode_step_s(plan, profiles, 0) > 0


def test_prediction_error_hook_reports_relative_error(home):
    profiles, plan = home
    pred = predict_prefill_s(plan, profiles, 300)
    row = prediction_error(plan, profiles, 300, measured_ttft_s=pred / 1.1)
    assert row["rel_error"] == pytest.approx(0.1)
