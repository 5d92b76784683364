"""Real daemons split the real model between them and answer through the unix-socket API."""

import re

import pytest

from decoding.generate import generate
from decoding.pipeline_local import LocalPipeline
from meshd.client import MeshdClient
from tests.support.daemons import HALF_THE_MODEL, summary
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow


def plan_stages(proc) -> list:
    return (proc.status().get("plan") or {}).get("stages") or []


def two_daemon_mesh(mesh, model: str, home: str):
    """A home of two paired daemons with the real model, once their plan splits the layers."""
    a = mesh.spawn("alpha", "--model", model, *HALF_THE_MODEL, new_home=home)
    a.wait_serving(60)
    b = mesh.spawn("beta", "--model", model, *HALF_THE_MODEL, token=mesh.invite(a))
    b.wait_serving(60)
    wait_until(lambda: len(plan_stages(a)) == 2 and len(plan_stages(b)) == 2, 90,
               what="a two-stage plan", explain=lambda: summary(a, b))
    return a, b


def test_two_daemons_split_the_layers_and_match_the_single_device_reference(mesh, real_source, served_stage):
    a, b = two_daemon_mesh(mesh, str(real_source.path), "pipeline-test")
    (a0, a1), (b0, b1) = (s["layers"] for s in plan_stages(a))
    assert a0 == 0 and a1 == b0 and b1 == 30

    question = "What is the capital of France?"
    tok = real_source.tokenizer
    want = generate(LocalPipeline([served_stage]), tok.apply_chat([{"role": "user", "content": question}]), 24,
                    eos_ids=tok.eos_ids, tokenizer=tok).text
    for proc in (a, b):  # either daemon can coordinate a request
        got = MeshdClient(proc.socket, timeout=180).chat(question, max_tokens=24, temperature=0)
        assert got.text == want, summary(a, b)
    assert re.search(r"[A-Za-z]{3}", want), f"the reference answers in words: {want!r}"


def test_an_answer_survives_a_daemon_killed_mid_request(mesh, real_source, served_stage):
    """The coordinator replays the request on the survivor: a pause, the same greedy answer."""
    import signal

    from tests.support.daemons import StreamInBackground

    a, b = two_daemon_mesh(mesh, str(real_source.path), "pipeline-kill")
    question = "Write a long story about a lighthouse keeper."
    tok = real_source.tokenizer
    want = generate(LocalPipeline([served_stage]), tok.apply_chat([{"role": "user", "content": question}]), 120,
                    eos_ids=tok.eos_ids, tokenizer=tok).text
    answer = StreamInBackground(a, question, 120, after=10)
    assert answer.started.wait(120), "the answer never started streaming"
    b.signal(signal.SIGKILL)
    outcome = answer.result(170)
    assert "error" not in outcome, outcome
    assert outcome["text"] == want, summary(a)
    wait_until(lambda: [s["node_id"] for s in plan_stages(a)] == [a.node_id()], 60,
               what="a re-plan onto the surviving daemon", explain=lambda: summary(a))
    assert (a.status().get("stage") or {}).get("requests_replayed", 0) >= 1


def test_daemons_time_themselves_once_and_are_planned_with_what_they_measured(mesh, real_source):
    """``self_profile = quick``: each daemon times one layer before it is planned, every member
    sees the other's measurement, and a restart reuses it instead of measuring again."""
    import signal

    quick = {"MESHD_SELF_PROFILE": "quick"}
    model = str(real_source.path)
    a = mesh.spawn("alpha", "--model", model, *HALF_THE_MODEL, new_home="self-profile", env=quick)
    a.wait_serving(60)
    b = mesh.spawn("beta", "--model", model, *HALF_THE_MODEL, token=mesh.invite(a), env=quick)
    b.wait_serving(60)

    def both_measured(proc):
        s = proc.status()
        return (s.get("profile") == "measured" and len(plan_stages(proc)) == 2
                and all("one-layer estimate" in (m.get("profile") or "") for m in s["members"]))

    for proc in (a, b):
        wait_until(lambda proc=proc: both_measured(proc), 120, what="both members planned by their own timing",
                   explain=lambda: summary(a, b))
    assert len(list((a.state_dir / "profiles").glob("self-*.json"))) == 1

    a.signal(signal.SIGTERM)
    assert a.wait(60) == 0
    a.start()
    wait_until(lambda: a.status().get("load_state") == "loaded", 90, what="alpha to load again")
    assert a.status()["profile"] == "reused"
    assert sum(e.get("event") == "self_profile_measured" for e in a.events()) == 1


def test_a_stage_that_cannot_reach_the_next_names_it_to_a_coordinator_on_another_daemon(mesh, real_source):
    """``ErrorReply.node`` travels between daemons of this tree (their heartbeats announce ``error_node``).

    Three daemons, one stage each; the request is coordinated by the last. The middle one is
    killed first: the first stage cannot send the prompt on to it and says so in its error
    reply, whose text starts with the first stage's own name. The coordinator suspects the
    middle one, so it read the reply's ``node``, not its text. (Failure detection is slowed
    down so the reply, not a re-plan, is what tells the coordinator.)"""
    from tests.support.daemons import StreamInBackground, kill_hard

    model, slow = str(real_source.path), ["--suspect-after", "30", "--gone-after", "60"]
    procs = []
    for name in ("alpha", "beta", "gamma"):
        token = {"new_home": "error-node"} if not procs else {"token": mesh.invite(procs[0])}
        p = mesh.spawn(name, "--model", model, "--memory-budget-mb", "64", start=False, **token)
        p.cmd += slow  # after FAST: the last value counts
        procs.append(p.start())
        p.wait_serving(60)
    wait_until(lambda: all(len(plan_stages(p)) == 3 and p.status().get("ready") for p in procs), 180,
               what="a three-stage plan, warm", explain=lambda: summary(*procs))
    by_node = {p.node_id(): p for p in procs}
    first, middle, last = (by_node[s["node_id"]] for s in plan_stages(procs[0]))
    kill_hard(middle)
    answer = StreamInBackground(last, "Write a story about a lighthouse keeper.", 8)

    def replayed():  # this request's replays (a daemon's own warm-up request may replay on a re-plan too)
        return [e for e in last.events() if e.get("event") == "request_replaying"
                and not str(e.get("request_id", "")).startswith("warmup")]

    wait_until(replayed, 60, what="the coordinator to replay the request", explain=lambda: last.log_tail(20))
    why = replayed()[0]
    assert why["device"] == middle.node_id(), why
    assert first.node_id() in why["reason"] and "link" in why["reason"], why  # the text names the reporter
    for p in (first, last):
        kill_hard(p)
    answer.result(60)
