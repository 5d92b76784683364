"""The Ollama API, spoken to by the real ``ollama`` Python client (the one Home Assistant uses).

A fake engine keeps these fast; the real-model conversation (Qwen calling a
tool) is in ``tests/api/test_api_home_assistant.py``.
"""

from __future__ import annotations

import json

import httpx
import ollama
import pytest

from tests.support.api import REPLY, FakeEngine, ServerThread, ToolEngine
from tests.support.clients import ollama_client


TOOLS = [{"type": "function", "function": {
    "name": "HassTurnOn", "description": "Turns on a device",
    "parameters": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}}}]


@pytest.fixture
def tool_srv():
    with ServerThread(ToolEngine()) as s:
        yield s


def test_list_show_ps_and_version_describe_the_served_model(srv):
    c = ollama_client(srv)
    models = c.list().models
    assert [m.model for m in models] == ["fake-model:latest"]
    shown = c.show("fake-model")
    assert "completion" in shown.capabilities and "tools" not in shown.capabilities
    assert "temperature" in shown.parameters
    assert [m.model for m in c.ps().models] == ["fake-model:latest"]
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(srv.socket_path))) as h:
        assert h.get("http://localhost/api/version").json()["version"]
        assert "Ollama is running" in h.get("http://localhost/").text


def test_chat_streams_ndjson_and_ends_with_counts(srv):
    parts = list(ollama_client(srv).chat(model="fake-model", messages=[{"role": "user", "content": "hi"}],
                                  stream=True, options={"temperature": 0}))
    assert "".join(p.message.content for p in parts) == REPLY
    assert len(parts) > 2 and not parts[0].done
    last = parts[-1]
    assert last.done and last.done_reason == "stop"
    assert last.eval_count == len(REPLY) and last.prompt_eval_count > 0
    assert last.model == "fake-model"  # the name asked for, which is the served model's


def test_chat_without_streaming_returns_one_message(srv):
    r = ollama_client(srv).chat(model="fake-model", messages=[{"role": "user", "content": "hi"}], stream=False)
    assert r.message.content == REPLY and r.done


def test_options_map_to_sampling_and_limits(srv):
    r = ollama_client(srv).chat(model="fake-model", messages=[{"role": "user", "content": "hi"}], stream=False,
                         options={"temperature": 0.3, "top_k": 5, "top_p": 0.5, "seed": 9,
                                  "num_predict": 7, "num_ctx": 4096})
    req = srv.engine.requests[-1]
    s = req.options.sampling.params
    assert (s.temperature, s.top_k, s.top_p, s.seed) == (0.3, 5, 0.5, 9)
    assert req.max_tokens == 7 and r.eval_count == 7 and r.done_reason == "length"


def test_ollamas_sampling_defaults_apply_when_no_options_are_sent(srv):
    ollama_client(srv).chat(model="fake-model", messages=[{"role": "user", "content": "hi"}], stream=False)
    s = srv.engine.requests[-1].options.sampling.params
    assert (s.temperature, s.top_k, s.top_p) == (0.8, 40, 0.9)


def test_generate_streams_and_returns_its_context(srv):
    parts = list(ollama_client(srv).generate(model="fake-model", prompt="Once upon", stream=True))
    assert "".join(p.response for p in parts) == REPLY
    assert parts[-1].done and parts[-1].context and len(parts[-1].context) > len(REPLY)


def test_generate_raw_sends_the_prompt_as_is(srv):
    ollama_client(srv).generate(model="fake-model", prompt="abc", raw=True, stream=False, options={"num_predict": 2})
    assert srv.engine.requests[-1].prompt_ids == [ord("a"), ord("b"), ord("c")]


def test_empty_chat_and_generate_just_load_the_model(srv):
    c = ollama_client(srv)
    assert c.generate(model="fake-model", prompt="").done_reason == "load"
    assert c.chat(model="fake-model", messages=[]).done_reason == "load"


@pytest.mark.parametrize("kwargs, field", [
    ({"options": {"mirostat": 2}}, "options.mirostat"),
    ({"options": {"min_p": 0.1}}, "options.min_p"),
    ({"options": {"top_p": 1.5}}, "options.top_p"),
    ({"options": {"not_an_option": 1}}, "options.not_an_option"),
    ({"options": {"repeat_penalty": 1.2}}, "options.repeat_penalty"),  # the fake engine has no penalties
    ({"format": "json"}, "format"),  # nor structured output
    ({"think": True}, "think"),
    ({"keep_alive": "forever"}, "keep_alive"),
])
def test_what_cannot_be_honoured_is_a_400_in_ollamas_error_format(srv, kwargs, field):
    with pytest.raises(ollama.ResponseError) as info:
        ollama_client(srv).chat(model="fake-model", messages=[{"role": "user", "content": "hi"}], stream=False, **kwargs)
    assert info.value.status_code == 400
    assert field in info.value.error, info.value.error


def test_load_time_options_and_keep_alive_are_accepted(srv):
    r = ollama_client(srv).chat(model="fake-model", messages=[{"role": "user", "content": "hi"}], stream=False,
                         keep_alive=-1, options={"num_gpu": 0, "num_thread": 2, "use_mmap": True,
                                                 "mirostat": 0, "min_p": 0.0})
    assert r.message.content == REPLY


def test_images_are_refused_clearly(srv):
    with pytest.raises(ollama.ResponseError) as info:
        ollama_client(srv).chat(model="fake-model", messages=[{"role": "user", "content": "hi", "images": ["aGk="]}])
    assert info.value.status_code == 400 and "images" in info.value.error


def test_tools_on_a_model_without_tool_support_are_a_400(srv):
    with pytest.raises(ollama.ResponseError) as info:
        ollama_client(srv).chat(model="fake-model", messages=[{"role": "user", "content": "hi"}], tools=TOOLS)
    assert info.value.status_code == 400 and "tool" in info.value.error


def test_the_speculative_extension_is_accepted_at_the_top_level_and_in_options(srv):
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(srv.socket_path)),
                      base_url="http://localhost") as h:
        for body in ({"speculative": "off"}, {"options": {"speculative": {"drafter": "lookup"}}}):
            r = h.post("/api/chat", json={"model": "fake-model", "stream": False,
                                          "messages": [{"role": "user", "content": "hi"}], **body})
            assert r.status_code == 200, r.text
        assert srv.engine.requests[-2].options.speculative.mode == "off"
        assert srv.engine.requests[-1].options.speculative.drafter == "lookup"
        r = h.post("/api/chat", json={"model": "fake-model", "messages": [], "speculative": {"drafter": "nope"}})
        assert r.status_code == 400 and "speculative" in r.json()["error"]


def test_tool_calls_come_back_as_message_tool_calls_and_results_go_back_into_the_prompt(tool_srv):
    c = ollama_client(tool_srv)
    msgs = [{"role": "user", "content": "turn on the kitchen light"}]
    parts = list(c.chat(model="fake-model", messages=msgs, tools=TOOLS, stream=True))
    calls = [tc for p in parts for tc in (p.message.tool_calls or [])]
    assert [(tc.function.name, dict(tc.function.arguments)) for tc in calls] == [
        ("HassTurnOn", {"name": "kitchen light"})]
    assert "".join(p.message.content or "" for p in parts) == ""  # the call is not also text
    msgs += [{"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "HassTurnOn", "arguments": {"name": "kitchen light"}}}]},
             {"role": "tool", "content": json.dumps({"success": True})}]
    final = c.chat(model="fake-model", messages=msgs, tools=TOOLS, stream=False)
    assert final.message.content == "The kitchen light is on." and not final.message.tool_calls
    rendered = tool_srv.engine.tokenizer.rendered[-1]
    assert '"arguments": {"name": "kitchen light"}' in rendered and "<tool>" in rendered


def test_pull_of_the_served_model_succeeds_at_once(srv):
    c = ollama_client(srv)
    assert c.pull("fake-model").status == "success"
    statuses = [p.status for p in c.pull("fake-model:latest", stream=True)]
    assert statuses[-1] == "success"


def test_unknown_ollama_paths_answer_in_ollamas_error_format(srv):
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(srv.socket_path)),
                      base_url="http://localhost") as h:
        r = h.post("/api/embed", json={"model": "fake-model", "input": "x"})
        assert r.status_code == 501 and isinstance(r.json()["error"], str)
        r = h.get("/api/nope")
        assert r.status_code == 404 and isinstance(r.json()["error"], str)
        r = h.post("/api/chat", content=b"{not json")
        assert r.status_code == 400 and isinstance(r.json()["error"], str)


def test_speculation_stats_ride_in_the_final_message_and_in_openai_usage():
    from decoding.speculative.params import SpeculativeStats

    from meshd.engine.base import TokenStream

    class Speculating(FakeEngine):
        def token_ids(self, req):
            async def ids(report):
                report(speculative=SpeculativeStats("lookup", rounds=4, drafted=12, accepted=6))
                async for t in super(Speculating, self).token_ids(req):
                    yield t
            return TokenStream(ids)

    with ServerThread(Speculating()) as s:
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(s.socket_path)), base_url="http://localhost") as h:
            final = h.post("/api/chat", json={"model": "fake-model", "stream": False,
                                              "messages": [{"role": "user", "content": "hi"}]}).json()
            usage = h.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}]}).json()["usage"]
        lines = [json.loads(x) for x in ollama_client(s)._client.post(
            "/api/chat", json={"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}).text.splitlines()]
    assert final["speculative"]["drafter"] == "lookup" and final["speculative"]["accepted"] == 6
    assert usage["speculative"]["rounds"] == 4
    assert lines[-1]["done"] and lines[-1]["speculative"]["drafted"] == 12
