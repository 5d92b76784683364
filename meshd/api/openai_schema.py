"""OpenAI wire format: request validation, response and chunk builders, SSE.

Request bodies are validated by strict pydantic models (``ChatBody``,
``CompletionBody``; errors become 400s through ``meshd.api.validation``, as
in the Ollama API). Validation is strict about what we cannot honour and
lenient only about what cannot change the answer (``user``, ``metadata``,
``store``, and fields OpenAI adds that we do not know), because OpenAI
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
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, ValidationInfo,
    field_validator, model_validator,
)

from decoding.constrained import BadConstraint, validate_spec
from decoding.errors import BadSpeculativeParams
from decoding.penalties import Penalties
from decoding.sampling import BadSamplingParams, SamplingParams, SamplingSpec
from decoding.speculative.params import SpeculativeParams
from meshd.api import tools as tl
from meshd.api.validation import (  # noqa: F401 - RequestError and error_body are used as oa.* too
    RequestError, described, error_body, invalid, json_type, validate,
)
from partition.ids import RequestId

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


# --------------------------------------------------------------------------- requests


@dataclass
class RequestParams:
    """What a request asks of the generation besides its prompt.

    ``sampling`` is the one :class:`decoding.sampling.SamplingSpec` (the draw,
    penalties, a grammar) that goes on to the engine unchanged; each API makes
    it in one function (``_Params.sampling_spec`` here, ``ollama._sampling_spec``)
    and offered tools may add their grammar. The rest is handled by the API and
    :meth:`meshd.engine.Engine.stream`.
    """

    sampling: SamplingSpec = field(default_factory=lambda: SamplingSpec(SamplingParams(temperature=1.0)))
    max_tokens: int | None = None  # None: as many as the context allows
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage
    constraint_param: str | None = None  # the request field that asked for sampling.constraint, for errors
    speculative: SpeculativeParams = field(default_factory=SpeculativeParams)
    outline: str = "auto"  # meshd's extension: outline-based parallel decoding ("auto" | "on" | "off")
    tools_offered: bool = False  # the prompt offers tools (set where tools meet the params)
    cloud: str | float = "auto"  # meshd's extension: a paired cloud verifier ("auto" | "off" | budget 0..1)


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
            f"request body must be a JSON object, got {json_type(body)}", code="invalid_json"
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


# --------------------------------------------------------------------------- request models
#
# pydantic models, strict (no "10" for 10, no true for 1): an OpenAI client sends
# JSON types, and anything else is a client bug worth a 400. Unknown fields are
# ignored (OpenAI keeps adding optional ones); the OpenAI fields meshd does not
# implement are declared below and accepted only at their default value.


def _vocab(info: ValidationInfo) -> int:
    return (info.context or {}).get("vocab") or MAX_VOCAB


def _only_one(v: int) -> int:
    if v != 1:
        raise invalid("only 1 is supported")
    return v


def _stop_list(stop: str | list[str]) -> list[str]:
    if isinstance(stop, str):
        return [stop]
    if len(stop) > MAX_STOP_STRINGS:
        raise invalid(f"accepts at most {MAX_STOP_STRINGS} strings")
    return stop


def only_default(*defaults: Any) -> AfterValidator:
    """A field meshd does not implement: accepted at one of ``defaults``, else a 400 "not supported"."""

    def check(v: Any) -> Any:
        if not _is_default(v, defaults):
            raise invalid("is not supported by meshd (only its default is accepted)",
                          "unsupported_parameter")
        return v

    return AfterValidator(check)


def _is_default(v: Any, defaults: tuple) -> bool:
    """``v == d`` without Python's ``True == 1`` / ``0 == False`` leniency (numbers still match)."""
    for d in defaults:
        if _is_number(v) and _is_number(d):
            if v == d:
                return True
        elif type(v) is type(d) and v == d:
            return True
    return False


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


Temperature = Annotated[float, Field(ge=0.0, le=2.0), described("a number between 0 and 2")]
TopP = Annotated[float, Field(gt=0.0, le=1.0), described("a number greater than 0 and at most 1")]
# meshd's extension: whether a paired cloud verifier checks the answer ("auto", "off") or at which budget.
Cloud = Annotated[Literal["auto", "off"] | Annotated[float, Field(ge=0.0, le=1.0, strict=True)],
                  described('"auto", "off" or a cloud budget from 0 to 1')]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0), described("a number between -2 and 2")]
Seed = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX),
                 described(f"an integer from {INT64_MIN} to {INT64_MAX} (a signed 64-bit integer)")]
MaxTokens = Annotated[int, Field(ge=1), described("an integer >= 1")]  # the server clips it to the context
OneChoice = Annotated[int, Field(ge=1, le=128), described("an integer from 1 to 128 (OpenAI's range)"),
                      AfterValidator(_only_one)]
Stop = Annotated[str | list[str], described("a string or an array of strings"), AfterValidator(_stop_list)]
_STRICT = ConfigDict(strict=True, extra="ignore")


class StreamOptions(BaseModel):
    model_config = _STRICT

    include_usage: bool | None = None


class _Params(BaseModel):
    """What chat and text completions share: sampling, length, stop, streaming, extensions."""

    model_config = _STRICT

    model: str | None = None
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None  # the newer name; wins over max_tokens
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: int | None = None  # not OpenAI's; llama.cpp's and vLLM's servers take it too
    seed: Seed | None = None
    stop: Stop | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: OneChoice | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    speculative: Any = None  # meshd's extension: "auto", "off" or an object (SpeculativeParams)
    outline: Literal["auto", "on", "off"] | None = None  # meshd's extension: outline-based parallel decoding
    cloud: Cloud | None = None  # meshd's extension: "auto", "off" or a budget in [0, 1]
    logit_bias: Annotated[Any, only_default(None, {})] = None
    logprobs: Annotated[Any, only_default(None, False, 0)] = None
    # Lenient: they cannot change the answer.
    user: Any = None
    metadata: Any = None
    store: Any = None

    @field_validator("top_k", mode="wrap")
    @classmethod
    def _top_k(cls, v: Any, handler, info: ValidationInfo) -> int | None:
        vocab = _vocab(info)  # the engine's vocabulary, where it tells it
        try:
            v = handler(v)
        except ValidationError:
            v = False
        if v is not None and (v is False or not 0 <= v <= vocab):
            raise invalid(f"must be an integer from 0 to {vocab} (0 disables it)")
        return v

    @field_validator("speculative")
    @classmethod
    def _speculative(cls, v: Any) -> SpeculativeParams:
        try:
            return SpeculativeParams.parse(v)
        except BadSpeculativeParams as exc:
            raise invalid(str(exc), whole=True) from None

    def sampling_spec(self, constraint: dict[str, Any] | None = None) -> SamplingSpec:
        """The request's sampling, penalties and grammar (``constraint``: from ``response_format``)."""
        try:
            params = SamplingParams(temperature=1.0 if self.temperature is None else self.temperature,
                                    top_k=self.top_k or 0, top_p=1.0 if self.top_p is None else self.top_p,
                                    seed=self.seed)
        except BadSamplingParams as exc:  # our bounds are tighter; kept as a safety net
            raise RequestError(str(exc), code="invalid_value") from None
        penalties = Penalties(presence=self.presence_penalty or 0.0, frequency=self.frequency_penalty or 0.0)
        return SamplingSpec(params, penalties, constraint)

    def params(self, constraint: dict[str, Any] | None = None, constraint_param: str | None = None
               ) -> RequestParams:
        return RequestParams(
            sampling=self.sampling_spec(constraint),
            constraint_param=constraint_param,
            max_tokens=self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens,
            stop=[s for s in self.stop or [] if s],
            stream=bool(self.stream),
            include_usage=bool(self.stream_options and self.stream_options.include_usage),
            speculative=self.speculative if self.speculative is not None else SpeculativeParams(),
            outline=self.outline or "auto",
            cloud="auto" if self.cloud is None else (float(self.cloud) if not isinstance(self.cloud, str)
                                                     else self.cloud),
        )


class TextPart(BaseModel):
    model_config = _STRICT

    type: Literal["text"]
    text: str

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, v: Any) -> Any:
        if not (isinstance(v, dict) and v.get("type") == "text"):
            raise invalid("only parts of type 'text' are supported")
        return v


class ChatMessage(BaseModel):
    model_config = _STRICT

    role: Annotated[Literal[CHAT_ROLES], described(f"one of {', '.join(CHAT_ROLES)}")] = Field(
        None, validate_default=True)
    content: list[TextPart] | None = Field(None, validate_default=True)
    tool_calls: Any = None  # an assistant's earlier calls (meshd.api.tools.history_tool_calls)
    tool_call_id: Any = None  # a tool result's (kept when a string)
    name: Any = None

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, v: Any, info: ValidationInfo) -> Any:
        if isinstance(v, str):
            return [{"type": "text", "text": v}]
        if v is None and info.data.get("role") == "assistant":
            return None  # an assistant turn that only carried tool calls
        if not isinstance(v, list):
            raise invalid("must be a string or an array of text parts")
        return v

    def history(self, where: str) -> dict[str, Any]:
        """The message as the chat template takes it (``developer`` is ``system`` there)."""
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                               "content": "".join(p.text for p in self.content or [])}
        if self.role == "assistant" and self.tool_calls:
            out["tool_calls"] = tl.history_tool_calls(self.tool_calls, f"{where}.tool_calls",
                                                      arguments_as_string=True)
        if self.role == "tool":
            out.update({k: v for k, v in (("tool_call_id", self.tool_call_id), ("name", self.name))
                        if isinstance(v, str)})
        return out


class JsonSchemaFormat(BaseModel):
    model_config = _STRICT

    name: Any = None
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: Any = None

    @model_validator(mode="before")
    @classmethod
    def _shape(cls, v: Any) -> Any:
        if not isinstance(v, dict) or not isinstance(v.get("schema"), dict):
            raise invalid("must be an object with 'name' and 'schema'")
        return v

    @field_validator("json_schema")
    @classmethod
    def _compiles(cls, v: dict[str, Any]) -> dict[str, Any]:
        try:
            validate_spec({"type": "json_schema", "schema": v})
        except BadConstraint as exc:
            raise invalid(str(exc), "invalid_schema", whole=True) from None
        return v


class ResponseFormat(BaseModel):
    model_config = _STRICT

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = Field(None, validate_default=True)

    @model_validator(mode="before")
    @classmethod
    def _kind(cls, v: Any) -> Any:
        if not isinstance(v, dict) or v.get("type") not in ("text", "json_object", "json_schema"):
            raise invalid('must be {"type": "text"}, {"type": "json_object"} or '
                          '{"type": "json_schema", "json_schema": {...}}')
        return v

    @field_validator("json_schema", mode="before")
    @classmethod
    def _needed(cls, v: Any, info: ValidationInfo) -> Any:
        if info.data.get("type") != "json_schema":
            return None  # ignored by OpenAI for the other types, too
        if v is None:
            raise invalid("must be an object with 'name' and 'schema'")
        return v

    def constraint(self) -> dict[str, Any] | None:
        """The decoding.constrained spec (None for plain text)."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return {"type": "json_object"}
        return {"type": "json_schema", "schema": self.json_schema.json_schema}


class ChatBody(_Params):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(None, validate_default=True)
    tools: Any = None  # meshd.api.tools.parse_tools (shared with the Ollama API)
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    functions: Annotated[Any, only_default(None, [])] = None  # pre-"tools" function calling
    function_call: Annotated[Any, only_default(None, "none", "auto")] = None
    top_logprobs: Annotated[Any, only_default(None, 0)] = None
    modalities: Annotated[Any, only_default(None, ["text"])] = None
    audio: Annotated[Any, only_default(None)] = None
    prediction: Annotated[Any, only_default(None)] = None

    @field_validator("messages", mode="wrap")
    @classmethod
    def _messages(cls, v: Any, handler) -> list[ChatMessage]:
        if not isinstance(v, list) or not v:
            raise invalid("must be a non-empty array of message objects")
        return handler(v)

    def request(self) -> ChatRequest:
        fmt = self.response_format
        params = self.params(fmt.constraint(), "response_format") if fmt is not None else self.params()
        try:
            messages = [m.history(f"messages[{i}]") for i, m in enumerate(self.messages)]
            tools = tl.parse_tools(self.tools)
            choice = tl.parse_tool_choice(self.tool_choice, tools)
        except tl.ToolError as exc:
            raise RequestError(str(exc), param=exc.param, code="invalid_value") from None
        if choice not in (None, "none") and params.sampling.constraint is not None:
            raise RequestError("'tool_choice' that forces a call cannot be combined with "
                               "'response_format'", param="tool_choice", code="invalid_value")
        return ChatRequest(self.model, messages, params, tools if choice != "none" else [], choice,
                           self.parallel_tool_calls is not False)


def _one_prompt(v: Any) -> Any:
    if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
        return v[0]  # a batch of one is the same request
    if isinstance(v, list) and len(v) > 1 and all(isinstance(p, str) for p in v):
        raise invalid("batches of several prompts are not supported; send one")
    return v


Prompt = Annotated[str | Annotated[list[int], Field(min_length=1)],
                   described("a string or an array of token ids"), BeforeValidator(_one_prompt)]


class CompletionBody(_Params):
    """``POST /v1/completions``."""

    prompt: Prompt = Field(None, validate_default=True)
    echo: Annotated[Any, only_default(None, False, 0)] = None
    suffix: Annotated[Any, only_default(None, "")] = None
    best_of: OneChoice | None = None

    @field_validator("prompt")
    @classmethod
    def _in_vocabulary(cls, v: str | list[int], info: ValidationInfo) -> str | list[int]:
        vocab = _vocab(info)
        bad = None if isinstance(v, str) else next((i for i, t in enumerate(v) if not 0 <= t < vocab), None)
        if bad is not None:
            raise invalid(f"token id {v[bad]} at index {bad} is outside the vocabulary [0, {vocab})",
                          show_value=False)
        return v

    def request(self) -> CompletionRequest:
        return CompletionRequest(self.model, self.prompt, self.params())


def parse_chat_request(body: dict[str, Any], *, vocab_size: int | None = None) -> ChatRequest:
    """Validate a chat request; ``vocab_size`` (the engine's, if known) bounds ``top_k``."""
    return validate(ChatBody, body, context={"vocab": vocab_size}).request()


def parse_completion_request(
    body: dict[str, Any], *, vocab_size: int | None = None
) -> CompletionRequest:
    """Validate a text completion; token-id prompts must lie in ``[0, vocab_size)``."""
    return validate(CompletionBody, body, context={"vocab": vocab_size}).request()


def checked_constraint(spec: dict[str, Any], param: str) -> dict[str, Any]:
    try:
        return validate_spec(spec)
    except BadConstraint as exc:
        raise RequestError(str(exc), param=param, code="invalid_schema") from None


def parse_speculative(value: Any, param: str) -> SpeculativeParams:
    """meshd's ``speculative`` extension field ("auto", "off" or an object)."""
    try:
        return SpeculativeParams.parse(value)
    except BadSpeculativeParams as exc:
        raise RequestError(str(exc), param=param, code="invalid_value") from None


# --------------------------------------------------------------------------- responses


def new_id(prefix: str) -> RequestId:
    """A request's id, which its response carries as ``id`` too."""
    return RequestId(f"{prefix}-{uuid.uuid4().hex[:24]}")


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
