"""``/health`` says whether a request would be served now; ``/metrics`` is valid Prometheus text."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.support.api import STATUS, FakeEngine, ServerThread
from tests.support.clients import get, metrics


def test_health_is_ok_when_serving():
    with ServerThread(FakeEngine(), status={**STATUS, "ready": True}) as srv:
        r = get(srv, "/health")
        assert r.status_code == 200 and r.json() == {"status": "ok", "model": "fake-model"}


@pytest.mark.parametrize("engine, status, reason", [
    (None, {"load_state": "loading"}, "loading the model"),
    (None, {"load_state": "failed"}, "failed to load"),
    (None, {"load_state": "none"}, "runs no model"),
    ("fake", {**STATUS, "ready": False, "plan": None}, "waiting for a plan"),
    ("fake", {**STATUS, "ready": False}, "plan v3 is loading"),
    ("fake", {**STATUS, "state": "draining"}, "shutting down"),
])
def test_health_is_503_with_the_reason_otherwise(engine, status, reason):
    with ServerThread(FakeEngine() if engine else None, status=status) as srv:
        r = get(srv, "/health")
        assert r.status_code == 503 and reason in r.json()["reason"]
        assert r.headers["Retry-After"]


def test_metrics_parse_and_count_requests_tokens_and_latency():
    status = {**STATUS, "ready": True, "uptime_s": 100.0,
              "stage": {"layers": [0, 18], "kv_tokens_in_use": 321, "kv_tokens_max": 4096,
                        "sequences": 2, "busy_s": 25.0, "forwards": 40, "activation_bytes_out": 9000}}
    with ServerThread(FakeEngine(), status=status) as srv:
        client = openai.OpenAI(base_url="http://localhost/v1", api_key="x", max_retries=0,
                               http_client=httpx.Client(transport=httpx.HTTPTransport(uds=str(srv.socket_path))))
        for _ in range(2):
            client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "hi"}])
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "hi"}], seed=2**70)
        m = metrics(srv)
    ok = (("api", "openai"), ("endpoint", "/v1/chat/completions"), ("outcome", "ok"))
    assert m["meshd_requests_total"][ok] == 2
    assert m["meshd_requests_rejected_total"][(("status", "400"),)] == 1
    assert m["meshd_generation_tokens_total"][()] == 2 * len("Hello from the fake mesh. It is deterministic.")
    assert m["meshd_time_to_first_token_seconds_count"][()] == 2
    assert m["meshd_time_per_output_token_seconds_count"][()] == 2
    assert m["meshd_requests_in_flight"][()] == 0 and m["meshd_queue_depth"][()] == 0
    assert m["meshd_plan_version"][()] == 3
    assert m["meshd_members"][(("state", "active"),)] == 1 and m["meshd_members"][(("state", "joining"),)] == 1
    layers = (("layers", "0-18"),)
    assert m["meshd_stage_kv_tokens_in_use"][layers] == 321
    assert m["meshd_stage_busy_seconds_total"][layers] == 25.0
    assert m["meshd_stage_busy_fraction"][layers] == 0.25
    assert m["meshd_link_bytes_sent_total"][layers] == 9000


def test_metrics_show_each_links_round_trip_reachability_and_bytes_sent():
    status = {**STATUS, "links": {
        "n-def456": {"rtt_s": 0.0042, "age_s": 1.2, "reachable": True, "failures": 0, "probes": 3,
                     "bytes_sent": 4096},
        "n-gone": {"rtt_s": None, "age_s": 40.0, "reachable": False, "failures": 5, "probes": 9},
        "n-new": {"rtt_s": None, "age_s": None, "reachable": False, "failures": 0, "probes": 1},
    }}
    with ServerThread(FakeEngine(), status=status) as srv:
        m = metrics(srv)
    assert m["meshd_link_rtt_seconds"] == {(("peer", "n-def456"),): 0.0042}  # no stale value for the others
    assert m["meshd_link_reachable"] == {(("peer", "n-def456"),): 1.0, (("peer", "n-gone"),): 0.0,
                                         (("peer", "n-new"),): 0.0}
    assert m["meshd_link_activation_bytes_sent_total"] == {(("peer", "n-def456"),): 4096}


def test_queue_depth_counts_requests_waiting_for_their_first_token():
    import threading

    engine = FakeEngine()
    engine.delay_s = 0.05
    with ServerThread(engine) as srv:
        client = openai.OpenAI(base_url="http://localhost/v1", api_key="x", max_retries=0,
                               http_client=httpx.Client(transport=httpx.HTTPTransport(uds=str(srv.socket_path))))
        t = threading.Thread(target=lambda: client.chat.completions.create(
            model="fake-model", messages=[{"role": "user", "content": "hi"}]))
        t.start()
        from tests.support.waiting import wait_until

        assert wait_until(lambda: metrics(srv)["meshd_requests_in_flight"][()] == 1)
        t.join(30)
        assert metrics(srv)["meshd_requests_in_flight"][()] == 0
