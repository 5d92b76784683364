"""The official ``openai`` package works unchanged over the unix socket."""

from __future__ import annotations

import httpx
import openai
import pytest

from meshd.engine.errors import GenerationFailed, NoPlan, WrongModel
from tests.support.api import REPLY, FakeEngine, ServerThread
from tests.support.clients import sdk


def test_openai_client_streams_a_chat_completion(server):
    client = sdk(server)
    stream = client.chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "hi"}], stream=True,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == REPLY
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1


def test_stream_usage_is_sent_when_asked(server):
    client = sdk(server)
    chunks = list(client.chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "hi"}], stream=True,
        stream_options={"include_usage": True},
    ))
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == len(REPLY)


def test_openai_client_gets_a_non_streamed_text_completion(server):
    client = sdk(server)
    resp = client.completions.create(model="fake-model", prompt="Once upon", max_tokens=5)
    assert resp.choices[0].text == REPLY[:5]
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.prompt_tokens == len("Once upon")
    assert resp.usage.completion_tokens == 5


def test_openai_client_streams_a_text_completion(server):
    client = sdk(server)
    chunks = list(client.completions.create(model="fake-model", prompt="x", stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == REPLY


def test_non_streamed_chat_reports_usage_and_passes_sampling_fields(server, engine):
    client = sdk(server)
    resp = client.chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "hi"}],
        temperature=0.0, top_p=0.5, seed=7, max_tokens=100,
    )
    assert resp.choices[0].message.content == REPLY
    assert resp.choices[0].finish_reason == "stop"
    assert resp.usage.completion_tokens == len(REPLY)
    req = engine.requests[-1]
    s = req.options.sampling.params
    assert (s.temperature, s.top_p, s.seed, req.max_tokens) == \
        (0.0, 0.5, 7, 100)


def test_the_api_keeps_openais_default_temperature_of_one(server, engine):
    from decoding.sampling import SamplingParams, SamplingSpec
    from meshd.engine.base import GenerationRequest

    sdk(server).chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "hi"}])
    assert engine.requests[-1].options.sampling == SamplingSpec(SamplingParams(temperature=1.0))
    assert GenerationRequest("r", [1], 1).options.sampling == SamplingSpec()  # the engine's own default: greedy


def test_stop_string_ends_the_answer_and_is_never_emitted(server):
    client = sdk(server)
    chunks = list(client.chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "hi"}], stream=True,
        stop=["fake mesh"],
    ))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hello from the "
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_models_list_names_the_served_model(server):
    assert [m.id for m in sdk(server).models.list()] == ["fake-model"]
    assert sdk(server).models.retrieve("fake-model").id == "fake-model"


def test_malformed_json_gets_an_openai_error_and_the_server_keeps_serving(server):
    transport = httpx.HTTPTransport(uds=str(server.socket_path))
    with httpx.Client(transport=transport, base_url="http://localhost") as http:
        bad = http.post("/v1/chat/completions", content=b'{"messages": [',
                        headers={"Content-Type": "application/json"})
        assert bad.status_code == 400
        err = bad.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["type"] == "invalid_request_error" and err["code"] == "invalid_json"
        ok = http.post("/v1/chat/completions",
                       json={"messages": [{"role": "user", "content": "hi"}]})
        assert ok.status_code == 200
        assert ok.json()["choices"][0]["message"]["content"] == REPLY


def test_openai_client_raises_bad_request_for_a_bad_field(server):
    with pytest.raises(openai.BadRequestError) as info:
        sdk(server).chat.completions.create(
            model="fake-model", messages=[{"role": "user", "content": "hi"}], max_tokens=-3)
    assert info.value.body["param"] == "max_tokens"


def test_prompt_over_the_context_is_413():
    with ServerThread(FakeEngine(context_length=32)) as srv:
        with pytest.raises(openai.APIStatusError) as info:
            sdk(srv).chat.completions.create(
                model="fake-model", messages=[{"role": "user", "content": "x" * 100}], stream=True)
        assert info.value.status_code == 413
        assert info.value.body["code"] == "context_length_exceeded"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("error,status,code", [
    (NoPlan("no partition of the model fits the 1 device in the mesh"), 503, "no_plan"),
    # a device holding another model than its home's (tests/mesh/test_daemon_model_identity.py)
    (WrongModel("this device holds qwen, the home serves smol, so it answers no requests"), 409, "model_mismatch"),
])
def test_a_refusal_before_any_token_keeps_its_status_code_and_message(stream, error, status, code):
    eng = FakeEngine()
    eng.fail_before = error
    with ServerThread(eng) as srv:
        with pytest.raises(openai.APIStatusError) as info:
            r = sdk(srv).chat.completions.create(
                model="fake-model", messages=[{"role": "user", "content": "hi"}], stream=stream)
            list(r) if stream else None
        assert info.value.status_code == status
        assert info.value.body["code"] == code and info.value.body["message"] == str(error)


def test_failure_mid_stream_is_sent_as_an_error_event():
    eng = FakeEngine()
    eng.fail_after = (5, GenerationFailed("device kitchen-pi left the mesh"))
    with ServerThread(eng) as srv:
        stream = sdk(srv).chat.completions.create(
            model="fake-model", messages=[{"role": "user", "content": "hi"}], stream=True)
        with pytest.raises(openai.APIError, match="kitchen-pi left"):
            list(stream)
        eng.fail_after = None  # the device came back: the next request is served
        ok = sdk(srv).chat.completions.create(
            model="fake-model", messages=[{"role": "user", "content": "hi"}])
        assert ok.choices[0].message.content.startswith("Hello")
