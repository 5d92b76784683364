"""Request validation by pydantic models: the edge cases where a model could differ from hand checks.

The OpenAI bodies are validated by strict models (``meshd.api.openai_schema``),
the Ollama ones by lax models (``meshd.api.ollama_schema``); both turn the first
error into the same 400 through ``meshd.api.validation``. These pin what a
client sees: the ``param`` path, the ``code``, and a message that says what to
send instead.
"""

from __future__ import annotations

import httpx
import pytest
from pydantic import BaseModel, Field

from meshd.api import openai_schema as oa
from meshd.api.validation import RequestError, param_of, validate
from tests.support.api import REPLY

HI = [{"role": "user", "content": "hi"}]
CHAT = "/v1/chat/completions"


def chat_error(body: dict, vocab: int | None = 1000) -> RequestError:
    with pytest.raises(RequestError) as info:
        oa.parse_chat_request(body, vocab_size=vocab)
    return info.value


def completion_error(body: dict, vocab: int | None = 1000) -> RequestError:
    with pytest.raises(RequestError) as info:
        oa.parse_completion_request(body, vocab_size=vocab)
    return info.value


# --------------------------------------------------------------------------- numbers


@pytest.mark.parametrize("extra, param", [
    ({"temperature": 10**99}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
    ({"top_p": 10**40}, "top_p"),
    ({"seed": 10**99}, "seed"),
    ({"seed": -(10**99)}, "seed"),
    ({"top_k": 10**99}, "top_k"),
    ({"n": 10**99}, "n"),
    ({"presence_penalty": -(10**99)}, "presence_penalty"),
    ({"max_tokens": 1e10}, "max_tokens"),  # a float, however whole, is not an integer
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
])
def test_huge_and_out_of_range_numbers_name_their_field(extra, param):
    err = chat_error({"messages": HI, **extra})
    assert (err.param, err.code, err.status) == (param, "invalid_value", 400)


def test_a_huge_max_tokens_is_valid_and_left_for_the_server_to_clip():
    assert oa.parse_chat_request({"messages": HI, "max_tokens": 10**99}).options.max_tokens == 10**99


def test_top_k_is_bounded_by_the_engines_vocabulary_when_it_is_known():
    assert chat_error({"messages": HI, "top_k": 1001}).message == (
        "'top_k' must be an integer from 0 to 1000 (0 disables it) (got 1001)")
    assert oa.parse_chat_request({"messages": HI, "top_k": 1000}, vocab_size=1000).options.sampling.params.top_k == 1000
    assert oa.parse_chat_request({"messages": HI, "top_k": 5000}, vocab_size=None).options.sampling.params.top_k == 5000


def test_messages_say_what_to_send_and_what_came():
    assert chat_error({"messages": HI, "temperature": 3}).message == (
        "'temperature' must be a number between 0 and 2 (got 3)")
    assert chat_error({"messages": HI, "n": 2}).message == "'n' only 1 is supported (got 2)"
    assert chat_error({"messages": HI, "stop": ["a"] * 5}).message == (
        "'stop' accepts at most 4 strings (got [\"a\", \"a\", \"a\", \"a\", \"a\"])")


# --------------------------------------------------------------------------- types (strict)


@pytest.mark.parametrize("extra, param", [
    ({"temperature": "0.5"}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"top_k": True}, "top_k"),
    ({"seed": "1"}, "seed"),
    ({"max_tokens": "10"}, "max_tokens"),
    ({"stream": 1}, "stream"),
    ({"stream": "true"}, "stream"),
    ({"stream_options": []}, "stream_options"),
    ({"stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ({"model": ["m"]}, "model"),
    ({"stop": ["a", 1]}, "stop"),
    ({"parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ({"messages": [*HI, "oops"]}, "messages[1]"),
    ({"messages": {"role": "user", "content": "hi"}}, "messages"),
])
def test_wrong_types_are_not_coerced(extra, param):
    err = chat_error({"messages": HI, **extra})
    assert (err.param, err.code) == (param, "invalid_value")


def test_whole_number_floats_are_fine_where_a_number_is_asked():
    p = oa.parse_chat_request({"messages": HI, "temperature": 1, "top_p": 1, "presence_penalty": 0}).options
    assert (p.sampling.params.temperature, p.sampling.params.top_p, p.sampling.penalties.presence) == (1.0, 1.0, 0.0)


# --------------------------------------------------------------------------- unknown and unsupported fields


def test_unknown_fields_anywhere_are_ignored():
    req = oa.parse_chat_request({
        "messages": [{"role": "user", "content": "hi", "x_note": 1}], "service_tier": "auto",
        "x_client_field": {"a": [1]}, "stream_options": {"include_usage": True, "x": 1},
        "user": ["any", "shape"], "metadata": {"k": "v"}, "store": "yes"})
    assert req.messages == HI and req.options.include_usage


@pytest.mark.parametrize("extra, param", [
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"audio": {"voice": "alloy"}}, "audio"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ({"function_call": {"name": "f"}}, "function_call"),
    ({"logprobs": 1}, "logprobs"),  # 1 is not false, and True is not 1
    ({"top_logprobs": True}, "top_logprobs"),
    ({"logit_bias": []}, "logit_bias"),
])
def test_fields_meshd_does_not_implement_are_refused_unless_at_their_default(extra, param):
    err = chat_error({"messages": HI, **extra})
    assert (err.param, err.code) == (param, "unsupported_parameter")
    assert "not supported" in err.message


def test_the_defaults_of_fields_meshd_does_not_implement_are_accepted():
    oa.parse_chat_request({"messages": HI, "modalities": ["text"], "audio": None, "function_call": "auto",
                           "functions": [], "logprobs": 0, "top_logprobs": 0.0, "logit_bias": {}})
    oa.parse_completion_request({"prompt": "x", "echo": False, "suffix": "", "best_of": 1, "logprobs": None})
    err = completion_error({"prompt": "x", "suffix": "tail"})
    assert (err.param, err.code) == ("suffix", "unsupported_parameter")


# --------------------------------------------------------------------------- nested messages


@pytest.mark.parametrize("messages, param", [
    ([*HI, {"role": "assistant", "content": "ok"}, {"role": "robot", "content": "x"}], "messages[2].role"),
    ([{"content": "no role"}], "messages[0].role"),
    ([{"role": 5, "content": "x"}], "messages[0].role"),
    ([{"role": "User", "content": "x"}], "messages[0].role"),  # roles are case-sensitive, as OpenAI's
    ([{"role": "user"}], "messages[0].content"),  # only an assistant turn may omit its content
    ([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": 5}]}],
     "messages[0].content[1].text"),
    ([{"role": "user", "content": [{"type": "text", "text": "a"}, "b"]}], "messages[0].content[1]"),
    ([{"role": "user", "content": {"type": "text", "text": "a"}}], "messages[0].content"),
    ([*HI, {"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}],
     "messages[1].tool_calls[0]"),
])
def test_nested_message_errors_name_the_message_and_field(messages, param):
    err = chat_error({"messages": messages})
    assert err.param == param, err.message


def test_messages_become_the_templates_history():
    req = oa.parse_chat_request({"messages": [
        {"role": "developer", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]},
        {"role": "tool", "content": "42", "tool_call_id": "c1", "name": 7}]})
    assert req.messages == [
        {"role": "system", "content": "be brief"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"a": 1}}, "id": "c1"}]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"}]  # a non-string name is dropped


# --------------------------------------------------------------------------- tools and schemas

BAD_SCHEMA_TOOL = [{"type": "function", "function": {
    "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "no-such-type"}}}}}]


@pytest.mark.parametrize("extra, param, code", [
    ({"tools": "get_weather"}, "tools", "invalid_value"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "a string"}}]},
     "tools[0].function.parameters", "invalid_value"),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": 5}}]},
     "tools[0].function.description", "invalid_value"),
    ({"tools": [{"type": "function"}]}, "tools[0].function", "invalid_value"),
    ({"tool_choice": "sometimes"}, "tool_choice", "invalid_value"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema", "invalid_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "{}"}}},
     "response_format.json_schema", "invalid_value"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "invalid_value"),
    ({"response_format": {"type": "xml"}}, "response_format", "invalid_value"),
    ({"response_format": "json"}, "response_format", "invalid_value"),
])
def test_bad_tools_and_schemas_are_a_400_naming_the_field(extra, param, code):
    err = chat_error({"messages": HI, **extra})
    assert (err.param, err.code) == (param, code), err.message


class _GrammarEngine:
    """What constrain_tool_calls asks of an engine: grammar support and the chat template."""

    def __init__(self, supports: bool = True):
        from types import SimpleNamespace

        from meshd.engine.options import Capabilities

        self.capabilities = Capabilities(constraints=supports)
        self.tokenizer = SimpleNamespace(meta=SimpleNamespace(chat_template="... <tool_call> ... {{ tools }}"))


@pytest.mark.parametrize("choice", [None, "required", {"type": "function", "function": {"name": "f"}}])
def test_offered_tools_whose_schema_cannot_compile_are_a_400_naming_tools(choice):
    from meshd.api.generation import constrain_tool_calls

    req = oa.parse_chat_request({"messages": HI, "tools": BAD_SCHEMA_TOOL, "tool_choice": choice})
    with pytest.raises(oa.RequestError) as info:
        constrain_tool_calls(_GrammarEngine(), req.options, req.tools, req.tool_choice, req.parallel_tool_calls)
    assert (info.value.param, info.value.code) == ("tools", "invalid_schema")


def test_offered_tools_put_the_answer_under_their_grammar():
    """auto: text or a call (grammar lazily on); required / named: a call from the first token."""
    from meshd.api.generation import constrain_tool_calls

    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in "gh"]

    def spec(choice, parallel=True, engine=None):
        req = oa.parse_chat_request({"messages": HI, "tools": tools, "tool_choice": choice,
                                     "parallel_tool_calls": parallel})
        return constrain_tool_calls(engine or _GrammarEngine(), req.options, req.tools, req.tool_choice,
                                    req.parallel_tool_calls)

    def grammar(choice, **kw):
        return spec(choice, **kw).sampling.constraint

    auto = spec(None)
    g = auto.sampling.constraint
    assert g["type"] == "tool_calls" and g["style"] == "hermes"
    assert not g["required"] and auto.constraint_param == "tools"
    assert [t["name"] for t in g["tools"]] == ["g", "h"]
    required = spec("required", parallel=False)
    assert required.sampling.constraint["required"] and not required.sampling.constraint["parallel"]
    assert required.constraint_param == "tool_choice"
    named = grammar({"type": "function", "function": {"name": "h"}})
    assert named["required"] and [t["name"] for t in named["tools"]] == ["h"]
    assert grammar("none") is None
    assert grammar(None, engine=_GrammarEngine(supports=False)) is None  # parsed from text only
    assert grammar("required", engine=_GrammarEngine(supports=False)) is not None  # then a 400


def test_response_formats_become_constraints():
    def constraint(rf):
        return oa.parse_chat_request({"messages": HI, "response_format": rf}).options.sampling.constraint

    schema = {"type": "object", "properties": {"on": {"type": "boolean"}}}
    assert constraint({"type": "text"}) is None
    assert constraint({"type": "json_object", "json_schema": "ignored"}) == {"type": "json_object"}
    assert constraint({"type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": True}}) == {
        "type": "json_schema", "schema": schema}


# --------------------------------------------------------------------------- completions


@pytest.mark.parametrize("prompt, param", [
    ([True, 1], "prompt"),
    ([1.0], "prompt"),
    ([], "prompt"),
    ([[1, 2], [3]], "prompt"),
    ([10**99], "prompt"),
    ([[5, 1000]], "prompt"),
])
def test_token_id_prompts_must_be_integers_in_the_vocabulary(prompt, param):
    assert completion_error({"prompt": prompt}).param == param


def test_a_batch_of_one_prompt_is_the_prompt():
    assert oa.parse_completion_request({"prompt": [[1, 2]]}, vocab_size=10).prompt == [1, 2]
    assert oa.parse_completion_request({"prompt": ["hi"]}).prompt == "hi"
    assert "send one" in completion_error({"prompt": ["a", "b"]}).message


# --------------------------------------------------------------------------- the shared helper


def test_error_paths_read_as_a_client_writes_them():
    assert param_of(("messages", 0, "content", 1, "text")) == "messages[0].content[1].text"
    assert param_of(("options", "top_p")) == "options.top_p"
    assert param_of(()) is None


def test_any_model_gets_the_apis_400():
    class Body(BaseModel):
        size: int = Field(ge=1, le=9)
        tags: list[str] = Field(default_factory=list, max_length=2)

    with pytest.raises(RequestError) as info:
        validate(Body, {"size": 12})
    assert (info.value.param, info.value.message) == ("size", "'size' must be at most 9 (got 12)")
    with pytest.raises(RequestError) as info:
        validate(Body, {})
    assert (info.value.param, info.value.message) == ("size", "'size' is required")
    with pytest.raises(RequestError) as info:
        validate(Body, {"size": 1, "tags": ["a", "b", "c"]})
    assert info.value.message.startswith("'tags' accepts at most 2 items")


def test_the_ollama_api_names_nested_fields_the_same_way(server):  # noqa: F811 - fixture
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(server.socket_path)), base_url="http://localhost") as h:
        r = h.post("/api/chat", json={"model": "fake-model", "stream": False,
                                      "messages": [{"role": "user", "content": "hi"}, {"role": "wizard"}]})
        assert r.status_code == 400 and r.json()["error"].startswith("'messages[1].role' must be one of")
        r = h.post("/api/chat", json={"model": "fake-model", "messages": HI, "options": {"top_p": 2}})
        assert r.status_code == 400 and r.json()["error"] == "'options.top_p' must be at most 1 (got 2)"
        ok = h.post(CHAT, json={"messages": [{"role": "user", "content": "hi", "x": 1}], "x_field": 2})
        assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == REPLY


@pytest.mark.parametrize("value", [1.5, -0.1, True, "on", "0.5", 10 ** 99, [0.5]])
def test_the_cloud_field_takes_auto_off_or_a_budget_from_0_to_1(value):
    err = chat_error({"messages": HI, "cloud": value})
    assert (err.param, err.code, err.status) == ("cloud", "invalid_value", 400)
    assert "cloud budget from 0 to 1" in err.message
    assert oa.parse_chat_request({"messages": HI, "cloud": 1}).options.cloud == 1.0
    assert oa.parse_chat_request({"messages": HI, "cloud": "off"}).options.cloud == "off"
    assert oa.parse_chat_request({"messages": HI}).options.cloud == "auto"


def test_a_cloud_budget_on_an_engine_without_a_verifier_is_refused_not_ignored(server):  # noqa: F811
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(server.socket_path)), base_url="http://localhost") as h:
        r = h.post(CHAT, json={"messages": HI, "cloud": 0.5})
        assert r.status_code == 400 and r.json()["error"]["param"] == "cloud"
        assert h.post(CHAT, json={"messages": HI, "cloud": "off"}).status_code == 200
        r = h.post("/api/chat", json={"model": "fake-model", "stream": False, "messages": HI, "cloud": 1.0})
        assert r.status_code == 400 and "cloud" in r.json()["error"]
