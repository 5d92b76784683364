"""Tool calls: validating tool definitions, rendering the history, parsing calls out of text.

Tools need nothing from the engine: the model's own chat template renders the
tool list and earlier calls/results into the prompt (so the model sees the
format it was trained on), and calls are parsed back out of the generated
text. Formats parsed, by model family:

* Hermes / Qwen 2.5: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  (one block per call);
* Mistral: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``;
* Llama 3.x: ``{"name": ..., "parameters": {...}}``, after ``<|python_tag|>``
  or bare (the tag is a special token, so it is usually gone from the text);
* any family, when the whole answer is a JSON call object (or a list of
  them) naming an offered tool, with ``arguments`` or ``parameters`` (Llama
  3.x's JSON form; small models often drop the Hermes tags), bare or in a
  ```json fence.

A thinking model's reasoning was split off before (:mod:`meshd.api.reasoning`):
what is parsed here is only what it said.

When tools are offered the engine samples under :mod:`decoding.tool_grammar`,
so every call it writes is in one of these forms, names an offered tool and
has arguments valid against that tool's schema; parsing is still defensive. A
call that names a tool that was not offered is left as text: the client must
never receive a call it cannot dispatch.

The OpenAI and Ollama wire shapes differ (arguments as a JSON string vs an
object, ``tool_call_id`` vs ``tool_name``); both become one internal shape,
:class:`ToolCall`, and are rendered back per API.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from decoding.tool_grammar import (
    CALL_OPENERS, FENCE_CLOSE, FENCES, HERMES_CLOSE, HERMES_OPEN, INLINE_CALL, MISTRAL_OPEN, PYTHON_TAG,
    could_begin_inline_call,
)
from meshd.api.validation import RequestError

MAX_TOOLS = 128
_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
_OPEN, _CLOSE = HERMES_OPEN, HERMES_CLOSE
_MISTRAL = MISTRAL_OPEN


class ToolError(ValueError):
    """A malformed ``tools`` / ``tool_choice`` / history entry; ``param`` names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param

    def as_request_error(self) -> RequestError:
        """The 400 a client of either dialect gets for it."""
        return RequestError(str(self), param=self.param, code="invalid_value")


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str = ""

    def openai(self, index: int | None = None) -> dict[str, Any]:
        d: dict[str, Any] = {"id": self.id or new_call_id(), "type": "function",
                             "function": {"name": self.name,
                                          "arguments": json.dumps(self.arguments, ensure_ascii=False)}}
        if index is not None:
            d["index"] = index
        return d

    def ollama(self) -> dict[str, Any]:
        return {"function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# --------------------------------------------------------------------------- requests


def parse_tools(value: Any, param: str = "tools") -> list[dict[str, Any]]:
    """Validate a tools list (OpenAI and Ollama share the shape); returns it for the template."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise ToolError(f"'{param}' must be an array of tool objects", param)
    if len(value) > MAX_TOOLS:
        raise ToolError(f"'{param}' has {len(value)} tools; at most {MAX_TOOLS} are accepted", param)
    out, names = [], set()
    for i, tool in enumerate(value):
        where = f"{param}[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise ToolError(f"'{where}' must be an object with type 'function'", where)
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise ToolError(f"'{where}.function' must be an object", f"{where}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ToolError(f"'{where}.function.name' must be 1-64 letters, digits, '_', '.', ':' or '-'",
                            f"{where}.function.name")
        if name in names:
            raise ToolError(f"tool name {name!r} appears twice", f"{where}.function.name")
        names.add(name)
        desc = fn.get("description")
        if desc is not None and not isinstance(desc, str):
            raise ToolError(f"'{where}.function.description' must be a string",
                            f"{where}.function.description")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ToolError(f"'{where}.function.parameters' must be a JSON schema object",
                            f"{where}.function.parameters")
        clean = {"name": name}
        if desc is not None:
            clean["description"] = desc
        clean["parameters"] = params if params is not None else {"type": "object", "properties": {}}
        out.append({"type": "function", "function": clean})
    return out


def tool_names(tools: list[dict[str, Any]]) -> list[str]:
    return [t["function"]["name"] for t in tools]


def parse_tool_choice(value: Any, tools: list[dict[str, Any]]) -> str | None:
    """OpenAI ``tool_choice`` -> None (auto), "none", "required" or a tool name to force."""
    if value is None or value == "auto":
        return None
    if value in ("none", "required"):
        if value == "required" and not tools:
            raise ToolError("'tool_choice' is 'required' but no tools were given", "tool_choice")
        return value
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("function"), dict):
        name = value["function"].get("name")
        if name not in tool_names(tools):
            raise ToolError(f"'tool_choice' names {name!r}, which is not in 'tools'", "tool_choice")
        return name
    raise ToolError("'tool_choice' must be 'none', 'auto', 'required' or "
                    "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")


def history_tool_calls(raw: Any, where: str, *, arguments_as_string: bool) -> list[dict[str, Any]]:
    """An assistant message's earlier calls, as the chat templates expect them.

    OpenAI sends arguments as a JSON string, Ollama as an object; templates
    (``arguments | tojson``) want the object.
    """
    if not isinstance(raw, list):
        raise ToolError(f"'{where}' must be an array", where)
    calls = []
    for j, call in enumerate(raw):
        w = f"{where}[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ToolError(f"'{w}' must be an object with function.name", w)
        args = fn.get("arguments", {} if not arguments_as_string else "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise ToolError(f"'{w}.function.arguments' is not valid JSON", f"{w}.function.arguments") from None
        if not isinstance(args, dict):
            raise ToolError(f"'{w}.function.arguments' must be a JSON object", f"{w}.function.arguments")
        entry: dict[str, Any] = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
        if isinstance(call.get("id"), str):
            entry["id"] = call["id"]
        calls.append(entry)
    return calls


# --------------------------------------------------------------------------- parsing


def parse_tool_calls(text: str, offered: list[str]) -> tuple[str, list[ToolCall]]:
    """Split generated ``text`` into (remaining content, tool calls naming offered tools)."""
    if not offered:
        return text, []
    calls: list[ToolCall] = []
    if _OPEN in text:
        content, rest = text.split(_OPEN, 1)
        kept = [content]
        for block in (_OPEN + rest).split(_OPEN)[1:]:
            body, sep, after = block.partition(_CLOSE)
            found = _calls_in(body, offered)
            if found:
                calls += found
                kept.append(after)
            else:
                kept.append(_OPEN + block)
        return ("".join(kept).strip() if calls else text), calls
    stripped = text.strip()
    if stripped.startswith(_MISTRAL):
        found = _calls_in(stripped[len(_MISTRAL):], offered)
        return ("", found) if found else (text, [])
    if stripped.startswith(PYTHON_TAG):
        found = _bare_or_fenced(stripped[len(PYTHON_TAG):].strip(), offered)
        return ("", found) if found else (text, [])
    found = _bare_or_fenced(stripped, offered)
    if found:
        return "", found
    inline = INLINE_CALL.search(text)  # words, then the call as JSON (the grammar allows that too)
    if inline is not None and inline.start() > 0:
        found = _bare_or_fenced(text[inline.start():].strip(), offered)
        if found:
            return text[:inline.start()].rstrip(), found
    return text, []


def _bare_or_fenced(s: str, offered: list[str]) -> list[ToolCall]:
    fence = next((f for f in FENCES if s.startswith(f)), None)
    if fence is not None:
        if not s.endswith(FENCE_CLOSE) or len(s) < len(fence) + len(FENCE_CLOSE):
            return []
        s = s[len(fence):len(s) - len(FENCE_CLOSE)]
    elif s[:1] not in ("{", "["):
        return []
    return _calls_in(s, offered)


def _calls_in(body: str, offered: list[str]) -> list[ToolCall]:
    """Call objects in ``body`` (one object, a list, or several objects in a row)."""
    objs = []
    dec = json.JSONDecoder()
    s = body.strip()
    i = 0
    while i < len(s):
        try:
            obj, end = dec.raw_decode(s, i)
        except ValueError:
            return []
        objs.extend(obj if isinstance(obj, list) else [obj])
        i = end
        while i < len(s) and s[i] in " \t\r\n,;":
            i += 1
    calls = []
    for obj in objs:
        if not isinstance(obj, dict) or obj.get("name") not in offered:
            return []
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                return []
        if not isinstance(args, dict):
            return []
        calls.append(ToolCall(obj["name"], args, new_call_id()))
    return calls


def _search(pattern: re.Pattern, text: str) -> int:
    m = pattern.search(text)
    return -1 if m is None else m.start()


class ToolStreamFilter:
    """Streams plain text at once but holds back anything that may be a tool call.

    Text that starts like a call (``{``, ``[``, ``[TOOL_CALLS]``, a ```json
    fence) at the very beginning of the answer, or a ``<tool_call>`` tag
    anywhere, is kept until the end, when :meth:`finish` parses it: calls
    become tool calls, anything else is released as text after all.
    """

    _STARTS = CALL_OPENERS

    def __init__(self, offered: list[str]):
        self.offered = offered
        self._sent = ""  # text already released
        self._held = ""
        self._holding = False

    def feed(self, delta: str) -> str:
        if not self.offered:
            return delta
        self._held += delta
        if self._holding:
            return ""
        at_start = not self._sent.strip()
        probe = self._held.lstrip() if at_start else self._held
        if at_start and probe and any(probe.startswith(p) for p in self._STARTS):
            self._holding = True
            return ""
        if at_start and probe and any(p.startswith(probe) for p in self._STARTS):
            return ""  # could still become a call: wait for more text
        starts = [i for i in (self._held.find(_OPEN), _search(INLINE_CALL, self._held)) if i >= 0]
        if starts:  # a call starts here: the rest is held for finish()
            cut = min(starts)
            out, self._held, self._holding = self._held[:cut], self._held[cut:], True
            self._sent += out
            return out
        keep = len(self._held) - self._maybe_call_at()
        out = self._held[: len(self._held) - keep]
        self._held = self._held[len(self._held) - keep:]
        self._sent += out
        return out

    def _maybe_call_at(self) -> int:
        """Where the held text's tail may be growing into a call (its length if nowhere)."""
        held = self._held
        for i, c in enumerate(held):
            if c == "<" and _OPEN.startswith(held[i:i + len(_OPEN)]) and len(held) - i < len(_OPEN):
                return i
            if c in "`{" and could_begin_inline_call(held[i:]):
                return i
        return len(held)

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(text still to release, parsed calls) once the generation ended."""
        held, self._held = self._held, ""
        if not self.offered or not held:
            return held, []
        text, calls = parse_tool_calls(held, self.offered)
        return (text if calls else held), calls
