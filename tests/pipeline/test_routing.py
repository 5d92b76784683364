"""Per-request routing over a plan's routes, and the workload the coordinators report to the planner."""

from meshd.mesh.planner import moved
from meshd.pipeline.route import Route, StageEndpoint
from meshd.pipeline.coordinator.routes import RouteCounts, RouteLoad, pick_route
from meshd.pipeline.coordinator.workload import MIN_REQUESTS, WorkloadMeter, combine
from partition.layout import Workload


def route(index, *nodes):
    return Route(1, tuple(StageEndpoint(n, "", "", 0, 30) for n in nodes), index=index)


A, B, P = route(0, "a"), route(1, "b"), route(2, "c", "d")


def test_an_idle_home_sends_a_request_to_the_first_replica_and_a_busy_replica_is_passed_by():
    assert pick_route([RouteLoad(A, 0), RouteLoad(B, 0)], 100) is A
    assert pick_route([RouteLoad(A, 1), RouteLoad(B, 0)], 100) is B


def test_a_prompt_goes_where_its_longest_prefix_is_cached_and_load_decides_only_among_equals():
    assert pick_route([RouteLoad(A, 0, 0), RouteLoad(B, 0, 90)], 100) is B
    assert pick_route([RouteLoad(A, 0, 0), RouteLoad(B, 1, 90)], 100) is B  # busy, but it holds the conversation
    assert pick_route([RouteLoad(A, 0, 0), RouteLoad(B, 1, 10)], 100) is A  # too short to be worth it
    # both hold the system prompt, one the turn too: within MIN_SHARED tokens the idle one is as good
    assert pick_route([RouteLoad(A, 0, 2900), RouteLoad(B, 1, 2950)], 3000) is A
    assert pick_route([RouteLoad(A, 0, 2800), RouteLoad(B, 1, 2950)], 3000) is B
    # a shared system prompt must not pin everyone to one replica: two requests busier, load decides
    assert pick_route([RouteLoad(A, 0, 0), RouteLoad(B, 2, 2950)], 3000) is A


def test_recent_requests_say_where_a_conversation_left_its_prompt():
    from meshd.pipeline.coordinator.routes import RecentRequests
    from meshd.pipeline.coordinator.slot import RequestSlot, StepsRequest

    recent = RecentRequests(capacity=2)
    first = RequestSlot(StepsRequest("call", list(range(100)), 8), None)
    first.generated += [500, 501, 502]
    recent.note(B, first)
    follow_up = list(range(100)) + [500, 501, 777, 5]
    assert recent.held(B, follow_up) == 102 and recent.held(A, follow_up) == 0
    assert recent.held(B, follow_up, asking=first) == 0  # a replay is not drawn back to where it was lost
    recent.note(A, RequestSlot(StepsRequest("x", [1], 8), None))
    recent.note(A, RequestSlot(StepsRequest("y", [2], 8), None))
    assert recent.held(B, follow_up) == 0  # forgotten: only the last few are kept


def test_a_cold_long_prompt_prefers_the_pipeline_group_when_the_replicas_are_as_busy():
    assert pick_route([RouteLoad(A, 1), RouteLoad(P, 1)], 3000) is P
    assert pick_route([RouteLoad(A, 0, 2990), RouteLoad(P, 0)], 3000) is A  # but a warm replica wins


def test_counts_spread_a_burst_and_go_back_to_zero():
    counts = RouteCounts()
    picks = []
    for _ in range(4):
        r = pick_route([RouteLoad(x, counts.running(x)) for x in (A, B)], 50)
        counts.take(r)
        picks.append(r.index)
    assert sorted(picks) == [0, 0, 1, 1]
    for r in (A, A, B, B):
        counts.give(r)
    assert counts.to_dict() == {}


def test_the_workload_is_said_only_after_enough_requests_and_the_home_adds_up_concurrency():
    meter = WorkloadMeter()
    for _ in range(MIN_REQUESTS - 1):
        meter.record(1000, 900, 40, 2)
    assert meter.snapshot() == {}
    meter.record(1000, 900, 40, 2)
    snap = meter.snapshot()
    assert snap["prompt_tokens"] == 1000 and snap["cached_fraction"] == 0.9 and snap["in_flight"] == 2
    home = combine([snap, snap, {}, {"requests": 1}])
    assert home == Workload(1000, 40, 0.9, 4.0)
    assert combine([{}, {"requests": 9, "prompt_tokens": "x"}]) is None


def test_a_re_plan_is_priced_only_when_the_workload_moved_a_lot():
    w = Workload(1000, 40, 0.9, 2)
    assert moved(None, w)
    assert not moved(w, Workload(1100, 44, 0.85, 2.5))
    assert moved(w, Workload(1000, 40, 0.9, 4))
    assert moved(w, Workload(1000, 40, 0.5, 2))


def test_old_requests_leave_the_workload():
    now = [0.0]
    meter = WorkloadMeter(clock=lambda: now[0])
    for _ in range(MIN_REQUESTS):
        meter.record(100, 0, 10, 3)
    assert meter.snapshot()["in_flight"] == 3
    now[0] += 3600
    assert meter.snapshot() == {}
