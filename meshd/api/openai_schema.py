"""OpenAI wire format: request validation, response and chunk builders, SSE.

Validation is strict about what we cannot honour (wrong types, n > 1,
non-text message parts) and lenient about what does not change the answer
(``user``, ``logit_bias`` absent, penalties at their defaults), because OpenAI
clients send many optional fields and must work unchanged. Every rejection
names the offending field in ``param`` so a client author sees what to fix.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

MAX_STOP_STRINGS = 4
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


class RequestError(Exception):
    """A request the API answers with an OpenAI-style error object."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """``{"error": {...}}`` exactly as OpenAI returns it."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# --------------------------------------------------------------------------- requests


@dataclass
class SamplingParams:
    max_tokens: int | None = None  # None: as many as the context allows
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage


@dataclass
class ChatRequest:
    model: str | None
    messages: list[dict[str, str]]
    params: SamplingParams


@dataclass
class CompletionRequest:
    model: str | None
    prompt: str | list[int]
    params: SamplingParams


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """Decode a request body; the top level must be a JSON object."""
    if not raw.strip():
        raise RequestError("request body is empty; expected a JSON object", code="invalid_json")
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RequestError(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise RequestError(
            f"request body must be a JSON object, got {_json_type(body)}", code="invalid_json"
        )
    return body


def parse_chat_request(body: dict[str, Any]) -> ChatRequest:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _field_error("messages", "must be a non-empty array of message objects", messages)
    parsed = [_parse_message(i, m) for i, m in enumerate(messages)]
    return ChatRequest(_parse_model(body), parsed, _parse_sampling(body))


def parse_completion_request(body: dict[str, Any]) -> CompletionRequest:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one is the same request
    if isinstance(prompt, str):
        pass
    elif isinstance(prompt, list) and prompt and all(_is_int(t) and t >= 0 for t in prompt):
        prompt = [int(t) for t in prompt]
    elif isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, str) for p in prompt):
        raise _field_error("prompt", "batches of several prompts are not supported; send one", None)
    else:
        raise _field_error("prompt", "must be a string or an array of token ids", prompt)
    if body.get("echo"):
        raise _field_error("echo", "is not supported", body.get("echo"))
    if body.get("suffix"):
        raise _field_error("suffix", "is not supported", body.get("suffix"))
    _check_one_choice(body, "best_of")
    return CompletionRequest(_parse_model(body), prompt, _parse_sampling(body))


def _parse_model(body: dict[str, Any]) -> str | None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _field_error("model", "must be a string", model)
    return model


def _parse_message(i: int, m: Any) -> dict[str, str]:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise _field_error(where, "must be an object with 'role' and 'content'", m)
    role = m.get("role")
    if role not in CHAT_ROLES:
        raise _field_error(f"{where}.role", f"must be one of {', '.join(CHAT_ROLES)}", role)
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
    return {"role": "system" if role == "developer" else role, "content": content}


def _parse_sampling(body: dict[str, Any]) -> SamplingParams:
    p = SamplingParams()
    mt = body.get("max_completion_tokens", body.get("max_tokens"))
    name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    if mt is not None:
        if not _is_int(mt) or mt < 1:
            raise _field_error(name, "must be an integer >= 1", mt)
        p.max_tokens = int(mt)
    p.temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    p.top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if body.get("top_p") is not None and p.top_p == 0.0:
        raise _field_error("top_p", "must be greater than 0", body["top_p"])
    top_k = body.get("top_k")
    if top_k is not None:
        if not _is_int(top_k) or top_k < 0:
            raise _field_error("top_k", "must be an integer >= 0 (0 disables it)", top_k)
        p.top_k = int(top_k)
    seed = body.get("seed")
    if seed is not None:
        if not _is_int(seed):
            raise _field_error("seed", "must be an integer", seed)
        p.seed = int(seed)
    p.stop = _parse_stop(body.get("stop"))
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise _field_error("stream", "must be a boolean", stream)
    p.stream = stream
    opts = body.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict):
            raise _field_error("stream_options", "must be an object", opts)
        p.include_usage = bool(opts.get("include_usage", False))
    _check_one_choice(body, "n")
    for name in ("frequency_penalty", "presence_penalty"):
        _number(body, name, 0.0, -2.0, 2.0)  # accepted at any valid value, not applied
    if body.get("logprobs") not in (None, False, 0):
        raise _field_error("logprobs", "is not supported", body.get("logprobs"))
    return p


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
    v = body.get(name)
    if v is None:
        return
    if not _is_int(v) or v < 1:
        raise _field_error(name, "must be an integer >= 1", v)
    if v != 1:
        raise _field_error(name, "only 1 is supported", v)


def _number(body: dict[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
        raise _field_error(name, f"must be a number between {lo:g} and {hi:g}", v)
    if not lo <= v <= hi:
        raise _field_error(name, f"must be between {lo:g} and {hi:g}", v)
    return float(v)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _json_type(v: Any) -> str:
    return {
        dict: "an object", list: "an array", str: "a string", bool: "a boolean",
        int: "a number", float: "a number", type(None): "null",
    }.get(type(v), type(v).__name__)


def _field_error(param: str, what: str, value: Any) -> RequestError:
    shown = json.dumps(value)[:80] if value is not None else "missing or null"
    return RequestError(f"'{param}' {what} (got {shown})", param=param, code="invalid_value")


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
    rid: str, created: int, model: str, text: str, finish: str, usage: dict[str, int]
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
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
    delta: dict[str, str] | None = None,
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
