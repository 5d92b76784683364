"""OpenAI wire format: request validation, response and chunk builders, SSE.

Validation is strict about what we cannot honour and lenient only about what
cannot change the answer (``user``, ``metadata``, ``store``), because OpenAI
clients send many optional fields and must work unchanged. Nothing we accept
is silently ignored: a field we do not implement (``logit_bias``,
``logprobs``...) is accepted at its default value and rejected with a 400
"not supported" otherwise; fields that need an engine capability (structured
output, penalties) are parsed here and checked against the engine by the
server. Every rejection names the offending field in ``param`` so a client
author sees what to fix.

The body is parsed here from raw bytes, with bounds (UTF-8, nesting depth,
integer length, no lone surrogates) checked before any field is looked at:
hostile JSON must become a 400, never a 500 from deep inside a handler.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from decoding.constrained import BadConstraint, validate_spec
from decoding.errors import BadSpeculativeParams
from decoding.penalties import Penalties
from decoding.sampling import BadSamplingParams, SamplingParams
from decoding.speculative.params import SpeculativeParams
from meshd.api import tools as tl

MAX_STOP_STRINGS = 4
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_JSON_DEPTH = 64
# Longer integer literals are never a meaningful value here, and Python's own
# int-from-string limit would otherwise surface as a 500.
MAX_INT_DIGITS = 100
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # OpenAI's seed range; torch and msgpack take it
# Token ids and top_k when the engine does not say its vocabulary size: keeps
# them inside the int32/int64 tensors and message fields they end up in.
MAX_VOCAB = 2**31 - 1
_SURROGATE = re.compile("[\ud800-\udfff]")


class RequestError(Exception):
    """A request the API answers with an OpenAI-style error object.

    ``retry_after_s`` becomes a ``Retry-After`` header (busy / no plan yet).
    """

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after_s: float | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """``{"error": {...}}`` exactly as OpenAI returns it."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# --------------------------------------------------------------------------- requests


@dataclass
class RequestParams:
    """What a request asks of the generation besides its prompt.

    ``sampling`` is the one typed :class:`decoding.sampling.SamplingParams`
    every engine samples with; the rest is handled by the API and
    :meth:`meshd.engine.Engine.stream`.
    """

    sampling: SamplingParams = field(default_factory=lambda: SamplingParams(temperature=1.0))
    max_tokens: int | None = None  # None: as many as the context allows
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage
    constraint: dict[str, Any] | None = None  # a decoding.constrained spec (structured output)
    constraint_param: str | None = None  # the request field that asked for it, for errors
    penalties: Penalties = field(default_factory=Penalties)
    speculative: SpeculativeParams = field(default_factory=SpeculativeParams)


@dataclass
class ChatRequest:
    model: str | None
    messages: list[dict[str, Any]]
    params: RequestParams
    tools: list[dict[str, Any]] = field(default_factory=list)  # validated, for the chat template
    tool_choice: str | None = None  # None (auto), "none", "required" or a tool name
    parallel_tool_calls: bool = True


@dataclass
class CompletionRequest:
    model: str | None
    prompt: str | list[int]
    params: RequestParams


# --------------------------------------------------------------------------- JSON


def parse_json_body(raw: bytes, *, max_depth: int = MAX_JSON_DEPTH) -> dict[str, Any]:
    """Decode a request body; the top level must be a JSON object.

    Strict UTF-8 (``json.loads`` on bytes would let UTF-8-encoded surrogates
    through), bounded nesting and integer length, and no lone ``\\uD800``
    escapes, which would fail later when the text is encoded or tokenised.
    """
    if not raw.strip():
        raise RequestError("request body is empty; expected a JSON object", code="invalid_json")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _json_error(f"is not valid UTF-8 (byte {exc.start})") from None
    try:
        body = json.loads(text, parse_int=_parse_int, parse_constant=_reject_constant)
    except RecursionError:
        raise _json_error(f"nests deeper than {max_depth} levels") from None
    except ValueError as exc:  # JSONDecodeError, and the hooks' own errors
        raise _json_error(f"is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise RequestError(
            f"request body must be a JSON object, got {_json_type(body)}", code="invalid_json"
        )
    _check_structure(body, text, max_depth)
    return body


def _json_error(what: str) -> RequestError:
    return RequestError(f"request body {what}", code="invalid_json")


def _parse_int(s: str) -> int:
    if len(s) - s.startswith("-") > MAX_INT_DIGITS:
        raise ValueError(f"an integer literal has {len(s)} digits (at most {MAX_INT_DIGITS})")
    return int(s)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _check_structure(body: dict[str, Any], text: str, max_depth: int) -> None:
    """Reject bodies nested deeper than ``max_depth`` or holding lone surrogates.

    Both walks are skipped when the raw text proves them unnecessary (few
    brackets, no ``\\u`` escape), so ordinary requests pay nothing.
    """
    deep = text.count("[") + text.count("{") > max_depth
    escapes = "\\u" in text
    if not (deep or escapes):
        return
    stack: list[tuple[Any, int, str]] = [(body, 1, "")]
    while stack:
        node, depth, path = stack.pop()
        if isinstance(node, (dict, list)) and depth > max_depth:
            raise RequestError(f"request body nests deeper than {max_depth} levels",
                               param=path or None, code="invalid_json")
        if isinstance(node, dict):
            for k, v in node.items():
                where = f"{path}.{k}" if path else str(k)
                if escapes and _SURROGATE.search(k):
                    raise _surrogate_error(path or None)
                stack.append((v, depth + 1, where))
        elif isinstance(node, list):
            stack.extend((v, depth + 1, f"{path}[{i}]") for i, v in enumerate(node))
        elif escapes and isinstance(node, str) and _SURROGATE.search(node):
            raise _surrogate_error(path)


def _surrogate_error(param: str | None) -> RequestError:
    return RequestError("a string holds a lone UTF-16 surrogate (e.g. \\ud800), which is not "
                        "valid Unicode text", param=param, code="invalid_json")


# --------------------------------------------------------------------------- fields


def parse_chat_request(body: dict[str, Any], *, vocab_size: int | None = None) -> ChatRequest:
    """Validate a chat request; ``vocab_size`` (the engine's, if known) bounds ``top_k``."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _field_error("messages", "must be a non-empty array of message objects", messages)
    parsed = [_parse_message(i, m) for i, m in enumerate(messages)]
    _check_unsupported(body, CHAT_UNSUPPORTED)
    params = _parse_params(body, vocab_size)
    try:
        tools = tl.parse_tools(body.get("tools"))
        choice = tl.parse_tool_choice(body.get("tool_choice"), tools)
    except tl.ToolError as exc:
        raise RequestError(str(exc), param=exc.param, code="invalid_value") from None
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise _field_error("parallel_tool_calls", "must be a boolean", parallel)
    rf = body.get("response_format")
    if rf is not None:
        params.constraint = parse_response_format(rf)
        params.constraint_param = "response_format"
    if choice in ("required",) or (choice not in (None, "none") and tools):
        if params.constraint is not None:
            raise RequestError("'tool_choice' that forces a call cannot be combined with "
                               "'response_format'", param="tool_choice", code="invalid_value")
        params.constraint = {"type": "json_schema",
                             "schema": tl.forced_call_schema(tools, None if choice == "required" else choice)}
        params.constraint_param = "tool_choice"
    return ChatRequest(_parse_model(body), parsed, params, tools if choice != "none" else [],
                       choice, parallel is not False)


def parse_response_format(rf: Any) -> dict[str, Any] | None:
    """OpenAI ``response_format`` -> a constraint spec (None for plain text); 400 on a bad schema."""
    if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
        raise _field_error("response_format", "must be {\"type\": \"text\"}, {\"type\": \"json_object\"} "
                           "or {\"type\": \"json_schema\", \"json_schema\": {...}}", rf)
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    js = rf.get("json_schema")
    if not isinstance(js, dict) or not isinstance(js.get("schema"), dict):
        raise _field_error("response_format.json_schema", "must be an object with 'name' and 'schema'", js)
    return checked_constraint({"type": "json_schema", "schema": js["schema"]},
                              "response_format.json_schema.schema")


def checked_constraint(spec: dict[str, Any], param: str) -> dict[str, Any]:
    try:
        return validate_spec(spec)
    except BadConstraint as exc:
        raise RequestError(str(exc), param=param, code="invalid_schema") from None


def parse_completion_request(
    body: dict[str, Any], *, vocab_size: int | None = None
) -> CompletionRequest:
    """Validate a text completion; token-id prompts must lie in ``[0, vocab_size)``."""
    prompt = _parse_prompt(body.get("prompt"), vocab_size or MAX_VOCAB)
    if body.get("echo"):
        raise _field_error("echo", "is not supported", body.get("echo"))
    if body.get("suffix"):
        raise _field_error("suffix", "is not supported", body.get("suffix"))
    _check_one_choice(body, "best_of")
    _check_unsupported(body, COMPLETION_UNSUPPORTED)
    return CompletionRequest(_parse_model(body), prompt, _parse_params(body, vocab_size))


def _parse_prompt(prompt: Any, vocab: int) -> str | list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one is the same request
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        bad = next((i for i, t in enumerate(prompt) if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError(
                f"'prompt' token id {prompt[bad]} at index {bad} is outside the vocabulary "
                f"[0, {vocab})", param="prompt", code="invalid_value")
        return [int(t) for t in prompt]
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, str) for p in prompt):
        raise _field_error("prompt", "batches of several prompts are not supported; send one", None)
    raise _field_error("prompt", "must be a string or an array of token ids", prompt)


def _parse_model(body: dict[str, Any]) -> str | None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _field_error("model", "must be a string", model)
    return model


def _parse_message(i: int, m: Any) -> dict[str, Any]:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise _field_error(where, "must be an object with 'role' and 'content'", m)
    role = m.get("role")
    if role not in CHAT_ROLES:
        raise _field_error(f"{where}.role", f"must be one of {', '.join(CHAT_ROLES)}", role)
    out: dict[str, Any] = {}
    if role == "assistant" and m.get("tool_calls"):
        try:
            out["tool_calls"] = tl.history_tool_calls(m["tool_calls"], f"{where}.tool_calls",
                                                      arguments_as_string=True)
        except tl.ToolError as exc:
            raise RequestError(str(exc), param=exc.param, code="invalid_value") from None
    if role == "tool":
        for key in ("tool_call_id", "name"):
            if isinstance(m.get(key), str):
                out[key] = m[key]
    content = m.get("content")
    if content is None and role == "assistant":
        content = ""  # assistant turns that only carried tool calls
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text"):
                raise _field_error(
                    f"{where}.content[{j}]", "only parts of type 'text' are supported", part
                )
            if not isinstance(part.get("text"), str):
                raise _field_error(f"{where}.content[{j}].text", "must be a string", part.get("text"))
            texts.append(part["text"])
        content = "".join(texts)
    if not isinstance(content, str):
        raise _field_error(f"{where}.content", "must be a string or an array of text parts", content)
    return {"role": "system" if role == "developer" else role, "content": content, **out}


def _parse_params(body: dict[str, Any], vocab_size: int | None) -> RequestParams:
    p = RequestParams(sampling=_parse_sampling(body, vocab_size or MAX_VOCAB))
    p.max_tokens = _parse_max_tokens(body)
    p.stop = _parse_stop(body.get("stop"))
    p.stream = _bool(body, "stream")
    opts = body.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict):
            raise _field_error("stream_options", "must be an object", opts)
        p.include_usage = _bool(opts, "include_usage", where="stream_options.include_usage")
    _check_one_choice(body, "n")
    p.penalties = Penalties(presence=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
                            frequency=_number(body, "frequency_penalty", 0.0, -2.0, 2.0))
    p.speculative = parse_speculative(body.get("speculative"), "speculative")
    return p


def parse_speculative(value: Any, param: str) -> SpeculativeParams:
    """meshd's ``speculative`` extension field ("auto", "off" or an object)."""
    try:
        return SpeculativeParams.parse(value)
    except BadSpeculativeParams as exc:
        raise RequestError(str(exc), param=param, code="invalid_value") from None


def _parse_max_tokens(body: dict[str, Any]) -> int | None:
    """Any integer >= 1; the server clips it to the room left in the context."""
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    mt = body.get(name)
    if mt is None:
        return None
    if not _is_int(mt) or mt < 1:
        raise _field_error(name, "must be an integer >= 1", mt)
    return int(mt)


def _parse_sampling(body: dict[str, Any], vocab: int) -> SamplingParams:
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0.0:
        raise _field_error("top_p", "must be greater than 0 and at most 1", body["top_p"])
    top_k = _integer(body, "top_k", 0, 0, vocab, "0 disables it")
    seed = _integer(body, "seed", None, INT64_MIN, INT64_MAX, "a signed 64-bit integer")
    try:
        return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    except BadSamplingParams as exc:  # our bounds are tighter; kept as a safety net
        raise RequestError(str(exc), code="invalid_value") from None


def _parse_stop(stop: Any) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop] if stop else []
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        if len(stop) > MAX_STOP_STRINGS:
            raise _field_error("stop", f"accepts at most {MAX_STOP_STRINGS} strings", stop)
        return [s for s in stop if s]
    raise _field_error("stop", "must be a string or an array of strings", stop)


def _check_one_choice(body: dict[str, Any], name: str) -> None:
    v = _integer(body, name, None, 1, 128, "OpenAI's range")
    if v is not None and v != 1:
        raise _field_error(name, "only 1 is supported", v)


# Fields OpenAI defines that meshd does not implement, with the values that
# mean "off": anything else would be silently ignored, so it is a 400.
_DEFAULTS_TOOLS = {  # the deprecated pre-"tools" function calling
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
}
_DEFAULTS_COMMON = {
    "logit_bias": (None, {}),
    "logprobs": (None, False, 0),
}
CHAT_UNSUPPORTED = {
    **_DEFAULTS_TOOLS, **_DEFAULTS_COMMON,
    "top_logprobs": (None, 0),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
}
COMPLETION_UNSUPPORTED = dict(_DEFAULTS_COMMON)


def _check_unsupported(body: dict[str, Any], fields: dict[str, tuple]) -> None:
    for name, defaults in fields.items():
        v = body.get(name)
        if not _is_default(v, defaults):
            raise RequestError(
                f"'{name}' is not supported by meshd (only its default is accepted; "
                f"got {_shown(v)})", param=name, code="unsupported_parameter")


def _is_default(v: Any, defaults: tuple) -> bool:
    """``v == d`` without Python's ``True == 1`` / ``0 == False`` leniency (numbers still match)."""
    for d in defaults:
        if _is_number(v) and _is_number(d):
            if v == d:
                return True
        elif type(v) is type(d) and v == d:
            return True
    return False


def _bool(body: dict[str, Any], name: str, *, where: str | None = None) -> bool:
    v = body.get(name)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise _field_error(where or name, "must be a boolean", v)
    return v


def _integer(
    body: dict[str, Any], name: str, default: int | None, lo: int, hi: int, note: str
) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if not _is_int(v) or not lo <= v <= hi:
        raise _field_error(name, f"must be an integer from {lo} to {hi} ({note})", v)
    return int(v)


def _number(body: dict[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if not _is_number(v) or v != v:
        raise _field_error(name, f"must be a number between {lo:g} and {hi:g}", v)
    if not lo <= v <= hi:
        raise _field_error(name, f"must be between {lo:g} and {hi:g}", v)
    return float(v)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _json_type(v: Any) -> str:
    return {
        dict: "an object", list: "an array", str: "a string", bool: "a boolean",
        int: "a number", float: "a number", type(None): "null",
    }.get(type(v), type(v).__name__)


def _shown(value: Any) -> str:
    """A short rendering of a client's value for an error message (never the whole body)."""
    if value is None:
        return "missing or null"
    if isinstance(value, (dict, list)) and len(value) > 8:
        return f"{_json_type(value)} of {len(value)} items"
    return json.dumps(value)[:80]


def _field_error(param: str, what: str, value: Any) -> RequestError:
    return RequestError(f"'{param}' {what} (got {_shown(value)})", param=param, code="invalid_value")


# --------------------------------------------------------------------------- responses


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def models_list(model_ids: list[str]) -> dict[str, Any]:
    return {"object": "list", "data": [model_object(m) for m in model_ids]}


def model_object(model_id: str) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": 0, "owned_by": "meshd"}


def chat_response(
    rid: str, created: int, model: str, text: str, finish: str, usage: dict[str, Any],
    tool_calls: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if tool_calls:
        message = {"role": "assistant", "content": text or None, "tool_calls": tool_calls}
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": None,
                "finish_reason": finish,
            }
        ],
        "usage": usage,
    }


def chat_chunk(
    rid: str,
    created: int,
    model: str,
    *,
    delta: dict[str, Any] | None = None,
    finish: str | None = None,
    usage: dict[str, int] | None = None,
    no_choices: bool = False,
) -> dict[str, Any]:
    """One ``chat.completion.chunk``; ``no_choices`` makes the trailing usage chunk."""
    chunk: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": []
        if no_choices
        else [{"index": 0, "delta": delta or {}, "logprobs": None, "finish_reason": finish}],
    }
    if usage is not None:
        chunk["usage"] = usage
    return chunk


def completion_response(
    rid: str, created: int, model: str, text: str, finish: str | None,
    usage: dict[str, int] | None = None, *, no_choices: bool = False,
) -> dict[str, Any]:
    """A ``text_completion`` object; streaming chunks use the same shape."""
    body: dict[str, Any] = {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": []
        if no_choices
        else [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
    }
    if usage is not None:
        body["usage"] = usage
    return body


def sse(obj: dict[str, Any]) -> bytes:
    """One server-sent event carrying a JSON object."""
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
