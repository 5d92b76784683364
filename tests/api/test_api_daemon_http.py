"""A real daemon process with ``--http``: keys from ``meshd apikey`` admit clients over TCP.

The daemon runs a fake engine (``--engine``), so this checks the wiring
(flags, key store in the state dir, health from the daemon's readiness,
mesh metrics, the link round trip to a second, model-less member), not
generation.
"""

from __future__ import annotations

import json

import httpx
import ollama
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.api import REPLY, FakeEngine
from tests.support.daemons import kill_hard, run_cli, summary
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow


def make_engine(daemon):
    return FakeEngine()


def test_daemon_serves_ollama_and_openai_on_its_lan_listener_with_a_key(mesh):
    d = mesh.spawn("hub", "--engine", "tests.api.test_api_daemon_http:make_engine", "--http", "0.0.0.0:0",
                   new_home="flat")
    status = d.wait_serving()
    port = int(status["api"]["http"].rpartition(":")[2])
    assert status["api"]["http_auth"] == "api key"
    url = f"http://127.0.0.1:{port}"
    assert httpx.get(f"{url}/api/tags").status_code == 401  # no key exists yet: nothing gets in

    rc, out = run_cli("apikey", "create", "ha", "--state-dir", str(d.state_dir), "--json")
    assert rc == 0
    key = json.loads(out.strip().splitlines()[-1])["key"]
    client = ollama.Client(host=url, headers={"Authorization": f"Bearer {key}"})
    assert [m.model for m in client.list().models] == ["fake-model:latest"]
    assert client.chat(model="fake-model", messages=[{"role": "user", "content": "hi"}], stream=False,
                       options={"temperature": 0}).message.content == REPLY

    health = httpx.get(f"{url}/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {key}"}).text
    samples = {s.name: s for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples["meshd_ready"].value == 1 and samples["meshd_uptime_seconds"].value > 0
    assert "meshd_plan_version" in samples and "meshd_members" in samples

    me = next(m for m in d.status()["members"] if m["self"])
    assert me["version"] and me["uptime_s"] is not None

    # A second member: its link's round trip shows in /metrics (parsed as Prometheus text) and in
    # the status; once it is gone, the link turns unreachable and the stale RTT disappears.
    b = mesh.spawn("member", token=mesh.invite(d))
    b.wait_serving()
    b_id = b.node_id()

    def link_samples() -> dict[str, dict]:
        text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {key}"}, timeout=10).text
        out: dict[str, dict] = {}
        for fam in text_string_to_metric_families(text):
            for smp in fam.samples:
                if smp.name.startswith("meshd_link_") and "peer" in smp.labels:
                    out.setdefault(smp.name, {})[smp.labels["peer"]] = smp.value
        return out

    rtt = wait_until(lambda: link_samples().get("meshd_link_rtt_seconds", {}).get(b_id), 30,
                     what="a link RTT sample for the second member", explain=lambda: summary(d, b))
    assert 0 < rtt < 5 and link_samples()["meshd_link_reachable"][b_id] == 1
    link = d.status()["links"][b_id]
    assert link["reachable"] and link["age_s"] is not None and link["rtt_s"] > 0
    assert wait_until(lambda: (b.status()["links"].get(d.node_id()) or {}).get("rtt_s"), 30,
                      what="the second member's RTT to the first")
    kill_hard(b)
    wait_until(lambda: link_samples().get("meshd_link_reachable", {}).get(b_id) == 0, 30,
               what="the killed member's link reported unreachable", explain=lambda: d.status()["links"])
    assert b_id not in link_samples().get("meshd_link_rtt_seconds", {})

    rc, _ = run_cli("apikey", "revoke", "ha", "--state-dir", str(d.state_dir))
    assert rc == 0
    with pytest.raises(ollama.ResponseError) as info:
        client.list()
    assert info.value.status_code == 401
