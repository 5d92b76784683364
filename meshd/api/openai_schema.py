"""OpenAI request bodies: strict validation, then the request the routes serve.

Request bodies are validated by strict pydantic models (``ChatBody``,
``CompletionBody``; errors become 400s through ``meshd.api.validation``, as
in the Ollama API). Validation is strict about what we cannot honour and
lenient only about what cannot change the answer (``user``, ``metadata``,
``store``, and fields OpenAI adds that we do not know), because OpenAI
clients send many optional fields and must work unchanged. Nothing we accept
is silently ignored: a field we do not implement (``logit_bias``,
``logprobs``...) is accepted at its default value and rejected with a 400
"not supported" otherwise (:mod:`meshd.api.openai_fields`); fields that need
an engine capability (structured output, penalties) are parsed here and
checked against the engine by :mod:`meshd.api.generation`. Every rejection
names the offending field in ``param`` so a client author sees what to fix.
The raw body was bounded before any of this (:mod:`meshd.api.json_body`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel, BeforeValidator, Field, ValidationError, ValidationInfo, field_validator, model_validator,
)

from decoding.constrained import BadConstraint, validate_spec
from decoding.errors import BadSpeculativeParams
from decoding.penalties import Penalties
from decoding.sampling import BadSamplingParams, SamplingParams, SamplingSpec
from decoding.speculative.params import SpeculativeParams
from meshd.api import tools as tl
from meshd.api.openai_fields import (
    STRICT, Cloud, ExitThreshold, MaxTokens, OneChoice, Penalty, Seed, Stop, Temperature, TopP, only_default, vocab_bound,
)
from meshd.api.params import cloud_choice
from meshd.api.validation import RequestError, described, invalid, validate
from meshd.engine.options import RequestOptions

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass
class ChatRequest:
    model: str | None
    messages: list[dict[str, Any]]
    options: RequestOptions
    tools: list[dict[str, Any]] = field(default_factory=list)  # validated, for the chat template
    tool_choice: str | None = None  # None (auto), "none", "required" or a tool name
    parallel_tool_calls: bool = True
    template_variables: dict[str, Any] = field(default_factory=dict)  # chat_template_kwargs: enable_thinking


@dataclass
class CompletionRequest:
    model: str | None
    prompt: str | list[int]
    options: RequestOptions


class StreamOptions(BaseModel):
    model_config = STRICT

    include_usage: bool | None = None


class _Params(BaseModel):
    """What chat and text completions share: sampling, length, stop, streaming, extensions."""

    model_config = STRICT

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
    exit_threshold: ExitThreshold | None = None  # meshd's extension: early exits (0 off; None the daemon's)
    logit_bias: Annotated[Any, only_default(None, {})] = None
    logprobs: Annotated[Any, only_default(None, False, 0)] = None
    # Lenient: they cannot change the answer.
    user: Any = None
    metadata: Any = None
    store: Any = None

    @field_validator("top_k", mode="wrap")
    @classmethod
    def _top_k(cls, v: Any, handler, info: ValidationInfo) -> int | None:
        vocab = vocab_bound(info)  # the engine's vocabulary, where it tells it
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

    def options(self, constraint: dict[str, Any] | None = None, constraint_param: str | None = None
               ) -> RequestOptions:
        return RequestOptions(
            sampling=self.sampling_spec(constraint),
            constraint_param=constraint_param,
            max_tokens=self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens,
            stop=tuple(s for s in self.stop or [] if s),
            stream=bool(self.stream),
            include_usage=bool(self.stream_options and self.stream_options.include_usage),
            speculative=self.speculative if self.speculative is not None else SpeculativeParams(),
            outline=self.outline or "auto",
            cloud=cloud_choice(self.cloud),
            exit_threshold=self.exit_threshold,
        )


class TextPart(BaseModel):
    model_config = STRICT

    type: Literal["text"]
    text: str

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, v: Any) -> Any:
        if not (isinstance(v, dict) and v.get("type") == "text"):
            raise invalid("only parts of type 'text' are supported")
        return v


class ChatMessage(BaseModel):
    model_config = STRICT

    role: Annotated[Literal[CHAT_ROLES], described(f"one of {', '.join(CHAT_ROLES)}")] = Field(
        None, validate_default=True)
    content: list[TextPart] | None = Field(None, validate_default=True)
    tool_calls: Any = None  # an assistant's earlier calls (meshd.api.tools.history_tool_calls)
    tool_call_id: Any = None  # a tool result's (kept when a string)
    name: Any = None
    reasoning_content: Any = None  # a thinking model's earlier reasoning, as replies carry it (kept when a string)

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
        if self.role == "assistant" and isinstance(self.reasoning_content, str) and self.reasoning_content:
            out["reasoning_content"] = self.reasoning_content
        if self.role == "tool":
            out.update({k: v for k, v in (("tool_call_id", self.tool_call_id), ("name", self.name))
                        if isinstance(v, str)})
        return out


class JsonSchemaFormat(BaseModel):
    model_config = STRICT

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
    model_config = STRICT

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
    # vLLM's and llama.cpp's switch for a thinking model's reasoning (Qwen3's enable_thinking).
    chat_template_kwargs: Any = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_switches(cls, v: Any) -> Any:
        if v is None:
            return v
        if not isinstance(v, dict) or set(v) - {"enable_thinking"} or not all(isinstance(x, bool) for x in v.values()):
            raise invalid("only {\"enable_thinking\": true|false} is accepted (a thinking model's reasoning on "
                          "or off)")
        return v

    @field_validator("messages", mode="wrap")
    @classmethod
    def _messages(cls, v: Any, handler) -> list[ChatMessage]:
        if not isinstance(v, list) or not v:
            raise invalid("must be a non-empty array of message objects")
        return handler(v)

    def request(self) -> ChatRequest:
        fmt = self.response_format
        options = self.options(fmt.constraint(), "response_format") if fmt is not None else self.options()
        try:
            messages = [m.history(f"messages[{i}]") for i, m in enumerate(self.messages)]
            tools = tl.parse_tools(self.tools)
            choice = tl.parse_tool_choice(self.tool_choice, tools)
        except tl.ToolError as exc:
            raise exc.as_request_error() from None
        if choice not in (None, "none") and options.sampling.constraint is not None:
            raise RequestError("'tool_choice' that forces a call cannot be combined with "
                               "'response_format'", param="tool_choice", code="invalid_value")
        return ChatRequest(self.model, messages, options, tools if choice != "none" else [], choice,
                           self.parallel_tool_calls is not False, dict(self.chat_template_kwargs or {}))


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
        vocab = vocab_bound(info)
        bad = None if isinstance(v, str) else next((i for i, t in enumerate(v) if not 0 <= t < vocab), None)
        if bad is not None:
            raise invalid(f"token id {v[bad]} at index {bad} is outside the vocabulary [0, {vocab})",
                          show_value=False)
        return v

    def request(self) -> CompletionRequest:
        return CompletionRequest(self.model, self.prompt, self.options())


def parse_chat_request(body: dict[str, Any], *, vocab_size: int | None = None) -> ChatRequest:
    """Validate a chat request; ``vocab_size`` (the engine's, if known) bounds ``top_k``."""
    return validate(ChatBody, body, context={"vocab": vocab_size}).request()


def parse_completion_request(
    body: dict[str, Any], *, vocab_size: int | None = None
) -> CompletionRequest:
    """Validate a text completion; token-id prompts must lie in ``[0, vocab_size)``."""
    return validate(CompletionBody, body, context={"vocab": vocab_size}).request()
