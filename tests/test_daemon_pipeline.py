"""Real daemons split the real model between them and answer through the unix-socket API."""

import pytest

from decoding.generate import generate
from decoding.pipeline_local import LocalPipeline
from meshd.client import MeshdClient
from tests.test_daemon_helpers import mesh, summary, wait_for  # noqa: F401 - fixture

pytestmark = pytest.mark.slow


def plan_stages(proc) -> list:
    return (proc.status().get("plan") or {}).get("stages") or []


def two_daemon_mesh(mesh, model: str, home: str):
    """A home of two paired daemons with the real model, once their plan splits the layers."""
    a = mesh.spawn("alpha", "--model", model, new_home=home)
    a.wait_serving(60)
    b = mesh.spawn("beta", "--model", model, token=mesh.invite(a))
    b.wait_serving(60)
    wait_for(lambda: len(plan_stages(a)) == 2 and len(plan_stages(b)) == 2, 90,
             what="a two-stage plan", explain=lambda: summary(a, b))
    return a, b


def test_two_daemons_split_the_layers_and_match_the_single_device_reference(mesh, real_source, real_stage):
    a, b = two_daemon_mesh(mesh, str(real_source.path), "pipeline-test")
    (a0, a1), (b0, b1) = (s["layers"] for s in plan_stages(a))
    assert a0 == 0 and a1 == b0 and b1 == 30

    question = "What is the capital of France?"
    tok = real_source.tokenizer
    want = generate(LocalPipeline([real_stage]), tok.apply_chat([{"role": "user", "content": question}]), 24,
                    eos_ids=tok.eos_ids, tokenizer=tok).text
    for proc in (a, b):  # either daemon can coordinate a request
        got = MeshdClient(proc.socket, timeout=180).chat(question, max_tokens=24, temperature=0)
        assert got.text == want, summary(a, b)
    assert "Paris" in want


def test_an_answer_survives_a_daemon_killed_mid_request(mesh, real_source, real_stage):
    """The coordinator replays the request on the survivor: a pause, the same greedy answer."""
    import signal

    from tests.test_daemon_serving import StreamInBackground

    a, b = two_daemon_mesh(mesh, str(real_source.path), "pipeline-kill")
    question = "Write a long story about a lighthouse keeper."
    tok = real_source.tokenizer
    want = generate(LocalPipeline([real_stage]), tok.apply_chat([{"role": "user", "content": question}]), 120,
                    eos_ids=tok.eos_ids, tokenizer=tok).text
    answer = StreamInBackground(a, question, 120, after=10)
    assert answer.started.wait(120), "the answer never started streaming"
    b.signal(signal.SIGKILL)
    outcome = answer.result(170)
    assert "error" not in outcome, outcome
    assert outcome["text"] == want, summary(a)
    wait_for(lambda: [s["node_id"] for s in plan_stages(a)] == [a.node_id()], 60,
             what="a re-plan onto the surviving daemon", explain=lambda: summary(a))
    assert (a.status().get("stage") or {}).get("requests_replayed", 0) >= 1
