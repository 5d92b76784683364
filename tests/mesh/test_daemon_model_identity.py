"""One model per home, with real daemons: a member holding another model is left out, says why, and
refuses requests; the home answers as one device would (issue #29: before, such a home answered 500
"token ids must be in [0, 49152)" or streamed gibberish and `meshd chat` exited 0).

Two members hold the embedded SmolLM2, a third the 0.5B Qwen: most members hold SmolLM2, so that is
the home's model whichever device leads. The Qwen member never loads a layer (only the file's header
and tokenizer), so the test costs about what a two-member home does.
"""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from decoding.generate import generate
from decoding.pipeline_local import LocalPipeline
from meshd.client import ApiError, MeshdClient
from meshd.mesh.home_plan import model_name
from tests.support.daemons import run_cli, summary
from tests.support.repo import ROOT
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

OTHER_MODEL = "qwen2.5-coder-0.5b-instruct"


@pytest.fixture
def other_model():
    from meshd.model.store import is_named_pulled

    if not is_named_pulled(OTHER_MODEL):
        pytest.skip(f"{OTHER_MODEL} is not in the model cache (meshd model pull {OTHER_MODEL})")
    return OTHER_MODEL


def _reasons(proc) -> dict[str, str]:
    return {n["node_id"]: n["reason"] for n in proc.status().get("not_planned") or []}


def test_a_member_holding_another_model_is_left_out_with_its_reason_and_refuses_requests(
        mesh, real_source, served_stage, other_model):
    smol = str(real_source.path)
    a = mesh.spawn("alpha", "--model", smol, new_home="mixed")
    a.wait_serving(60)
    b = mesh.spawn("beta", "--model", smol, token=mesh.invite(a))
    q = mesh.spawn("qwen", "--model", other_model, token=mesh.invite(a))
    for p in (b, q):
        p.wait_serving(60)
    procs = (a, b, q)
    reason = f"holds {other_model}, the home serves {model_name(real_source.identity)}"

    # Every member (not only the leader) lists the Qwen member as not planned, with the reason.
    def settled():
        for p in procs:
            s = p.status()
            plan = s.get("plan") or {}
            if plan.get("model") != real_source.identity or len(plan.get("members") or []) != 2:
                return False
            if _reasons(p).get(q.node_id()) != reason:
                return False
        return True

    wait_until(settled, 90, what="a plan over the two SmolLM2 members, the Qwen one left out with its reason",
               explain=lambda: summary(*procs) + "".join(f"\n{p.name}: {p.status().get('not_planned')}"
                                                       for p in procs))
    assert q.node_id() not in {s["node_id"] for s in a.status()["plan"]["stages"]}
    rc, out = run_cli("status", "--socket", str(q.socket))
    assert rc == 0 and f"not planned: qwen: {reason}" in out, out
    # The Qwen member's own log (what `meshd join` prints) said so once. (It says so as soon as the
    # home's plan arrives, from its file name if its model still loads; whether the plan or the load
    # comes first is a race since a GGUF opens in a second, so the order is not asserted.)
    events = [e["event"] for e in q.events()]
    assert events.count("model_differs_from_home") == 1, q.log_tail()
    warned = next(e for e in q.events() if e["event"] == "model_differs_from_home")
    assert warned["holds"].startswith(other_model) and warned["home_serves"] == real_source.identity
    assert "restart this device without --model (the embedded default)" in warned["hint"]

    # Through a member holding the home's model: the answer one device gives.
    question = "What is the capital of France?"
    tok = real_source.tokenizer
    want = generate(LocalPipeline([served_stage]), tok.apply_chat([{"role": "user", "content": question}]), 16,
                    eos_ids=tok.eos_ids, tokenizer=tok).text
    got = MeshdClient(a.socket, timeout=180).chat(question, max_tokens=16, temperature=0)
    assert got.text == want, summary(*procs)

    # Through the Qwen member: a clear refusal (never gibberish, never a 500), and `meshd chat` fails.
    with pytest.raises(ApiError) as info:
        MeshdClient(q.socket, timeout=60).chat(question, max_tokens=8, temperature=0)
    assert info.value.status == 409 and reason in str(info.value), str(info.value)
    chat = subprocess.run([sys.executable, "-m", "meshd", "chat", "--socket", str(q.socket), question],
                          capture_output=True, text=True, timeout=120, env=q.env, cwd=ROOT)
    assert chat.returncode != 0 and reason in chat.stderr, (chat.returncode, chat.stdout, chat.stderr)
    assert chat.stdout.strip() == ""

    # Its health and a script waiting for it say why it will never serve, not "loading".
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(q.socket)), base_url="http://meshd") as h:
        health = h.get("/health")
    assert health.status_code == 503, health.text
    assert "the home serves" in health.json()["reason"] and "restart it without --model" in health.json()["reason"]
    waited = subprocess.run([sys.executable, "-m", "meshd", "status", "--socket", str(q.socket), "--wait", "1",
                             "--ready"], capture_output=True, text=True, timeout=60, env=q.env, cwd=ROOT)
    assert waited.returncode == 1 and "the home serves" in waited.stderr, waited.stderr
