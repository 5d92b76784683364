"""Qwen3's and Llama 3.x's published templates behind the API, with the real clients.

The engine is scripted (it replies what a Qwen3 or Llama 3.x model writes,
token by token through a real byte-level tokenizer with the family's added
tokens), and everything else is what a served model goes through: the
template from ``tests/data/chat_templates/`` rendering each request, the
reasoning splitter, the tool-call parser. What the model was shown is read
back from the prompt the engine received.
"""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest

from decoding.loader.tokenizer import Tokenizer, TokenizerMeta
from tests.support.api import FakeEngine, ServerThread
from tests.support.clients import ollama_client, sdk
from tests.support.tiny_tokenizer import LLAMA3, QWEN3, write_tokenizer

TEMPLATES = Path(__file__).parents[1] / "data" / "chat_templates"
TOOLS = [{"type": "function", "function": {"name": "HassTurnOn", "description": "Turns on a device",
                                           "parameters": {"type": "object",
                                                          "properties": {"name": {"type": "string"}}}}}]
ASK = [{"role": "user", "content": "Turn on the kitchen light"}]


class TemplateEngine(FakeEngine):
    """Replies ``reply`` through ``tokenizer`` (one byte or one added token per step), then its end token."""

    def __init__(self, tokenizer: Tokenizer, reply: str):
        super().__init__(reply=reply, context_length=4096)  # a byte per token: prompts are long
        self.tokenizer = tokenizer

    async def token_ids(self, req):
        self.requests.append(req)
        for t in [*self.tokenizer.encode(self.reply, add_bos=False), self.tokenizer.eos_ids[0]]:
            yield t

    def prompt(self, index: int = -1) -> str:
        return self.tokenizer.decode(self.requests[index].prompt_ids, skip_special=False)


def _tokenizer(tmp_path: Path, template: str) -> Tokenizer:
    llama = template.startswith("llama")
    added = LLAMA3 if llama else QWEN3
    bos, eos = ("<|begin_of_text|>", "<|eot_id|>") if llama else (None, "<|im_end|>")
    ids = {t: 256 + i for i, (t, _) in enumerate(added)}
    path = write_tokenizer(tmp_path / template / "tokenizer.json", added)
    return Tokenizer(path, TokenizerMeta(chat_template=(TEMPLATES / f"{template}.jinja").read_text(),
                                         bos_id=ids.get(bos), eos_ids=(ids[eos],), add_bos=llama,
                                         bos_token=bos, eos_token=eos))


def _serve(tmp_path: Path, template: str, reply: str) -> ServerThread:
    return ServerThread(TemplateEngine(_tokenizer(tmp_path, template), reply))


@pytest.mark.parametrize("template", ["llama3.1", "llama3.2"])
def test_a_llama3_call_comes_back_as_a_tool_call_and_its_result_goes_in_as_ipython(tmp_path, template):
    with _serve(tmp_path, template, '{"name": "HassTurnOn", "parameters": {"name": "kitchen light"}}') as srv:
        c = sdk(srv)
        r = c.chat.completions.create(model="fake-model", messages=ASK, tools=TOOLS)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and not choice.message.content
        call = choice.message.tool_calls[0]
        assert (call.function.name, json.loads(call.function.arguments)) == ("HassTurnOn", {"name": "kitchen light"})
        assert "Environment: ipython" in srv.engine.prompt() and '"name": "HassTurnOn"' in srv.engine.prompt()

        srv.engine.reply = "The kitchen light is on."
        history = [*ASK, choice.message.model_dump(exclude_none=True),
                   {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"success": True})}]
        again = c.chat.completions.create(model="fake-model", messages=history, tools=TOOLS)
        assert again.choices[0].message.content == "The kitchen light is on."
        prompt = srv.engine.prompt()
        assert '{"name": "HassTurnOn", "parameters": {"name": "kitchen light"}}<|eot_id|>' in prompt
        assert "<|start_header_id|>ipython<|end_header_id|>\n\n" in prompt

        parts = list(ollama_client(srv).chat(model="fake-model", messages=ASK, tools=TOOLS, stream=True))
        assert "".join(p.message.content or "" for p in parts) == "The kitchen light is on."  # words stay words


def test_llama3_python_tag_call_parses(tmp_path):
    """Llama 3.1 may open its call with ``<|python_tag|>``: a special token, gone from the text."""
    with _serve(tmp_path, "llama3.1", '<|python_tag|>{"name": "HassTurnOn", "parameters": {"name": "hall"}}') as srv:
        parts = list(ollama_client(srv).chat(model="fake-model", messages=ASK, tools=TOOLS, stream=True))
        calls = [(tc.function.name, dict(tc.function.arguments)) for p in parts for tc in p.message.tool_calls or []]
        assert calls == [("HassTurnOn", {"name": "hall"})]
        assert "".join(p.message.content or "" for p in parts) == ""


def test_a_conversation_the_template_refuses_is_a_400_with_its_reason(tmp_path):
    """Llama 3.1 takes one call per assistant turn; the client is told so, not sent a 500."""
    two = {"role": "assistant", "content": "", "tool_calls": [
        {"id": f"call_{i}", "type": "function", "function": {"name": "HassTurnOn", "arguments": "{}"}}
        for i in range(2)]}
    with _serve(tmp_path, "llama3.1", "ok") as srv:
        with pytest.raises(openai.BadRequestError) as info:
            sdk(srv).chat.completions.create(model="fake-model", messages=[*ASK, two], tools=TOOLS)
        assert "only supports single tool-calls" in str(info.value)
        assert info.value.body["param"] == "messages"


def test_qwen3_thinks_calls_and_gets_its_reasoning_back_in_the_next_prompt(tmp_path):
    thought = "The user wants the kitchen light on."
    call = '<tool_call>\n{"name": "HassTurnOn", "arguments": {"name": "kitchen light"}}\n</tool_call>'
    with _serve(tmp_path, "qwen3", f"<think>\n{thought}\n</think>\n\n{call}") as srv:
        c = sdk(srv)
        chunks = list(c.chat.completions.create(model="fake-model", messages=ASK, tools=TOOLS, stream=True))
        deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
        assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == thought
        assert "".join(d.content or "" for d in deltas) == ""
        calls = [tc for d in deltas for tc in d.tool_calls or []]
        assert [tc.function.name for tc in calls] == ["HassTurnOn"]

        srv.engine.reply = "<think>\nIt worked.\n</think>\n\nThe kitchen light is on."
        history = [*ASK, {"role": "assistant", "content": None, "reasoning_content": thought,
                          "tool_calls": [{"id": calls[0].id, "type": "function", "function": {
                              "name": "HassTurnOn", "arguments": calls[0].function.arguments}}]},
                   {"role": "tool", "tool_call_id": calls[0].id, "content": json.dumps({"success": True})}]
        r = c.chat.completions.create(model="fake-model", messages=history, tools=TOOLS)
        assert (r.choices[0].message.reasoning_content, r.choices[0].message.content) == (
            "It worked.", "The kitchen light is on.")
        # The turn in progress keeps its reasoning (Qwen3's template drops it only before the last question).
        assert f"<|im_start|>assistant\n<think>\n{thought}\n</think>\n\n<tool_call>" in srv.engine.prompt()
        assert srv.engine.prompt().endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n")

        r = ollama_client(srv).chat(model="fake-model", messages=ASK, stream=False, think=False)
        assert srv.engine.prompt().endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_qwen3_thinking_2507_starts_inside_the_block_its_prompt_opened(tmp_path):
    with _serve(tmp_path, "qwen3-thinking-2507", "Just greet back.\n</think>\n\nHello!") as srv:
        r = ollama_client(srv).chat(model="fake-model", messages=[{"role": "user", "content": "hi"}], stream=False)
        assert (r.message.thinking, r.message.content) == ("Just greet back.", "Hello!")
        assert srv.engine.prompt().endswith("<|im_start|>assistant\n<think>\n")


def test_qwen3_instruct_2507_does_not_think(tmp_path):
    with _serve(tmp_path, "qwen3-instruct-2507", "Hello!") as srv:
        r = ollama_client(srv).chat(model="fake-model", messages=[{"role": "user", "content": "hi"}], stream=False)
        assert (r.message.thinking, r.message.content) == (None, "Hello!")
        assert "thinking" not in ollama_client(srv).show("fake-model").capabilities
