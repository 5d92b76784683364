"""The tool grammar speaks Llama 3.x's call format and lets Qwen3 think before it calls.

Llama 3.x calls as ``{"name": ..., "parameters": {...}}``, bare or after its
``<|python_tag|>`` token; Qwen3 calls as Qwen 2.5 does (``<tool_call>``) but
may first reason in ``<think>…</think>``, where nothing is masked and a tag it
mentions starts no call. The vocabularies are tiny byte-level ones with each
family's added tokens, which the grammar engine sees as special tokens, as it
does the real ones.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from decoding.constrained import ConstraintViolated, make_constraint
from decoding.loader.tokenizer import Tokenizer, TokenizerMeta
from decoding.tool_grammar import style_of, tool_spec
from meshd.api.tools import ToolStreamFilter, parse_tool_calls
from tests.support.tiny_tokenizer import LLAMA3, QWEN3, write_tokenizer

TEMPLATES = Path(__file__).parents[1] / "data" / "chat_templates"
TOOLS = [{"type": "function", "function": {"name": "HassTurnOn", "parameters": {
    "type": "object", "properties": {"name": {"type": "string"}}}}}]
QWEN_CALL = '<tool_call>\n{"name": "HassTurnOn", "arguments": {"name": "kitchen"}}\n</tool_call>'
LLAMA_CALL = '{"name": "HassTurnOn", "parameters": {"name": "kitchen"}}'


def _tokenizer(tmp_path: Path, family: str) -> Tokenizer:
    added, eos, template = {"qwen3": (QWEN3, "<|im_end|>", "qwen3"),
                            "llama3": (LLAMA3, "<|eot_id|>", "llama3.1")}[family]
    path = write_tokenizer(tmp_path / family / "tokenizer.json", added)
    eos_id = 256 + [t for t, _ in added].index(eos)
    return Tokenizer(path, TokenizerMeta(chat_template=(TEMPLATES / f"{template}.jinja").read_text(), bos_id=None,
                                         eos_ids=(eos_id,), add_bos=False, eos_token=eos))


def _constraint(tok: Tokenizer, style: str, required: bool = False, reasoning: str | None = None):
    spec = tool_spec(TOOLS, style, required=required, parallel=True, reasoning=reasoning)
    return make_constraint(spec, tok.path, tok.vocab_size, tuple(tok.eos_ids))


def _write(c, tok: Tokenizer, text: str) -> None:
    """Each token of ``text`` must be allowed where it comes; then it is taken."""
    for t in tok.encode(text, add_bos=False):
        assert c.allowed_mask()[t], f"{tok.decode([t], skip_special=False)!r} refused in {text!r}"
        c.advance(t)


def test_each_published_template_names_its_call_style():
    styles = {f.stem: style_of(f.read_text()) for f in TEMPLATES.glob("*.jinja")}
    assert styles == {"qwen3": "hermes", "qwen3-instruct-2507": "hermes", "qwen3-thinking-2507": "hermes",
                      "llama3.1": "llama3", "llama3.2": "llama3"}


@pytest.mark.parametrize("text, phase", [
    (LLAMA_CALL, "call"),
    ("<|python_tag|>" + LLAMA_CALL, "call"),
    ('[{"name": "HassTurnOn", "parameters": {}}]', "call"),
    ("The kitchen light is on.", "text"),
    ("Sure, turning it on.\n<|python_tag|>" + LLAMA_CALL, "call"),
])
def test_llama3_calls_are_held_to_its_json_form_and_text_stays_free(tmp_path, text, phase):
    tok = _tokenizer(tmp_path, "llama3")
    c = _constraint(tok, "llama3")
    _write(c, tok, text)
    assert c.phase == phase and c.is_accepting()


def test_llama3_calls_name_their_arguments_parameters(tmp_path):
    tok = _tokenizer(tmp_path, "llama3")
    c = _constraint(tok, "llama3", required=True)
    with pytest.raises(ConstraintViolated):
        for t in tok.encode('{"name": "HassTurnOn", "arguments": {}}', add_bos=False):
            c.advance(t)


def test_qwen3_thinks_unmasked_then_calls_under_the_grammar(tmp_path):
    tok = _tokenizer(tmp_path, "qwen3")
    for required in (False, True):
        c = _constraint(tok, "hermes", required=required, reasoning="start")
        _write(c, tok, "<think>\nThe user wants {{ odd }} text and mentions <tool_call> here.\n</think>")
        assert c.phase == ("call" if required else "start")  # the grammar starts over after the block
        _write(c, tok, "\n\n" + QWEN_CALL)
        assert c.phase == "call" and c.is_accepting()


def test_qwen3_may_answer_in_words_after_thinking_unless_a_call_is_required(tmp_path):
    tok = _tokenizer(tmp_path, "qwen3")
    c = _constraint(tok, "hermes", reasoning="start")
    _write(c, tok, "<think>\nNo tool needed.\n</think>\n\nHello there.")
    assert c.phase == "text"
    required = _constraint(tok, "hermes", required=True, reasoning="start")
    _write(required, tok, "<think>\nok\n</think>\n\n")
    assert not required.allowed_mask()[tok.encode("H", add_bos=False)[0]]


def test_a_prompt_that_opened_the_block_starts_the_answer_inside_it(tmp_path):
    tok = _tokenizer(tmp_path, "qwen3")
    c = _constraint(tok, "hermes", required=True, reasoning="inside")
    assert c.phase == "think"
    logits = torch.randn(tok.vocab_size)
    assert c.apply(logits) is logits  # nothing masked while the model thinks
    _write(c, tok, "The user wants the kitchen light.\n</think>\n\n" + QWEN_CALL)
    assert c.phase == "call" and c.is_accepting()


def test_without_reasoning_in_the_spec_a_think_block_cannot_open(tmp_path):
    """Why the API says when a model thinks: the grammar engine sees ``<think>`` as a special token."""
    tok = _tokenizer(tmp_path, "qwen3")
    think = tok.encode("<think>", add_bos=False)
    assert len(think) == 1
    assert not _constraint(tok, "hermes").allowed_mask()[think[0]]
    assert _constraint(tok, "hermes", reasoning="start").allowed_mask()[think[0]]


def test_rollback_replays_the_think_block(tmp_path):
    tok = _tokenizer(tmp_path, "qwen3")
    c = _constraint(tok, "hermes", reasoning="start")
    ids = tok.encode("<think>\nhmm\n</think>\n\n<tool_call>", add_bos=False)
    for t in ids:
        c.advance(t)
    assert c.phase == "call"
    c.rollback(len(ids) - 2)
    assert c.phase == "think"
    c.rollback(2)
    assert c.phase == "start"


def test_llama3_calls_parse_with_or_without_the_python_tag():
    for text in (LLAMA_CALL, "<|python_tag|>" + LLAMA_CALL, " " + LLAMA_CALL + "\n"):
        content, calls = parse_tool_calls(text, ["HassTurnOn"])
        assert content == "" and [(c.name, c.arguments) for c in calls] == [("HassTurnOn", {"name": "kitchen"})]
    f = ToolStreamFilter(["HassTurnOn"])
    assert "".join(f.feed(ch) for ch in "<|python_tag|>" + LLAMA_CALL) == ""
    assert [c.name for c in f.finish()[1]] == ["HassTurnOn"]
