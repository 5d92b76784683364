"""Tool calls that always parse: a lazy grammar over the answer, built from the offered tools.

When a request offers tools, the model may answer in words or call tools. Left
alone, small models write calls the client cannot use: a tool that was not
offered, arguments that are not JSON, the call format copied with doubled
braces, a call wrapped in a Markdown fence. Here the answer is free text until
it *starts* a call, and from there on a grammar built from the offered tools
decides every token: the name is one of theirs, the arguments validate against
that tool's JSON schema, the call is closed the way the model's template
closes it. This is what llama.cpp's server calls a lazy grammar; ours has two
ways in:

* **at the start of the answer** the grammar is on from the first token, as the
  union "a call in any form this model family writes | text that does not
  start like a call". A token that would begin a malformed call (``{{``, a
  fence around something else) is masked; a token that begins ordinary text
  turns the grammar off for good (nothing is masked while the model talks);
* **mid-answer**, text that reaches the template's call tag (``<tool_call>``)
  turns the grammar on again for the rest of the answer.

``tool_choice: required`` (or a named tool) is the same grammar without the
text branch. Forms accepted (and parsed back by the API): the template's tag
(Hermes/Qwen 2.5/Qwen3 ``<tool_call>…</tool_call>``, several in a row when
parallel calls are allowed; Mistral ``[TOOL_CALLS][…]``; Llama 3.x's
``<|python_tag|>`` before its JSON), a bare call object or a list of them, and
either of those in a ```json fence. Llama 3.x names the arguments
``parameters`` (``{"name": ..., "parameters": {...}}``), the others
``arguments``.

A thinking model (Qwen3) reasons in a ``<think>…</think>`` block before it
answers; ``reasoning`` in the spec says the block may open at the start
(``"start"``) or is already open because the prompt opened it (``"inside"``).
Nothing is masked or triggered inside it: the grammar starts over, as at the
start of an answer, after ``</think>`` (``decoding.tool_constraint``).

The spec is a plain dict so it crosses the wire to whichever stage samples::

    {"type": "tool_calls", "tools": [{"name": ..., "parameters": {...}}, ...],
     "style": "hermes" | "mistral" | "json" | "llama3", "required": bool, "parallel": bool,
     "reasoning": "start" | "inside"}       # reasoning: only for a thinking model
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

STYLES = ("hermes", "mistral", "json", "llama3")
REASONING = ("start", "inside")
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_OPEN = "[TOOL_CALLS]"
PYTHON_TAG = "<|python_tag|>"  # Llama 3.x: what follows is a call (its "ipython" environment)
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
FENCES = ("```json", "```\n")  # a call in a Markdown fence (the 1.5B model's habit)
FENCE_CLOSE = "```"
# Every way an answer may start a call, whatever the family (the API's parser accepts them all).
CALL_OPENERS = (HERMES_OPEN, MISTRAL_OPEN, PYTHON_TAG, "{", "[", *FENCES)
# Whitespace inside a call is the model's choice: with fixed separators a call
# written as `{ "name": ...` would be refused at its second token and the
# answer taken for text (see _CALL_START, which must stay within the calls' grammar).
_JSON_STYLE = {"whitespace_flexible": True}


class BadToolSpec(ValueError):
    """A tool_calls spec that is malformed (a bug in the caller, or a hostile peer)."""


@dataclass(frozen=True)
class ToolGrammar:
    """The grammars of one request's tool calls, as llguidance Lark text.

    ``calls``: an answer that is only calls, in any form the family writes.
    ``plain`` (None when a call is required): an answer that is text, i.e.
    does not start the way a call starts. The two are kept apart (two
    matchers whose masks are united) rather than joined in one grammar: a
    lexer that reads ``{`` as text cannot go back and read it as a call.
    ``resume``: what may follow ``trigger``, the call tag, met mid-answer.
    ``inline``: a call written as JSON after some words (``Here's the
    command: ```json {"name": ...``), from where :data:`INLINE_CALL` matches.
    """

    calls: str
    plain: str | None
    resume: str | None
    trigger: str | None
    inline: str


def tool_spec(tools: list[dict[str, Any]], style: str, *, required: bool, parallel: bool,
              only: str | None = None, reasoning: str | None = None) -> dict[str, Any]:
    """The wire spec for ``tools`` (OpenAI/Ollama tool objects); ``only`` forces one tool.

    ``reasoning``: the model thinks first (``"start"``: it may open a think block;
    ``"inside"``: the prompt opened it); left out of the spec when None.
    """
    chosen = [t["function"] for t in tools if only is None or t["function"]["name"] == only]
    if not chosen:
        raise BadToolSpec("no tool to call")
    spec = {"type": "tool_calls", "style": style, "required": bool(required or only is not None),
            "parallel": bool(parallel),
            "tools": [{"name": f["name"], "parameters": f.get("parameters") or {"type": "object"}}
                      for f in chosen]}
    if reasoning is not None:
        spec["reasoning"] = reasoning
    return spec


def style_of(chat_template: str | None) -> str:
    """Which call syntax a chat template teaches its model."""
    t = chat_template or ""
    if HERMES_OPEN in t:
        return "hermes"
    if MISTRAL_OPEN in t:
        return "mistral"
    if PYTHON_TAG in t or ("ipython" in t and '"parameters"' in t):
        return "llama3"  # 3.1 names the tag; 3.2 only its ipython role and the JSON form
    return "json"


def call_schema(tools: list[dict[str, Any]], arguments: str = "arguments") -> dict[str, Any]:
    """JSON schema of one call object: a name from the list and that tool's arguments.

    ``arguments`` is the key the family puts them under (Llama 3.x: ``parameters``).

    A tool's arguments are closed unless its schema says otherwise: JSON
    Schema allows keys it does not list, but an argument the tool does not
    declare is one the model made up, and Home Assistant refuses the call.
    """
    def closed(params: dict[str, Any]) -> dict[str, Any]:
        if params.get("type") == "object" and "additionalProperties" not in params:
            return {**params, "additionalProperties": False}
        return params

    def one(t: dict[str, Any]) -> dict[str, Any]:
        return {"type": "object",
                "properties": {"name": {"const": t["name"]}, arguments: closed(t["parameters"])},
                "required": ["name", arguments], "additionalProperties": False}

    schema = one(tools[0]) if len(tools) == 1 else {"anyOf": [one(t) for t in tools]}
    return {**schema, "x-guidance": _JSON_STYLE}


def build(spec: dict[str, Any], tag_tokens: dict[str, int] | None = None) -> ToolGrammar:
    """The grammars for ``spec``.

    ``tag_tokens`` maps a tag (``<tool_call>``) to the id of the single token
    the model's vocabulary has for it: such tokens are special to the grammar
    engine and must be named by id, or the model could not write its own tag.
    """
    _check(spec)
    style, parallel, tags = spec["style"], spec["parallel"], tag_tokens or {}

    def lit(text: str) -> str:
        q = json.dumps(text)
        return f"({q} | <[{tags[text]}]>)" if text in tags else q

    arguments = "parameters" if style == "llama3" else "arguments"
    rules = [f"call: %json {json.dumps(call_schema(spec['tools'], arguments), ensure_ascii=False)}",
             "WS: /[ \\t\\r\\n]+/",
             'bare: call | "[" WS? call (WS? "," WS? call)* WS? "]"' if parallel
             else 'bare: call | "[" WS? call WS? "]"',
             f'fenced: FENCE WS? bare WS? {json.dumps(FENCE_CLOSE)}', "FENCE: /```(json)?\\n/"]
    forms = ["bare", "fenced"]
    resume = trigger = None
    if style == "hermes":
        rules.append(f"tagged: {lit(HERMES_OPEN)} WS? call WS? {lit(HERMES_CLOSE)}")
        rules.append("tags: tagged (WS? tagged)*" if parallel else "tags: tagged")
        forms.insert(0, "tags")
        trigger = HERMES_OPEN
        more = " (WS? tagged)*" if parallel else ""
        resume = "\n".join([f"start: WS? call WS? {lit(HERMES_CLOSE)}{more} WS?", *rules])
    elif style == "mistral":
        rules.append(f"mistral: {lit(MISTRAL_OPEN)} WS? bare")
        forms.insert(0, "mistral")
    elif style == "llama3":
        rules.append(f"python: {lit(PYTHON_TAG)} WS? bare")
        forms.insert(0, "python")
        trigger = PYTHON_TAG
        resume = "\n".join(["start: WS? bare WS?", *rules])
    calls = "\n".join(["start: WS? calls WS?", f"calls: {' | '.join(forms)}", *rules])
    plain = None if spec["required"] else f"start: PLAIN\nPLAIN: /(.|\\n)*/ & ~/{_CALL_START}(.|\\n)*/"
    inline = "\n".join(["start: (bare | fenced) WS?", *rules])
    return ToolGrammar(calls, plain, resume, trigger, inline)


# Where an answer commits to being a call (text matching this is never plain): a call tag, or a
# JSON object whose first key is "name" (or a doubled brace, the 1.5B model's copy of its
# template), optionally in a list and a ```json fence. An answer like {"data": ...} stays text.
# Every prefix of a match must be a prefix of the calls' grammar too (or be refused by both at
# the same token, as "{{" is): the text branch is dropped as soon as the calls' grammar refuses.
_CALL_START = ("[ \\t\\r\\n]*(<tool_call>|\\[TOOL_CALLS\\]|(```(json)?\\n[ \\t\\r\\n]*)?"
               "(\\[[ \\t\\r\\n]*)?\\{[ \\t\\r\\n]*(\\{|\"name\"))")
CALL_START = re.compile(_CALL_START)  # the same rule, for judging answers (tests, benchmarks)
# A call the model writes after some words: a JSON object whose first key is "name", maybe in a
# ```json fence (the 1.5B model explains, then shows "the command"). From here on it is a call.
def could_begin_inline_call(text: str) -> bool:
    """Whether ``text`` is the beginning of an :data:`INLINE_CALL` match (or a whole one).

    A streaming client must not be sent, as words, the start of what turns out
    to be a call; this says how much of the text to hold back.
    """
    ws = " \t\r\n"
    i = 0
    if text.startswith("`"):
        opener = next((o for o in FENCES if text.startswith(o)), None)
        if opener is None:
            return any(o.startswith(text) for o in FENCES)
        i = len(opener)
        while i < len(text) and text[i] in ws:
            i += 1
    for piece in ("{", '"name"', ":"):
        while piece != "{" and i < len(text) and text[i] in ws:
            i += 1
        if i >= len(text):
            return True
        rest = text[i:i + len(piece)]
        if not piece.startswith(rest):
            return False
        i += len(piece)
    return True


INLINE_CALL = re.compile('(```(json)?\n[ \t\r\n]*)?\\{[ \t\r\n]*"name"[ \t\r\n]*:')


def _check(spec: Any) -> None:
    if not isinstance(spec, dict) or spec.get("type") != "tool_calls":
        raise BadToolSpec("not a tool_calls spec")
    if spec.get("style") not in STYLES:
        raise BadToolSpec(f"tool_calls style must be one of {list(STYLES)}")
    if spec.get("reasoning") not in (None, *REASONING):
        raise BadToolSpec(f"tool_calls reasoning must be one of {list(REASONING)}")
    if not isinstance(spec.get("required"), bool) or not isinstance(spec.get("parallel"), bool):
        raise BadToolSpec("tool_calls needs boolean 'required' and 'parallel'")
    tools = spec.get("tools")
    if not isinstance(tools, list) or not tools:
        raise BadToolSpec("tool_calls needs a non-empty 'tools' list")
    for t in tools:
        if not (isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("parameters"), dict)):
            raise BadToolSpec("each tool needs a string 'name' and an object 'parameters'")
