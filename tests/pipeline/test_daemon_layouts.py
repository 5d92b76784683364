"""Real daemons holding the whole model each: replicas, routed per request, answering like one device."""

import signal
import threading

import pytest

from decoding.generate import generate
from decoding.pipeline_local import LocalPipeline
from tests.support.clients import sdk
from tests.support.daemons import Mesh, StreamInBackground, summary
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

QUESTIONS = ["What is the capital of France?", "Name three colours of the rainbow.",
             "How many legs does a spider have?", "What do bees make?"]
LONG = ["Write a long story about a lighthouse keeper.", "Describe a walk through a forest in autumn."]


def routes(proc) -> dict[int, list[tuple[str, list[int]]]]:
    out: dict[int, list] = {}
    for s in (proc.status().get("plan") or {}).get("stages") or []:
        out.setdefault(int(s.get("route", 0)), []).append((s["node_id"], list(s["layers"])))
    return out


def forwards(proc) -> int:
    return int((proc.status().get("stage") or {}).get("forwards", 0))


@pytest.fixture(scope="module")
def reference(real_source, served_stage):
    tok = real_source.tokenizer

    def answer(question: str, max_tokens: int) -> str:
        ids = tok.apply_chat([{"role": "user", "content": question}])
        return generate(LocalPipeline([served_stage]), ids, max_tokens, eos_ids=tok.eos_ids, tokenizer=tok).text
    return answer


@pytest.fixture(scope="module")
def replicas(real_source):
    mesh = Mesh()
    try:
        a, b = mesh.pair("replicas-test", "--model", str(real_source.path), "--layout", "replicas")

        def two_replicas() -> bool:
            sa, sb = a.status(), b.status()
            return (len(routes(a)) == 2 and (sa.get("plan") or {}).get("version") ==
                    (sb.get("plan") or {}).get("version") and bool(sa.get("ready")) and bool(sb.get("ready")))
        wait_until(two_replicas, 120, what="a warm plan of two replicas", explain=lambda: summary(a, b))
        yield mesh, a, b
    finally:
        mesh.cleanup()


def test_two_replicas_hold_the_whole_model_and_answer_people_at_once_like_one_device(replicas, reference):
    _, a, b = replicas
    plan = a.status()["plan"]
    assert plan["layout"] == "replicas" and "replica" in plan["reason"]
    assert sorted(r[0][1] for r in routes(a).values()) == [[0, 30], [0, 30]]
    before = forwards(a), forwards(b)
    answers: dict[int, str] = {}
    errors: list[str] = []

    def ask(i):
        try:
            reply = sdk(a.socket, timeout=240).chat.completions.create(
                model="meshd", messages=[{"role": "user", "content": QUESTIONS[i]}], max_tokens=16, temperature=0)
            answers[i] = reply.choices[0].message.content
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(f"{i}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(QUESTIONS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    for i, text in answers.items():
        assert text == reference(QUESTIONS[i], 16), i
    # both devices computed: the coordinator spread the four requests over the two routes
    assert forwards(a) > before[0] and forwards(b) > before[1], summary(a, b)


def test_a_replica_killed_mid_answer_leaves_its_request_to_the_other_with_identical_text(replicas, reference):
    """Two long answers coordinated by alpha run on the two replicas; beta dies; the one it ran replays on
    alpha's replica, and both answers are the reference's."""
    _, a, b = replicas
    streams = [StreamInBackground(a, q, 96, after=6) for q in LONG]
    for s in streams:
        assert s.started.wait(180), "an answer never started streaming"
    b.signal(signal.SIGKILL)
    for q, s in zip(LONG, streams):
        outcome = s.result(240)
        assert "error" not in outcome, outcome
        assert outcome["text"] == reference(q, 96), summary(a)
    assert (a.status().get("stage") or {}).get("requests_replayed", 0) >= 1
    wait_until(lambda: list(routes(a).values()) == [[(a.node_id(), [0, 30])]], 60,
               what="a re-plan onto the surviving replica", explain=lambda: summary(a))
