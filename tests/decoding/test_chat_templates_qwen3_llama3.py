"""Qwen3's and Llama 3.x's chat templates render, byte for byte and token for token, as transformers does.

The templates are the published ones as their GGUF files carry them
(``tokenizer.chat_template``), kept in ``tests/data/chat_templates/``. They were
written into the repository from the models' ``tokenizer_config.json`` as
remembered (nothing may be downloaded here); whatever a published revision
differs in, the property tested holds for any template: meshd's renderer
(:mod:`decoding.loader.chat_template`) gives what ``apply_chat_template`` gives.

Each family renders: a plain chat, the same with tools, an assistant's tool
call, the tool's result, and for Qwen3 an assistant turn that reasoned (its
``reasoning_content``, Ollama's ``thinking``, or ``<think>`` left in the
content), with thinking switched off, and the Thinking-2507 prompt that opens
the think block itself. The vocabulary is a tiny byte-level one with each
family's added tokens (``tests/support/tiny_tokenizer.py``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerFast

from decoding.loader.chat_template import ChatTemplateError
from decoding.loader.tokenizer import Tokenizer, TokenizerMeta
from tests.support.tiny_tokenizer import LLAMA3, QWEN3, write_tokenizer

TEMPLATES = Path(__file__).parents[1] / "data" / "chat_templates"
FAMILIES = {  # template file -> (added tokens, bos, eos, add_bos as the GGUF says)
    "qwen3": (QWEN3, None, "<|im_end|>", False),
    "qwen3-instruct-2507": (QWEN3, None, "<|im_end|>", False),
    "qwen3-thinking-2507": (QWEN3, None, "<|im_end|>", False),
    "llama3.1": (LLAMA3, "<|begin_of_text|>", "<|eot_id|>", True),
    "llama3.2": (LLAMA3, "<|begin_of_text|>", "<|eot_id|>", True),
}

TOOLS = [{"type": "function", "function": {
    "name": "HassTurnOn", "description": "Turns on/opens/presses a device or entity",
    "parameters": {"type": "object", "properties": {"name": {"type": "string"}, "area": {"type": "string"},
                                                    "domain": {"type": "array", "items": {"type": "string"}}},
                   "required": []}}}]
SYSTEM = "You are a voice assistant for Home Assistant.\n- names: Kitchen Ceiling Light ÄÖ\n  domain: light\n"
ASK = {"role": "user", "content": "Turn on the Kitchen Ceiling Light ÄÖ"}
CALL = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "id": "call_1", "function": {
    "name": "HassTurnOn", "arguments": {"name": "Kitchen Ceiling Light ÄÖ", "domain": ["light"]}}}]}
RESULT = {"role": "tool", "tool_call_id": "call_1", "content": json.dumps({"success": [{"name": "Kitchen"}]})}
DONE = {"role": "assistant", "content": "The Kitchen Ceiling Light ÄÖ is on."}
AGAIN = {"role": "user", "content": "And off again?"}

CONVERSATIONS = {  # name -> (messages, tools)
    "plain chat": ([{"role": "system", "content": SYSTEM}, ASK], None),
    "with tools": ([{"role": "system", "content": SYSTEM}, ASK], TOOLS),
    "an assistant's call": ([{"role": "system", "content": SYSTEM}, ASK, CALL], TOOLS),
    "the tool's result": ([{"role": "system", "content": SYSTEM}, ASK, CALL, RESULT], TOOLS),
    "the whole exchange": ([{"role": "system", "content": SYSTEM}, ASK, CALL, RESULT, DONE, AGAIN], TOOLS),
}
THOUGHT = "The user wants the light on.\nHassTurnOn takes a name."
REASONED = {  # Qwen3 only: an assistant turn that reasoned, under each name it arrives with
    "reasoning_content after the last question": (
        [ASK, {**CALL, "reasoning_content": THOUGHT}, RESULT], TOOLS),
    "thinking (Ollama's name)": ([ASK, {**CALL, "thinking": THOUGHT}, RESULT], TOOLS),
    "<think> left in the content": ([ASK, {"role": "assistant", "content": f"<think>\n{THOUGHT}\n</think>\n\nOn."}],
                                    None),
    "reasoning before the last question is dropped": (
        [ASK, {**DONE, "reasoning_content": THOUGHT}, AGAIN], None),
    "the answer that reasoned is the last turn": ([ASK, {**DONE, "reasoning_content": THOUGHT}], None),
}


def _pair(tmp_path: Path, family: str) -> tuple[Tokenizer, PreTrainedTokenizerFast]:
    added, bos, eos, add_bos = FAMILIES[family]
    path = write_tokenizer(tmp_path / family / "tokenizer.json", added)
    template = (TEMPLATES / f"{family}.jinja").read_text()
    ids = {t: 256 + i for i, (t, _) in enumerate(added)}
    ours = Tokenizer(path, TokenizerMeta(chat_template=template, bos_id=ids.get(bos), eos_ids=(ids[eos],),
                                         add_bos=add_bos, bos_token=bos, eos_token=eos))
    ref = PreTrainedTokenizerFast(tokenizer_file=str(path), bos_token=bos, eos_token=eos)
    ref.chat_template = template
    return ours, ref


def _same(ours: Tokenizer, ref: PreTrainedTokenizerFast, messages, tools, generation_prompt=True, **variables):
    text = ours.render_chat(messages, add_generation_prompt=generation_prompt, tools=tools, **variables)
    expected = ref.apply_chat_template(messages, tools=tools, tokenize=False,
                                       add_generation_prompt=generation_prompt, **variables)
    assert text == expected
    ids = ref.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=False,
                                  add_generation_prompt=generation_prompt, **variables)
    assert ours.apply_chat(messages, add_generation_prompt=generation_prompt, tools=tools, **variables) == list(ids)
    return text


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
def test_each_conversation_renders_as_transformers_does(tmp_path, family, conversation):
    ours, ref = _pair(tmp_path, family)
    messages, tools = CONVERSATIONS[conversation]
    text = _same(ours, ref, messages, tools)
    assert "Kitchen Ceiling Light ÄÖ" in text  # non-ASCII untouched, as the home spells it
    if tools:
        assert '"HassTurnOn"' in text


@pytest.mark.parametrize("family", ["qwen3", "qwen3-thinking-2507"])
@pytest.mark.parametrize("conversation", list(REASONED))
def test_qwen3_renders_an_assistant_turn_that_reasoned_as_transformers_does(tmp_path, family, conversation):
    ours, ref = _pair(tmp_path, family)
    messages, tools = REASONED[conversation]
    last = messages[-1]["role"] == "assistant"
    text = _same(ours, ref, messages, tools, generation_prompt=not last)
    if "dropped" in conversation:
        assert THOUGHT not in text  # Qwen3 keeps only the reasoning of the turn in progress
    else:
        assert f"<think>\n{THOUGHT}\n</think>\n\n" in text


def test_qwen3_with_thinking_off_opens_and_closes_an_empty_think_block(tmp_path):
    ours, ref = _pair(tmp_path, "qwen3")
    text = _same(ours, ref, [ASK], None, enable_thinking=False)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert _same(ours, ref, [ASK], None, enable_thinking=True).endswith("<|im_start|>assistant\n")


def test_the_2507_variants_instruct_has_no_think_block_and_thinking_opens_it(tmp_path):
    inst, ref = _pair(tmp_path, "qwen3-instruct-2507")
    assert "<think>" not in _same(inst, ref, [ASK, {**DONE, "reasoning_content": THOUGHT}, AGAIN], None)
    thinking, ref = _pair(tmp_path, "qwen3-thinking-2507")
    assert _same(thinking, ref, [ASK], None).endswith("<|im_start|>assistant\n<think>\n")


def test_llama3_renders_calls_as_json_with_parameters_and_results_in_the_ipython_role(tmp_path):
    ours, _ = _pair(tmp_path, "llama3.1")
    messages, tools = CONVERSATIONS["the tool's result"]
    text = ours.render_chat(messages, tools=tools)
    assert text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n")
    assert ('{"name": "HassTurnOn", "parameters": {"name": "Kitchen Ceiling Light ÄÖ", "domain": ["light"]}}'
            "<|eot_id|>") in text
    assert "<|start_header_id|>ipython<|end_header_id|>\n\n" in text


def test_llama32_prints_todays_date_as_transformers_does(tmp_path):
    """Llama 3.2's template calls ``strftime_now``: without it the prompt would say 26 Jul 2024."""
    ours, ref = _pair(tmp_path, "llama3.2")
    text = _same(ours, ref, [ASK], None)
    assert "26 Jul 2024" not in text
    assert "Today Date: 26 Jul 2024" in ours.render_chat([ASK], date_string="26 Jul 2024")


def test_a_conversation_the_template_refuses_is_a_clear_error(tmp_path):
    """Llama 3.1 takes one call per assistant turn; its ``raise_exception`` names why."""
    ours, _ = _pair(tmp_path, "llama3.1")
    two = {**CALL, "tool_calls": CALL["tool_calls"] * 2}
    with pytest.raises(ChatTemplateError, match="only supports single tool-calls"):
        ours.render_chat([ASK, two, RESULT], tools=TOOLS)


def test_transformers_template_extensions_render(tmp_path):
    """``{% generation %}``, ``{% break %}``, ``dict`` and ``namespace`` work as in transformers."""
    ours, ref = _pair(tmp_path, "qwen3")
    template = ("{% set ns = namespace(n=0) %}{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
                "{% generation %}{{ m.content }}{% endgeneration %}{% set ns.n = ns.n + 1 %}{% endfor %}"
                "{{ dict(a=ns.n) | tojson }}")
    ours.meta.chat_template = template
    ref.chat_template = template
    _same(Tokenizer(ours.path, ours.meta), ref, [ASK, AGAIN], None)


def _write_gguf(path: Path, arch: str, family: str) -> Path:
    """A GGUF holding only what the tokenizer needs (and an embedding and a norm, so it opens)."""
    import gguf
    import numpy as np

    from tests.support.tiny_tokenizer import byte_pieces

    added, bos, eos, add_bos = FAMILIES[family]
    tokens = [*byte_pieces(), "Ġt", *(t for t, _ in added)]  # one merge, so the file lists merges
    types = [1] * 257 + [3 if special else 4 for _, special in added]  # CONTROL, USER_DEFINED
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in (("block_count", 1), ("embedding_length", 8), ("feed_forward_length", 16),
                       ("attention.head_count", 2), ("attention.head_count_kv", 1), ("context_length", 64)):
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("llama-bpe" if arch == "llama" else "qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(["Ġ t"])
    w.add_eos_token_id(tokens.index(eos))
    if bos:
        w.add_bos_token_id(tokens.index(bos))
    w.add_add_bos_token(add_bos)
    w.add_chat_template((TEMPLATES / f"{family}.jinja").read_text())
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), np.float32))
    w.add_tensor("output_norm.weight", np.ones(8, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("arch, family", [("llama", "llama3.2"), ("qwen3", "qwen3")])
def test_the_template_and_tags_a_gguf_carries_reach_the_renderer_intact(tmp_path, arch, family):
    """The path a served model takes: the GGUF's ``tokenizer.chat_template`` and its vocabulary, converted as
    meshd converts it. ``<think>`` (user-defined in the file) stays in decoded text for the reasoning
    splitter; Llama's ``<|python_tag|>`` (control) is dropped from it."""
    from decoding import models
    from decoding.loader import open_model

    if arch not in models.SUPPORTED_ARCHS:
        pytest.skip(f"architecture {arch!r} is not registered in decoding.models yet")
    source = open_model(_write_gguf(tmp_path / "m.gguf", arch, family), cache_dir=tmp_path / "cache")
    tok = source.tokenizer
    assert tok.meta.chat_template == (TEMPLATES / f"{family}.jinja").read_text()
    ref = PreTrainedTokenizerFast(tokenizer_file=str(tok.path), bos_token=tok.meta.bos_token,
                                  eos_token=tok.meta.eos_token)
    ref.chat_template = tok.meta.chat_template
    messages, tools = CONVERSATIONS["the whole exchange"]
    _same(tok, ref, messages, tools)
    if arch == "qwen3":
        text = "<think>\nhm\n</think>\n\n<tool_call>"
        assert tok.decode(tok.encode(text, add_bos=False)) == text
        assert tok.supports_thinking
    else:
        assert tok.decode(tok.encode("<|python_tag|>{}", add_bos=False)) == "{}"
        assert not tok.supports_thinking
