"""Serving that holds under a home's ordinary use: real daemons, the real model, real sockets.

Two people asking two devices at once, clients hanging up mid-prefill, a member
restarting on a new port, a request arriving while the daemon still starts.
"""

import json
import random
import socket
import subprocess
import sys
import threading
import time

import pytest

from decoding.generate import generate
from decoding.pipeline_local import LocalPipeline
from meshd.client import MeshdClient
from decoding.device import default_cpu_mode
from tests.support.clients import metrics, ollama_client, sdk
from tests.support.daemons import StreamInBackground, both_ready, plan_nodes, HALF_THE_MODEL, Mesh, summary
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

# With a 2048-token cache the planner gives the embedded model ~190 MiB whole and 125-137 MiB per half
# packed; in the gguf mode (float32 KV cache and activations) ~290 MiB whole and ~213 MiB per half.
NOT_THE_WHOLE_MODEL = ("--memory-budget-mb", "250" if default_cpu_mode() == "gguf" else "145", "--layout", "auto")
QUESTIONS = ["What is the capital of France?", "Name three colours of the rainbow.",
             "How many legs does a spider have?"]


def kv_in_use(proc) -> int:
    return int((proc.status().get("stage") or {}).get("kv_tokens_in_use", -1))


@pytest.fixture(scope="module")
def reference(real_source, served_stage):
    tok = real_source.tokenizer
    cache = {}

    def answer(question: str, max_tokens: int = 16) -> str:
        key = (question, max_tokens)
        if key not in cache:
            ids = tok.apply_chat([{"role": "user", "content": question}])
            cache[key] = generate(LocalPipeline([served_stage]), ids, max_tokens, eos_ids=tok.eos_ids,
                                  tokenizer=tok).text
        return cache[key]
    return answer


@pytest.fixture(scope="module")
def home(real_source):
    """Two paired daemons with the real model, each serving its half of a warm plan.

    A list, not a tuple: the restart test replaces beta with its restarted process, so the
    tests after it (in whatever order a worker runs them) talk to the live one."""
    mesh = Mesh()
    try:
        model = str(real_source.path)
        # layout "auto" (the default): neither holds the whole model, each holds half of it (see
        # NOT_THE_WHOLE_MODEL), so the layout planner must pipeline it
        a = mesh.spawn("alpha", "--model", model, *NOT_THE_WHOLE_MODEL, new_home="serving-test")
        a.wait_serving(60)
        b = mesh.spawn("beta", "--model", model, *NOT_THE_WHOLE_MODEL, token=mesh.invite(a))
        b.wait_serving(60)
        wait_until(lambda: both_ready(a, b), 120, what="a warm two-stage plan", explain=lambda: summary(a, b))
        yield [mesh, a, b, model]
    finally:
        mesh.cleanup()


def test_a_model_no_member_holds_alone_is_served_by_a_pipeline_and_the_plan_says_why(home):
    _, a, _, _ = home
    plan = a.status()["plan"]
    assert plan.get("layout", "pipeline") == "pipeline" and len(plan["stages"]) == 2
    assert "no member holds the whole model alone" in plan["reason"]


def test_two_people_asking_two_devices_at_once_both_get_the_reference_answer(home, reference):
    _, a, b, _ = home
    results: dict[tuple[str, int], str] = {}
    errors: list[str] = []

    def ask(proc, i):
        q = QUESTIONS[i % len(QUESTIONS)]
        try:
            results[(proc.name, i)] = MeshdClient(proc.socket, timeout=240).chat(
                q, max_tokens=16, temperature=0).text
        except Exception as exc:  # noqa: BLE001 - collected and reported
            errors.append(f"{proc.name}#{i}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=ask, args=(p, i)) for i in range(3) for p in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    for (name, i), text in results.items():
        assert text == reference(QUESTIONS[i % len(QUESTIONS)]), (name, i)
    wait_until(lambda: kv_in_use(a) == 0 and kv_in_use(b) == 0, 30, what="every sequence freed")


def test_structured_output_speculates_under_its_grammar_through_two_daemons_and_says_so(home):
    """A grammar on every token (structured output here; a Home Assistant request's tool grammar is the
    same path) no longer turns speculation off: the answer is the same on and off, usage counts the model
    steps per token and the forced drafts, and the coordinator's status sums them under the grammar."""
    _, a, b, _ = home
    client = sdk(a.socket, timeout=240)
    schema = {"type": "object", "properties": {"device": {"type": "string"}, "on": {"type": "boolean"}},
              "required": ["device", "on"]}
    messages = [{"role": "user", "content": "Turn on the kitchen ceiling light. Answer as JSON with device and on."}]
    replies = {}
    for spec in ("off", "auto"):
        resp = client.chat.completions.create(
            model="meshd", messages=messages, max_tokens=40, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "switch", "schema": schema}},
            extra_body={"speculative": spec})
        replies[spec] = resp.choices[0].message.content
        if spec == "auto":
            s = resp.usage.model_dump()["speculative"]
            assert s["constrained"] and s["tokens"] >= 1 and 0 < s["steps_per_token"] <= 1.0
            assert {"forced_drafted", "forced_accepted"} <= set(s)
    assert replies["off"] == replies["auto"]
    json.loads(replies["off"])
    import openai

    with pytest.raises(openai.BadRequestError, match="typical"):  # lossy acceptance cannot keep a grammar's law
        client.chat.completions.create(
            model="meshd", messages=messages, max_tokens=8, temperature=0.7,
            response_format={"type": "json_schema", "json_schema": {"name": "switch", "schema": schema}},
            extra_body={"speculative": {"drafter": "medusa", "typical": True}})
    grammar = a.status()["stage"]["speculative"]["under_grammar"]
    assert grammar["requests"] >= 1 and grammar["tokens"] >= 1
    wait_until(lambda: kv_in_use(a) == 0 and kv_in_use(b) == 0, 30, what="every sequence freed")


def _hang_up_during_prefill(sock_path, prompt: str, after_s: float) -> None:
    body = json.dumps({"messages": [{"role": "user", "content": prompt}], "stream": True,
                       "temperature": 0}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: meshd\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(str(sock_path))
        s.sendall(head + body)
        time.sleep(after_s)  # sleep-ok: the client hangs up this far into its prompt's prefill


def test_clients_hanging_up_during_prefill_leave_no_cache_behind(home, reference):
    """Ten hang-ups with long prompts and no max_tokens once wedged the mesh ("KV cache full")."""
    _, a, b, _ = home
    rng = random.Random(5)
    long_prompt = "Summarise this: " + " ".join(f"item{i}" for i in range(450))
    for i in range(10):
        _hang_up_during_prefill((a, b)[i % 2].socket, long_prompt, rng.uniform(0.2, 0.6))
    wait_until(lambda: kv_in_use(a) == 0 and kv_in_use(b) == 0, 90, what="the hung-up requests' caches freed",
               explain=lambda: f"{summary(a, b)}\nstages: {a.status().get('stage')} {b.status().get('stage')}")
    got = MeshdClient(a.socket, timeout=240).chat(QUESTIONS[0], max_tokens=16, temperature=0).text
    assert got == reference(QUESTIONS[0])


def test_a_member_restarting_on_a_new_port_is_found_and_used_again(home, reference):
    import signal

    mesh, a, b, model = home
    old_port = b.status()["ports"]["transport"]
    b.signal(signal.SIGKILL)
    b.wait(30)
    b2 = mesh.spawn("beta", "--model", model, *HALF_THE_MODEL)  # same state dir: same node id, a new port
    home[2] = b2
    wait_until(lambda: both_ready(a, b2) and b2.status()["ports"]["transport"] != old_port, 120,
               what="the restarted member back in a warm plan", explain=lambda: summary(a, b2))
    for proc in (a, b2):
        got = MeshdClient(proc.socket, timeout=240).chat(QUESTIONS[1], max_tokens=16, temperature=0).text
        assert got == reference(QUESTIONS[1]), summary(a, b2)


def test_a_request_sent_while_the_daemon_starts_waits_and_is_answered(real_source, reference):
    mesh = Mesh()
    try:
        a = mesh.spawn("solo", "--model", str(real_source.path), new_home="startup-test")
        wait_until(lambda: a.socket.exists(), 60, what="the API socket")
        # The model is still loading: the request waits (bounded) instead of a 503.
        got = MeshdClient(a.socket, timeout=240).chat(QUESTIONS[2], max_tokens=16, temperature=0).text
        assert got == reference(QUESTIONS[2])
    finally:
        mesh.cleanup()


def test_sigterm_finishes_the_stage_work_it_does_for_another_daemons_request(real_source, reference):
    """A member asked to stop first serves out the answer another daemon is coordinating through it."""
    import signal

    mesh = Mesh()
    try:
        model = str(real_source.path)
        a = mesh.spawn("alpha", "--model", model, *HALF_THE_MODEL, new_home="drain-test")
        a.wait_serving(60)
        b = mesh.spawn("beta", "--model", model, *HALF_THE_MODEL, token=mesh.invite(a),
                       env={"MESHD_DRAIN_TIMEOUT_S": "120"})
        b.wait_serving(60)
        wait_until(lambda: both_ready(a, b), 120, what="a warm two-stage plan", explain=lambda: summary(a, b))
        replayed_before = (a.status().get("stage") or {}).get("requests_replayed", 0)
        answer = StreamInBackground(a, QUESTIONS[0], 48)
        assert answer.started.wait(120)
        b.signal(signal.SIGTERM)
        outcome = answer.result(200)
        assert outcome.get("text") == reference(QUESTIONS[0], 48), outcome
        assert b.wait(60) == 0
        assert any(e.get("event") == "stage_draining" for e in b.events()), b.log_tail()
        # served out by the draining member, not replayed elsewhere
        assert (a.status().get("stage") or {}).get("requests_replayed", 0) == replayed_before
    finally:
        mesh.cleanup()


def test_speculative_decoding_through_two_daemons_changes_nothing_and_is_reported(home, reference):
    """The openai SDK asks with the `speculative` extension; the text equals plain decoding and
    usage says how many tokens each verify round committed."""
    import openai

    _, a, b, _ = home
    client = sdk(a.socket, timeout=240)
    question = "Repeat exactly: red green blue, red green blue, red green blue, red green blue."
    answers = {}
    for spec in ("off", {"drafter": "lookup"}, "auto"):
        resp = client.chat.completions.create(
            model="meshd", messages=[{"role": "user", "content": question}], max_tokens=32, temperature=0,
            extra_body={"speculative": spec})
        answers[json.dumps(spec)] = resp.choices[0].message.content
        usage = resp.usage.model_dump()
        if spec == "off":
            assert "speculative" not in usage or usage["speculative"] is None
        else:
            assert usage["speculative"]["rounds"] >= 0 and "accepted_per_round" in usage["speculative"]
    assert len(set(answers.values())) == 1, answers
    assert answers['"off"'] == reference(question, 32)
    stage = a.status()["stage"]
    assert stage["speculative"]["requests"] >= 2
    with pytest.raises(openai.BadRequestError, match="draft model"):
        client.chat.completions.create(model="meshd", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       extra_body={"speculative": {"drafter": "draft_model"}})
    with pytest.raises(openai.BadRequestError, match="speculative"):
        client.chat.completions.create(model="meshd", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       extra_body={"speculative": {"drafter": "magic"}})
    wait_until(lambda: kv_in_use(a) == 0 and kv_in_use(b) == 0, 30, what="every sequence freed")


def test_structured_output_through_two_daemons_always_parses(home):
    """Home Assistant asks for JSON through the mesh engine: the last stage's grammar mask holds."""
    _, a, b, _ = home
    client = sdk(a.socket, timeout=240)
    schema = {"type": "object", "properties": {"room": {"type": "string"}, "on": {"type": "boolean"}},
              "required": ["room", "on"], "additionalProperties": False}
    for seed in (1, 2):
        resp = client.chat.completions.create(
            model="meshd", messages=[{"role": "user", "content": "Turn on the kitchen light, as JSON."}],
            max_tokens=48, temperature=1.0, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "light", "schema": schema}})
        obj = json.loads(resp.choices[0].message.content)
        assert set(obj) == {"room", "on"} and isinstance(obj["on"], bool)
    wait_until(lambda: kv_in_use(a) == 0 and kv_in_use(b) == 0, 30, what="every sequence freed")


def test_outline_decoding_through_two_daemons_answers_point_by_point_and_is_counted(home):
    """The openai SDK asks for outline mode: the answer is numbered points, streamed in order;
    `meshd status` counts it; a coding question under "auto" is left to plain decoding."""
    _, a, b, _ = home
    client = sdk(a.socket, timeout=240)
    stream = client.chat.completions.create(
        model="meshd", messages=[{"role": "user", "content": "What are good ways to save energy at home?"}],
        max_tokens=120, temperature=0, stream=True, extra_body={"outline": "on"})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text.startswith("1. ") and "\n2. " in text and text.index("\n2. ") < text.index("\n3. "), text
    code = client.chat.completions.create(
        model="meshd", messages=[{"role": "user", "content": "Write a Python function that adds two numbers."}],
        max_tokens=8, temperature=0, extra_body={"outline": "auto"})
    assert not code.choices[0].message.content.startswith("1. ")
    outline = a.status()["stage"]["outline"]
    assert outline["used"] >= 1 and outline["requests"] == outline["used"] + outline["fallbacks"]
    out = subprocess.run([sys.executable, "-m", "meshd", "status", "--socket", str(a.socket)],
                         capture_output=True, text=True, timeout=60, env=a.env)
    assert "outline decoding: used by" in out.stdout, out.stdout
    assert any(e.get("event") == "outline_attempt" and e.get("mode") == "on" for e in a.events())
    wait_until(lambda: kv_in_use(a) == 0 and kv_in_use(b) == 0, 30, what="every sequence freed")


def _outline_attempts(proc) -> int:
    return sum(e.get("event") in ("outline_attempt", "outline_fallback") for e in proc.events())


def test_a_one_sentence_question_under_auto_gets_a_plain_answer_with_no_outline_attempt(home):
    """Home Assistant's kind of question ("…in one sentence?") reads like a list question to the router,
    but asks for one sentence: through the OpenAI API, the Ollama API and `meshd chat` it is answered
    plainly from the first token — no outline is ever attempted, and status counts why."""
    import httpx
    import ollama
    import openai

    from meshd.pipeline.outline.gate import PAYING_ANSWER_TOKENS

    _, a, b, _ = home
    question = "My living room is cold in the evening. What should I do, in one sentence?"
    BUDGET = PAYING_ANSWER_TOKENS  # room enough: the brevity cue, not the budget, is what declines
    before = (a.status()["stage"]["outline"].get("declined") or {}).get("brevity", 0)
    attempts = _outline_attempts(a)
    answers = [sdk(a.socket, timeout=240).chat.completions.create(
        model="meshd", messages=[{"role": "user", "content": question}], max_tokens=BUDGET, temperature=0,
        extra_body={"outline": "auto"}).choices[0].message.content]
    client = ollama.Client(host="http://localhost", transport=httpx.HTTPTransport(uds=str(a.socket)), timeout=240)
    answers.append(client.chat(model="meshd", messages=[{"role": "user", "content": question}],
                               options={"num_predict": BUDGET, "temperature": 0}).message.content)
    out = subprocess.run([sys.executable, "-m", "meshd", "chat", "--socket", str(a.socket), "--max-tokens", str(BUDGET),
                          "--temperature", "0", question], capture_output=True, text=True, timeout=240, env=a.env)
    assert out.returncode == 0, out.stderr
    answers.append(out.stdout)
    for text in answers:
        assert text.strip() and not text.lstrip().startswith("1."), answers
    assert "outline" not in out.stderr  # the summary line reports no outline
    assert _outline_attempts(a) == attempts, "an outline was attempted"
    assert a.status()["stage"]["outline"]["declined"]["brevity"] == before + 3
    # A list question whose budget cannot hold an outline: plain under "auto", a 400 under "on".
    openai_client = sdk(a.socket, timeout=240)
    short = openai_client.chat.completions.create(
        model="meshd", messages=[{"role": "user", "content": "What are good ways to save energy at home?"}],
        max_tokens=40, temperature=0, extra_body={"outline": "auto"})
    assert short.choices[0].message.content.strip() and "outline" not in short.usage.model_dump()
    with pytest.raises(openai.BadRequestError, match="max_tokens of at least"):
        openai_client.chat.completions.create(
            model="meshd", messages=[{"role": "user", "content": "What are good ways to save energy at home?"}],
            max_tokens=40, temperature=0, extra_body={"outline": "on"})
    assert _outline_attempts(a) == attempts and a.status()["stage"]["outline"]["declined"]["budget"] >= 1
    wait_until(lambda: kv_in_use(a) == 0 and kv_in_use(b) == 0, 30, what="every sequence freed")


def _link_samples(proc) -> dict[str, dict[str, float]]:
    """``meshd_link_*`` samples by peer from the daemon's /metrics, parsed as Prometheus text."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    with httpx.Client(transport=httpx.HTTPTransport(uds=str(proc.socket)), base_url="http://meshd",
                      timeout=10) as h:
        text = h.get("/metrics").text
    out: dict[str, dict[str, float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.startswith("meshd_link_") and "peer" in s.labels:
                out.setdefault(s.name, {})[s.labels["peer"]] = s.value
    return out


def test_metrics_show_the_round_trip_and_the_activation_bytes_to_the_other_daemon(home):
    _, a, b, _ = home
    MeshdClient(a.socket, timeout=240).chat(QUESTIONS[0], max_tokens=4, temperature=0)
    for proc, other in ((a, b), (b, a)):
        rtt = wait_until(lambda p=proc, o=other: _link_samples(p).get("meshd_link_rtt_seconds", {}).get(o.node_id()),
                         30, what=f"{proc.name}'s link RTT to {other.name}", explain=lambda: summary(a, b))
        assert 0 < rtt < 5
        assert _link_samples(proc)["meshd_link_reachable"][other.node_id()] == 1
    first, second = plan_nodes(a)
    by_id = {a.node_id(): a, b.node_id(): b}
    assert _link_samples(by_id[first])["meshd_link_activation_bytes_sent_total"][second] > 0
    assert by_id[first].status()["links"][second]["bytes_sent"] > 0


REUSE_EVENTS = ("plan_adopted", "member_state", "prefix_cache_dropped", "prefix_missed", "prefix_probe_unanswered",
                "request_replaying", "request_done", "stage_loading")


def reuse_story(*procs) -> str:
    """Why a prompt was computed again: the plan, each stage's prefix-cache counters and the events that
    change what a stage holds (a new plan, a member suspected, a probe unanswered), for failure messages."""
    lines = [summary(*procs)]
    for p in procs:
        lines.append(f"{p.name} prefix_cache: {(p.status().get('stage') or {}).get('prefix_cache')}")
        lines += [f"  {p.name} {e.get('timestamp', '')[11:23]} {e['event']} "
                  + " ".join(f"{k}={v}" for k, v in e.items() if k not in ("event", "timestamp", "level", "node"))
                  for e in p.events() if e.get("event") in REUSE_EVENTS]
    return "\n".join(lines)


def test_a_home_assistant_turn_reuses_its_system_prompt_and_answers_as_one_device(home, real_source, served_stage):
    """Home Assistant resends one long system prompt with every request: the second request of a
    conversation (over the openai SDK) and the third (over the ollama client) compute only what is
    new, report it as OpenAI's ``cached_tokens`` and Ollama's ``prompt_eval_count``, and answer
    exactly as one device does."""
    _, a, b, _ = home
    tok = real_source.tokenizer
    system = ("You are a voice assistant for Home Assistant. Answer in one short sentence. Exposed entities: "
              + " ".join(f"Light {i} is in room {i % 7}." for i in range(60)))
    turn = [{"role": "system", "content": system}, {"role": "user", "content": "Turn on light 3."}]

    def reference(messages, n=12) -> str:
        return generate(LocalPipeline([served_stage]), tok.apply_chat(messages), n, eos_ids=tok.eos_ids,
                        tokenizer=tok).text

    client = sdk(a.socket, timeout=240)
    first = client.chat.completions.create(model="meshd", messages=turn, max_tokens=12, temperature=0)
    assert first.choices[0].message.content == reference(turn)
    turn += [{"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "And light 4?"}]
    second = client.chat.completions.create(model="meshd", messages=turn, max_tokens=12, temperature=0)
    assert second.choices[0].message.content == reference(turn)
    system_tokens = len(tok.apply_chat(turn[:1], add_generation_prompt=False))
    # a packed (exact) stage shares whole 64-position blocks only: at most 63 of them are computed again
    assert second.usage.prompt_tokens_details.cached_tokens >= system_tokens - 63, reuse_story(a, b)

    turn += [{"role": "assistant", "content": second.choices[0].message.content},
             {"role": "user", "content": "Thanks."}]
    parts = list(ollama_client(a.socket).chat(model="meshd", messages=turn, stream=True,
                                             options={"temperature": 0, "num_predict": 12}))
    assert "".join(p.message.content or "" for p in parts) == reference(turn)
    prompt_tokens = len(tok.apply_chat(turn))
    # only the new tokens evaluated
    assert 0 < parts[-1].prompt_eval_count < prompt_tokens - system_tokens + 64, reuse_story(a, b)

    status = a.status()["stage"]["prefix_cache"]
    assert status["requests"]["hits"] >= 2 and status["entries"] >= 1
    assert metrics(a.socket)["meshd_prefix_cache_hits_total"][()] >= 2
    wait_until(lambda: kv_in_use(a) == 0 and kv_in_use(b) == 0, 30, what="every running sequence freed")


def test_early_exits_through_two_daemons_are_asked_per_request_counted_and_refused_where_they_cannot_mix(home):
    """The openai SDK and the ollama client ask for exits (meshd's ``exit_threshold``); usage says how many
    tokens left early, the last stage's status and /metrics say where; exits with speculation "on" are a 400."""
    import ollama
    import openai

    _, a, b, _ = home
    client = sdk(a.socket, timeout=240)
    question = "List the days of the week."
    resp = client.chat.completions.create(model="meshd", messages=[{"role": "user", "content": question}],
                                          max_tokens=24, temperature=0, extra_body={"exit_threshold": 0.6})
    exits = resp.usage.model_dump()["exits"]
    assert resp.choices[0].message.content and exits["threshold"] == 0.6 and exits["tokens"] >= 2
    assert 0 <= exits["exited"] <= exits["tokens"] - 1  # the first token is the prompt's: it never exits
    off = client.chat.completions.create(model="meshd", messages=[{"role": "user", "content": question}],
                                         max_tokens=24, temperature=0)
    assert "exits" not in off.usage.model_dump() or off.usage.model_dump()["exits"] is None
    reply = ollama_client(a.socket).chat(model="meshd", messages=[{"role": "user", "content": question}],
                                         options={"temperature": 0, "num_predict": 12, "exit_threshold": 0.6})
    assert reply.message.content
    _, last = plan_nodes(a)
    by_id = {a.node_id(): a, b.node_id(): b}
    stage = by_id[last].status()["stage"]
    assert stage["exit_layers"] == [23, 26, 29] and stage["exits"]["asked"] >= exits["tokens"] - 1
    samples = metrics(by_id[last].socket)
    assert sum(samples["meshd_exit_steps_total"].values()) == stage["exits"]["asked"]
    out = subprocess.run([sys.executable, "-m", "meshd", "status", "--socket", str(by_id[last].socket)],
                         capture_output=True, text=True, timeout=60, env=a.env)
    assert "early exits: " in out.stdout and "decode steps left early" in out.stdout, out.stdout
    with pytest.raises(openai.BadRequestError, match="exit_threshold"):
        client.chat.completions.create(model="meshd", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       extra_body={"exit_threshold": 0.7, "speculative": True})
    with pytest.raises(openai.BadRequestError, match="exit_threshold"):
        client.chat.completions.create(model="meshd", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       extra_body={"exit_threshold": 1.5})
    with pytest.raises(ollama.ResponseError):
        ollama_client(a.socket).chat(model="meshd", messages=[{"role": "user", "content": "hi"}],
                                     options={"num_predict": 4, "exit_threshold": -0.1})
    wait_until(lambda: kv_in_use(a) == 0 and kv_in_use(b) == 0, 30, what="every sequence freed")
