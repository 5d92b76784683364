"""Each shipped model's chat template renders a Home Assistant conversation as transformers does.

Our renderer (a sandboxed Jinja environment with transformers' ``tojson``) must
produce, byte for byte, what ``apply_chat_template`` produces from the same
template: the tool list, an assistant turn with calls, tool results, and names
with capitals and spaces exactly as the home spells them. The
Qwen2.5-Coder-1.5B GGUF carries a defect (its call format shown with doubled
braces, which the model copies); the loader repairs it to the text its authors
wrote, which is the 0.5B's template.
"""

from __future__ import annotations

import json

import pytest
from transformers import PreTrainedTokenizerFast

from decoding.loader.tokenizer import repair_template
from tests.support.local_engines import TOOL_MODEL

TOOLS = [{"type": "function", "function": {
    "name": "HassTurnOn", "description": "Turns on/opens/presses a device or entity",
    "parameters": {"type": "object", "properties": {"name": {"type": "string"}, "area": {"type": "string"},
                                                    "domain": {"type": "array", "items": {"type": "string"}}},
                   "required": []}}}]
SYSTEM = ("You are a voice assistant for Home Assistant.\nStatic Context:\n- names: Kitchen Ceiling Light\n"
          "  domain: light\n  areas: Kitchen\n- names: Bedroom TV ÄÖ\n  domain: media_player\n")
CONVERSATION = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "Turn on the Kitchen Ceiling Light"},
    {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
        "name": "HassTurnOn", "arguments": {"name": "Kitchen Ceiling Light", "domain": ["light"]}}}]},
    {"role": "tool", "content": json.dumps({"success": [{"name": "Kitchen Ceiling Light"}]})},
    {"role": "assistant", "content": "The Kitchen Ceiling Light is on."},
    {"role": "user", "content": "And the Bedroom TV ÄÖ?"},
]


def _reference(tok, messages, tools=None) -> str:
    hf = PreTrainedTokenizerFast(tokenizer_file=str(tok.path), bos_token=tok.meta.bos_token,
                                 eos_token=tok.meta.eos_token)
    return hf.apply_chat_template(messages, tools=tools, chat_template=tok.meta.chat_template, tokenize=False,
                                  add_generation_prompt=True)


def test_the_embedded_model_renders_a_conversation_as_transformers_does(real_source):
    tok = real_source.tokenizer
    plain = [m for m in CONVERSATION if m["role"] in ("system", "user")]
    assert tok.render_chat(plain) == _reference(tok, plain)


def _tool_model_tokenizer():
    """The tool model's tokenizer only (its weights are not loaded), or skip with the reason."""
    from meshd.model.store import ModelNotAvailable, is_named_pulled, open_model, pull_named

    try:
        if not is_named_pulled(TOOL_MODEL):
            pull_named(TOOL_MODEL, quiet=True)
        return open_model(TOOL_MODEL).tokenizer
    except ModelNotAvailable as exc:
        pytest.skip(f"{TOOL_MODEL} is not cached and cannot be fetched: {exc}")


@pytest.mark.slow
def test_the_tool_model_renders_tools_calls_and_results_as_transformers_does():
    tok = _tool_model_tokenizer()
    ours = tok.render_chat(CONVERSATION, tools=TOOLS)
    assert ours == _reference(tok, CONVERSATION, TOOLS)
    assert "Kitchen Ceiling Light" in ours and "ÄÖ" in ours  # names and non-ASCII untouched
    assert '{"name": <function-name>, "arguments": <args-json-object>}' in ours


def test_the_doubled_brace_defect_is_repaired_to_the_authors_text():
    bad = ('{{- "...<tool_call>\\n{{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}}\\n'
           '</tool_call><|im_end|>\\n" }}')
    good = ('{{- "...<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n'
            '</tool_call><|im_end|>\\n" }}')
    assert repair_template(bad) == good
    assert repair_template(good) == good and repair_template(None) is None


def test_the_pulled_1_5b_template_is_the_0_5b_one_once_repaired():
    from meshd.model.store import is_named_pulled, open_model

    if not (is_named_pulled("qwen2.5-coder-1.5b-instruct") and is_named_pulled(TOOL_MODEL)):
        pytest.skip("needs both Qwen2.5-Coder models pulled (meshd model pull NAME)")
    big = open_model("qwen2.5-coder-1.5b-instruct").tokenizer.meta.chat_template
    assert big == open_model(TOOL_MODEL).tokenizer.meta.chat_template


@pytest.mark.parametrize("model", ["embedded", pytest.param("tool", marks=pytest.mark.slow)])
def test_each_request_of_a_conversation_renders_as_a_token_prefix_of_the_next(model, real_source):
    """What the prefix cache relies on: Home Assistant's request after a tool result or a new user
    turn starts with the previous request's tokens, so it reuses all of them (docs/prefix-cache.md)."""
    tok = real_source.tokenizer if model == "embedded" else _tool_model_tokenizer()
    tools = TOOLS if model == "tool" else None
    sends = [i + 1 for i, m in enumerate(CONVERSATION) if m["role"] in ("user", "tool")]
    prompts = [tok.apply_chat(CONVERSATION[:i], tools=tools) for i in sends]
    for before, after in zip(prompts, prompts[1:]):
        assert after[:len(before)] == before
