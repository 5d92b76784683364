"""Tool calls: the ``openai`` SDK against a real tool-calling model, and the parser's formats.

The model is Qwen2.5-Coder-0.5B-Instruct (its chat template renders tools);
those tests skip with the reason when it is not cached and cannot be fetched.
The parser and stream filter tests need no model.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from meshd.api.tools import ToolStreamFilter, parse_tool_calls
from tests.support.local_engines import TOOL_MODEL, local_engine
from tests.support.api import ServerThread

WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "the city, e.g. Paris"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}}]
ASK = [{"role": "user", "content": "What is the weather like in Paris right now?"}]


def sdk(srv: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://localhost/v1", api_key="unused", max_retries=0, timeout=600,
                         http_client=httpx.Client(transport=httpx.HTTPTransport(uds=str(srv.socket_path))))


@pytest.fixture(scope="module")
def qwen():
    with ServerThread(local_engine(TOOL_MODEL)) as srv:
        yield srv


@pytest.fixture(scope="module")
def smol():
    with ServerThread(local_engine(None)) as srv:
        yield srv


# --------------------------------------------------------------------------- real model


@pytest.mark.slow
def test_a_tool_call_comes_back_with_finish_reason_tool_calls_then_the_result_is_used(qwen):
    c = sdk(qwen)
    r = c.chat.completions.create(model="meshd", messages=ASK, tools=WEATHER, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message.content
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert "paris" in json.loads(call.function.arguments)["city"].lower()

    history = [*ASK, choice.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp_c": 21, "sky": "sunny"})}]
    r2 = c.chat.completions.create(model="meshd", messages=history, tools=WEATHER, temperature=0)
    # What the model makes of the result is the model's business (the 0.5B calls again; the
    # 1.5B answers, bench/ha_commands.py); that it comes back well formed is ours.
    again = r2.choices[0].message.tool_calls or []
    if r2.choices[0].finish_reason == "tool_calls":
        assert again and all(t.function.name == "get_weather" and "city" in json.loads(t.function.arguments)
                             for t in again)
    else:
        assert r2.choices[0].finish_reason == "stop" and not again and r2.choices[0].message.content


@pytest.mark.slow
def test_streamed_tool_calls_arrive_as_deltas_not_as_text(qwen):
    chunks = list(sdk(qwen).chat.completions.create(model="meshd", messages=ASK, tools=WEATHER,
                                                     temperature=0, stream=True))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    deltas = [tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or []]
    assert text == "" and len(deltas) == 1
    assert deltas[0].function.name == "get_weather" and json.loads(deltas[0].function.arguments)["city"]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.slow
def test_tool_choice_naming_a_function_forces_a_valid_call(qwen):
    """A forced call is constrained decoding of the call object: it always parses and fits."""
    r = sdk(qwen).chat.completions.create(
        model="meshd", messages=[{"role": "user", "content": "Tell me a joke."}], tools=WEATHER,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, temperature=1.0, seed=3)
    call = r.choices[0].message.tool_calls[0]
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments)["city"], str)


@pytest.mark.slow
def test_tool_choice_required_always_calls_and_a_schema_that_cannot_compile_is_a_400(qwen):
    c = sdk(qwen)
    r = c.chat.completions.create(model="meshd", messages=[{"role": "user", "content": "Tell me a joke."}],
                                  tools=WEATHER, tool_choice="required", temperature=0)
    assert r.choices[0].finish_reason == "tool_calls"
    assert json.loads(r.choices[0].message.tool_calls[0].function.arguments)["city"]
    broken = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "pattern": "(unclosed"}}}}}]
    with pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(model="meshd", messages=ASK, tools=broken)
    assert info.value.body["param"] == "tools" and info.value.body["code"] == "invalid_schema"
    assert c.chat.completions.create(model="meshd", messages=ASK, tools=WEATHER, max_tokens=4).choices  # still serving


@pytest.mark.slow
def test_tool_choice_none_renders_no_tools(qwen):
    r = sdk(qwen).chat.completions.create(model="meshd", messages=ASK, tools=WEATHER, tool_choice="none",
                                          temperature=0, max_tokens=8)
    assert not r.choices[0].message.tool_calls and r.choices[0].finish_reason in ("stop", "length")


@pytest.mark.slow
def test_a_model_whose_template_has_no_tools_is_a_clear_400(smol):
    with pytest.raises(openai.BadRequestError) as info:
        sdk(smol).chat.completions.create(model="meshd", messages=ASK, tools=WEATHER)
    assert info.value.body["param"] == "tools" and info.value.body["code"] == "tools_not_supported"


def test_bad_tool_definitions_are_a_400_naming_the_field():
    from tests.support.api import ToolEngine

    with ServerThread(ToolEngine()) as srv:
        c = sdk(srv)
        for tools, param in (([{"type": "function", "function": {"name": "bad name!"}}], "tools[0].function.name"),
                             ([{"type": "retrieval"}], "tools[0]"),
                             ([WEATHER[0], WEATHER[0]], "tools[1].function.name")):
            with pytest.raises(openai.BadRequestError) as info:
                c.chat.completions.create(model="meshd", messages=ASK, tools=tools)
            assert info.value.body["param"] == param
        with pytest.raises(openai.BadRequestError) as info:
            c.chat.completions.create(model="meshd", messages=ASK, tools=WEATHER,
                                      tool_choice={"type": "function", "function": {"name": "nope"}})
        assert info.value.body["param"] == "tool_choice"
        bad_history = [*ASK, {"role": "assistant", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{oops"}}]}]
        with pytest.raises(openai.BadRequestError) as info:
            c.chat.completions.create(model="meshd", messages=bad_history, tools=WEATHER)
        assert info.value.body["param"] == "messages[1].tool_calls[0].function.arguments"


def test_parallel_tool_calls_false_returns_one_call():
    from tests.support.api import ToolEngine

    engine = ToolEngine()
    two = ToolEngine.CALL + "\n" + ToolEngine.CALL.replace("kitchen light", "hall light")
    with ServerThread(engine) as srv:
        engine.CALL = two
        c = sdk(srv)
        tools = [{"type": "function", "function": {"name": "HassTurnOn", "parameters": {"type": "object"}}}]
        both = c.chat.completions.create(model="meshd", messages=ASK, tools=tools)
        one = c.chat.completions.create(model="meshd", messages=ASK, tools=tools, parallel_tool_calls=False)
    assert len(both.choices[0].message.tool_calls) == 2 and len(one.choices[0].message.tool_calls) == 1


# --------------------------------------------------------------------------- parsing


@pytest.mark.parametrize("text, calls, rest", [
    ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>', [("f", {"a": 1})], ""),
    ('Sure.<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": "g", "arguments": '
     '{"b": "x"}}</tool_call>', [("f", {}), ("g", {"b": "x"})], "Sure."),
    ('[TOOL_CALLS][{"name": "f", "arguments": {"a": 2}}]', [("f", {"a": 2})], ""),
    ('{"name": "f", "parameters": {"a": 3}}', [("f", {"a": 3})], ""),  # Llama 3.1's JSON form
    ('{"name": "f", "arguments": "{\\"a\\": 4}"}', [("f", {"a": 4})], ""),  # arguments as a string
    ('{"name": "not_offered", "arguments": {}}', [], '{"name": "not_offered", "arguments": {}}'),
    ('{"answer": 42}', [], '{"answer": 42}'),  # JSON that is not a call stays text
    ("<tool_call>{broken</tool_call>", [], "<tool_call>{broken</tool_call>"),
    ("just text", [], "just text"),
    ('```json\n{"name": "f", "arguments": {"a": 1}}\n```', [("f", {"a": 1})], ""),  # the 1.5B's fence
    ('```\n[{"name": "f", "arguments": {}}, {"name": "g", "arguments": {}}]\n```', [("f", {}), ("g", {})], ""),
    ('To do it, use:\n\n```json\n{\n  "name": "f",\n  "arguments": {}\n}\n```', [("f", {})], "To do it, use:"),
    ("```python\nprint(1)\n```", [], "```python\nprint(1)\n```"),
])
def test_tool_call_formats_are_parsed_and_anything_else_stays_text(text, calls, rest):
    content, found = parse_tool_calls(text, ["f", "g"])
    assert [(c.name, c.arguments) for c in found] == calls
    assert content == rest


def test_the_stream_filter_releases_text_at_once_and_holds_back_calls():
    f = ToolStreamFilter(["f"])
    assert f.feed("Hello ") == "Hello "
    assert f.feed("there <tool") == "there "  # could be the start of a tag
    assert f.feed("_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>") == ""
    tail, calls = f.finish()
    assert tail == "" and [c.name for c in calls] == ["f"]

    g = ToolStreamFilter(["f"])
    assert g.feed("{") == "" and g.feed('"not": "a call"}') == ""
    assert g.finish() == ('{"not": "a call"}', [])  # released once it proved not to be a call
    assert ToolStreamFilter([]).feed("{") == "{"  # without tools nothing is held


@pytest.mark.parametrize("step", [1, 2, 5, 64])
def test_a_call_written_after_some_words_is_never_streamed_as_words(step):
    text = 'To lock it, use:\n\n```json\n{\n  "name": "f",\n  "arguments": {"a": 1}\n}\n```'
    f, out = ToolStreamFilter(["f"]), ""
    for i in range(0, len(text), step):
        out += f.feed(text[i:i + step])
    tail, calls = f.finish()
    assert out + tail == "To lock it, use:\n\n" and [(c.name, c.arguments) for c in calls] == [("f", {"a": 1})]
    code = "Run `ls` and {x} or ```python\nprint(1)\n``` <b>"
    g, out = ToolStreamFilter(["f"]), ""
    for i in range(0, len(code), step):
        out += g.feed(code[i:i + step])
    assert out + g.finish()[0] == code  # braces and fences that are not calls flow as text
