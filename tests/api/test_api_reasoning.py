"""A thinking model's reasoning reaches clients as reasoning, never as the spoken answer.

The ``openai`` SDK and the ``ollama`` client talk to the API over its socket;
the engine answers as Qwen3 does (``<think>…</think>`` and then the answer),
one character per token, so every tag arrives split across pieces. OpenAI
clients get the reasoning in ``message.reasoning_content`` (``delta`` when
streaming), Ollama clients in ``message.thinking``; ``content`` holds only
what the model says. Ollama's ``think`` switches the template's
``enable_thinking``, and reasoning a client sends back in its history reaches
the template.
"""

from __future__ import annotations

import json

import ollama
import openai
import pytest

from tests.support.api import FakeEngine, ServerThread, ToolTokenizer
from tests.support.clients import ollama_client, sdk

THOUGHT = "The user greets me.\nI should greet back."
SPOKEN = "Hello! How can I help?"
QWEN3_REPLY = f"<think>\n{THOUGHT}\n</think>\n\n{SPOKEN}"
ASK = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "HassTurnOn", "description": "Turns on a device",
                                           "parameters": {"type": "object",
                                                          "properties": {"name": {"type": "string"}}}}}]


class ThinkingTokenizer(ToolTokenizer):
    """A Qwen3-like template: tools, ``enable_thinking``, and a prompt that may open the think block."""

    supports_thinking = True

    def __init__(self, opens: bool = False):
        super().__init__()
        self.opens = opens  # Thinking-2507: the prompt ends with "<think>\n"
        self.variables: list[dict] = []
        self.messages: list[list[dict]] = []

    def apply_chat(self, messages, tools=None, **variables):
        self.variables.append(variables)
        self.messages.append(messages)
        ids = super().apply_chat(messages, tools)
        if variables.get("enable_thinking") is False:
            return ids + self.encode("<think>\n\n</think>\n\n")
        return ids + self.encode("<think>\n") if self.opens else ids

    def decode(self, ids, skip_special: bool = True) -> str:
        return super().decode(ids)


def _server(reply: str, opens: bool = False) -> ServerThread:
    engine = FakeEngine(reply=reply)
    engine.tokenizer = ThinkingTokenizer(opens)
    return ServerThread(engine)


@pytest.fixture
def qwen3():
    with _server(QWEN3_REPLY) as srv:
        yield srv


def test_openai_reasoning_comes_in_reasoning_content_and_the_answer_in_content(qwen3):
    message = sdk(qwen3).chat.completions.create(model="fake-model", messages=ASK).choices[0].message
    assert message.content == SPOKEN
    assert message.reasoning_content == THOUGHT


def test_openai_streamed_reasoning_arrives_as_reasoning_deltas_before_the_answer(qwen3):
    chunks = list(sdk(qwen3).chat.completions.create(model="fake-model", messages=ASK, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    thought = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    spoken = "".join(d.content or "" for d in deltas)
    assert (thought, spoken) == (THOUGHT, SPOKEN)
    assert len([d for d in deltas if getattr(d, "reasoning_content", None)]) > 1  # streamed, not held to the end
    first_spoken = next(i for i, d in enumerate(deltas) if d.content)
    assert not any(getattr(d, "reasoning_content", None) for d in deltas[first_spoken:])
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_ollama_reasoning_comes_in_thinking_and_the_answer_in_content(qwen3, stream):
    c = ollama_client(qwen3)
    if stream:
        parts = list(c.chat(model="fake-model", messages=ASK, stream=True))
        thinking = "".join(p.message.thinking or "" for p in parts)
        content = "".join(p.message.content or "" for p in parts)
        assert parts[-1].done
    else:
        r = c.chat(model="fake-model", messages=ASK, stream=False)
        thinking, content = r.message.thinking, r.message.content
    assert (thinking, content) == (THOUGHT, SPOKEN)


def test_ollama_generate_splits_reasoning_too(qwen3):
    r = ollama_client(qwen3).generate(model="fake-model", prompt="hi", stream=False)
    assert (r.thinking, r.response) == (THOUGHT, SPOKEN)


def test_ollama_think_switches_the_templates_enable_thinking(qwen3):
    c = ollama_client(qwen3)
    tok = qwen3.engine.tokenizer
    for think, expected in ((None, {}), (True, {"enable_thinking": True}), (False, {"enable_thinking": False})):
        c.chat(model="fake-model", messages=ASK, stream=False, think=think)
        assert tok.variables[-1] == expected
    with pytest.raises(ollama.ResponseError) as info:
        c.chat(model="fake-model", messages=ASK, stream=False, think="high")
    assert info.value.status_code == 400 and "think" in info.value.error


def test_a_prompt_that_opened_the_think_block_splits_from_the_first_token():
    """Qwen3 Thinking-2507: the template writes ``<think>\\n``; the model starts inside the block."""
    with _server(f"{THOUGHT}\n</think>\n\n{SPOKEN}", opens=True) as srv:
        message = sdk(srv).chat.completions.create(model="fake-model", messages=ASK).choices[0].message
        assert (message.reasoning_content, message.content) == (THOUGHT, SPOKEN)
        r = ollama_client(srv).chat(model="fake-model", messages=ASK, stream=False, think=False)
        assert srv.engine.tokenizer.variables[-1] == {"enable_thinking": False}
        assert r.message.content == f"{THOUGHT}\n</think>\n\n{SPOKEN}"  # the prompt closed the block itself


def test_a_call_after_reasoning_is_a_tool_call_and_the_reasoning_stays_reasoning():
    call = '<tool_call>\n{"name": "HassTurnOn", "arguments": {"name": "kitchen light"}}\n</tool_call>'
    with _server(f"<think>\nThe light is called kitchen light.\n</think>\n\n{call}") as srv:
        for stream in (False, True):
            r = sdk(srv).chat.completions.create(model="fake-model", messages=ASK, tools=TOOLS, stream=stream)
            if stream:
                deltas = [c.choices[0].delta for c in r if c.choices]
                thought = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
                spoken = "".join(d.content or "" for d in deltas)
                calls = [tc.function for d in deltas for tc in d.tool_calls or []]
            else:
                m = r.choices[0].message
                thought, spoken, calls = m.reasoning_content, m.content or "", [tc.function for tc in m.tool_calls]
            assert thought == "The light is called kitchen light." and spoken == ""
            assert [(f.name, json.loads(f.arguments)) for f in calls] == [("HassTurnOn", {"name": "kitchen light"})]
        parts = list(ollama_client(srv).chat(model="fake-model", messages=ASK, tools=TOOLS, stream=True))
        assert "".join(p.message.thinking or "" for p in parts) == "The light is called kitchen light."
        assert [tc.function.name for p in parts for tc in p.message.tool_calls or []] == ["HassTurnOn"]
        assert "".join(p.message.content or "" for p in parts) == ""


def test_reasoning_sent_back_in_the_history_reaches_the_template(qwen3):
    """What the SDK hands back (``model_dump``) carries ``reasoning_content``; Ollama's is ``thinking``."""
    c = sdk(qwen3)
    first = c.chat.completions.create(model="fake-model", messages=ASK).choices[0].message
    history = [*ASK, first.model_dump(exclude_none=True), {"role": "user", "content": "thanks"}]
    c.chat.completions.create(model="fake-model", messages=history)
    assert qwen3.engine.tokenizer.messages[-1][1] == {"role": "assistant", "content": SPOKEN,
                                                     "reasoning_content": THOUGHT}
    ollama_client(qwen3).chat(model="fake-model", stream=False, messages=[
        *ASK, {"role": "assistant", "content": SPOKEN, "thinking": THOUGHT}, {"role": "user", "content": "thanks"}])
    assert qwen3.engine.tokenizer.messages[-1][1]["reasoning_content"] == THOUGHT


def test_a_model_that_does_not_think_keeps_its_text_as_it_is(srv):
    """No think block in the template: nothing is split (a ``<think>`` there is just text)."""
    srv.engine.reply = QWEN3_REPLY
    message = sdk(srv).chat.completions.create(model="fake-model", messages=ASK).choices[0].message
    assert message.content == QWEN3_REPLY and getattr(message, "reasoning_content", None) is None


@pytest.mark.parametrize("opens, expected", [(False, "start"), (True, "inside")])
def test_offered_tools_tell_the_grammar_that_the_model_thinks_first(opens, expected):
    """The grammar leaves the think block free (``decoding.tool_constraint``): the spec says it may come."""
    from meshd.api.generation import chat_prompt, constrain_tool_calls
    from meshd.engine.options import Capabilities, RequestOptions

    engine = FakeEngine()
    engine.tokenizer = ThinkingTokenizer(opens)
    engine.capabilities = Capabilities(constraints=True)
    prompt = chat_prompt(engine, ASK, TOOLS)
    options = constrain_tool_calls(engine, RequestOptions(), TOOLS, prompt_ids=prompt)
    assert options.sampling.constraint["reasoning"] == expected
    plain = FakeEngine()
    plain.tokenizer, plain.capabilities = ToolTokenizer(), Capabilities(constraints=True)
    options = constrain_tool_calls(plain, RequestOptions(), TOOLS, prompt_ids=chat_prompt(plain, ASK, TOOLS))
    assert "reasoning" not in options.sampling.constraint


def test_openai_chat_template_kwargs_switch_thinking_as_vllm_does(qwen3):
    c = sdk(qwen3)
    c.chat.completions.create(model="fake-model", messages=ASK, extra_body={"chat_template_kwargs": {
        "enable_thinking": False}})
    assert qwen3.engine.tokenizer.variables[-1] == {"enable_thinking": False}
    c.chat.completions.create(model="fake-model", messages=ASK)
    assert qwen3.engine.tokenizer.variables[-1] == {}
    for bad in ({"enable_thinking": "no"}, {"add_generation_prompt": False}, ["enable_thinking"]):
        with pytest.raises(openai.BadRequestError) as info:
            c.chat.completions.create(model="fake-model", messages=ASK, extra_body={"chat_template_kwargs": bad})
        assert "chat_template_kwargs" in str(info.value)


def test_ollama_show_lists_thinking_among_the_capabilities(qwen3, srv):
    assert "thinking" in ollama_client(qwen3).show("fake-model").capabilities
    assert "thinking" not in (ollama_client(srv).show("fake-model").capabilities or [])
