"""Ollama request bodies, and how what Ollama clients send maps to meshd's request.

Request bodies are validated by pydantic models; a validation error becomes
the same 400 as everywhere else, naming the field (``options.top_p``).
Mapping of what Ollama clients send:

* ``options``: ``temperature``/``top_k``/``top_p``/``seed``/``stop`` go to
  sampling; ``num_predict`` is ``max_tokens`` (-1: as many as fit, -2: fill
  the context); ``num_ctx`` narrows the context of the request;
  ``repeat_penalty``/``repeat_last_n``/``presence_penalty``/``frequency_penalty``
  go to the engine's penalties (400 on engines without them). Options that
  would change the answer and that meshd does not implement (``min_p``,
  ``typical_p``, ``tfs_z``, ``mirostat``) are accepted only at their "off"
  value. Options that only tune how Ollama itself loads a model on one
  machine (``num_gpu``, ``num_thread``, ``num_batch``, ``use_mmap``...) are
  accepted and have no effect: the mesh plans where layers run. Unknown
  options are a 400.
* ``format``: ``"json"`` or a JSON schema, enforced by constrained decoding.
* ``tools``: rendered by the model's chat template; calls come back in
  ``message.tool_calls``.
* ``keep_alive``: accepted (validated) and has no effect: the home's model
  stays loaded for as long as the daemon runs.
* ``think``: true/false switch a thinking model's reasoning on or off
  (Qwen3's ``enable_thinking``; absent: the model's default); true for a
  model that does not think is Ollama's 400. The reasoning comes back in
  ``thinking``, never in the answer's ``content``
  (:mod:`meshd.api.reasoning`); a message's ``thinking`` goes back into the
  prompt where the template keeps it.
* ``exit_threshold`` (meshd extension, top level or in ``options``): early exits, as on
  the OpenAI routes (0 off; absent: the daemon's ``exit_threshold``).
* ``speculative`` (meshd extension, top level or in ``options``): as on the
  OpenAI endpoints; the final message carries the speculation stats.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from decoding.penalties import Penalties
from decoding.sampling import SamplingParams, SamplingSpec
from meshd.api import tools as tl
from meshd.api.openai_fields import Cloud, ExitThreshold
from meshd.api.params import MAX_STOP_STRINGS, checked_constraint, cloud_choice, parse_speculative
from meshd.api.validation import RequestError
from meshd.engine.options import RequestOptions

# Ollama's own sampling defaults (used when a client sends no options).
DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.9}
_DURATION = re.compile(r"^-?\d+(\.\d+)?(ns|us|µs|ms|s|m|h)?$")


def _text_only(images: list[str] | None) -> list[str] | None:
    if images:
        raise ValueError("images are not supported: the served models read text only")
    return images


TextOnly = Annotated[list[str] | None, AfterValidator(_text_only)]


class Options(BaseModel):
    """Ollama ``options``; see the module docstring for what each one does here."""

    model_config = ConfigDict(extra="forbid")

    temperature: float | None = Field(None, ge=0, le=5)
    top_k: int | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    num_predict: int | None = Field(None, ge=-2)
    num_ctx: int | None = Field(None, ge=1)
    stop: list[str] | None = Field(None, max_length=MAX_STOP_STRINGS)
    repeat_penalty: float | None = Field(None, gt=0, le=10)
    repeat_last_n: int | None = Field(None, ge=-1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    speculative: Any = None  # meshd extension; parsed with SpeculativeParams
    exit_threshold: ExitThreshold | None = None  # meshd extension: early exits (also at the top level)
    # Would change the answer; meshd implements only their "off" value.
    min_p: float | None = None
    typical_p: float | None = None
    tfs_z: float | None = None
    mirostat: int | None = None
    mirostat_tau: float | None = None  # inert unless mirostat is on
    mirostat_eta: float | None = None
    penalize_newline: bool | None = None  # inert in Ollama since 0.4
    num_keep: int | None = None  # only used when Ollama shifts an overfull context; we refuse those
    # How Ollama loads a model on one machine; the mesh plans placement itself.
    num_batch: int | None = None
    num_gpu: int | None = None
    main_gpu: int | None = None
    low_vram: bool | None = None
    f16_kv: bool | None = None
    vocab_only: bool | None = None
    use_mmap: bool | None = None
    use_mlock: bool | None = None
    num_thread: int | None = None
    numa: bool | None = None

    @field_validator("min_p", "typical_p", "tfs_z", "mirostat")
    @classmethod
    def _off_only(cls, v, info):
        off = {"min_p": 0.0, "typical_p": 1.0, "tfs_z": 1.0, "mirostat": 0}[info.field_name]
        if v is not None and v != off:
            raise ValueError(f"meshd does not implement {info.field_name}; only {off} (off) is accepted")
        return v


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = ""
    images: TextOnly = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_name: str | None = None
    thinking: str | None = None  # a thinking model's earlier reasoning (the template decides if it is kept)



class GenerationBody(BaseModel):
    """What ``/api/chat`` and ``/api/generate`` share: the model, streaming, options, extensions."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field("", max_length=512)
    stream: bool = True  # Ollama streams unless told not to
    format: str | dict[str, Any] | None = None
    options: Options | None = None
    keep_alive: int | float | str | None = None
    think: bool | str | None = None
    speculative: Any = None  # meshd extension
    outline: Literal["auto", "on", "off"] | None = None  # meshd extension: outline-based parallel decoding
    cloud: Cloud | None = None  # meshd extension: a paired cloud verifier ("auto", "off", budget 0..1)
    exit_threshold: ExitThreshold | None = None  # meshd extension: early exits (0 off; None the daemon's)

    @field_validator("keep_alive")
    @classmethod
    def _duration(cls, v):
        if isinstance(v, str) and not _DURATION.match(v.strip()):
            raise ValueError("must be a duration such as '5m', '300s', '-1' or a number of seconds")
        return v


class ChatBody(GenerationBody):
    messages: list[Message] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None


class GenerateBody(GenerationBody):
    prompt: str = ""
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool = False
    images: TextOnly = None

    @field_validator("suffix", "template")
    @classmethod
    def _unsupported(cls, v, info):
        if v:
            raise ValueError(f"'{info.field_name}' is not supported by meshd")
        return v



class NameBody(BaseModel):
    model_config = ConfigDict(extra="allow")  # /api/show's "verbose", /api/pull's "insecure"...

    model: str | None = Field(None, max_length=512)
    name: str | None = Field(None, max_length=512)  # the older spelling of "model"
    stream: bool = True

    @property
    def target(self) -> str:
        return self.model or self.name or ""



def sampling_spec(body: GenerationBody, vocab: int | None) -> SamplingSpec:
    """Ollama's options and ``format`` -> the request's sampling, penalties and grammar."""
    o = body.options or Options()
    temperature = DEFAULTS["temperature"] if o.temperature is None else o.temperature
    top_k = DEFAULTS["top_k"] if o.top_k is None else o.top_k
    if vocab and top_k > vocab:
        raise RequestError(f"'options.top_k' must be at most the vocabulary size {vocab}",
                           param="options.top_k", code="invalid_value")
    params = SamplingParams(temperature=temperature, top_k=top_k,
                            top_p=DEFAULTS["top_p"] if o.top_p is None else o.top_p, seed=o.seed)
    penalties = Penalties(presence=o.presence_penalty or 0.0, frequency=o.frequency_penalty or 0.0,
                          repeat=1.0 if o.repeat_penalty is None else o.repeat_penalty,
                          repeat_last_n=64 if o.repeat_last_n is None else o.repeat_last_n)
    constraint = None
    if body.format not in (None, ""):
        if body.format == "json":
            constraint = {"type": "json_object"}
        elif isinstance(body.format, dict):
            constraint = checked_constraint({"type": "json_schema", "schema": body.format}, "format")
        else:
            raise RequestError("'format' must be \"json\" or a JSON schema object", param="format",
                               code="invalid_value")
    return SamplingSpec(params, penalties, constraint)


def request_options(body: GenerationBody, vocab: int | None) -> tuple[RequestOptions, int | None]:
    """Ollama's options and fields -> (the request's options, num_ctx)."""
    o = body.options or Options()
    sampling = sampling_spec(body, vocab)
    if o.num_predict == 0:
        raise RequestError("'options.num_predict' 0 generates nothing; use -1 for no limit",
                           param="options.num_predict", code="invalid_value")
    if body.speculative is not None and o.speculative is not None:
        raise RequestError("'speculative' given both at the top level and in options",
                           param="speculative", code="invalid_value")
    spec_param = "speculative" if body.speculative is not None else "options.speculative"
    top = getattr(body, "exit_threshold", None)
    if top is not None and o.exit_threshold is not None:
        raise RequestError("'exit_threshold' given both at the top level and in options",
                           param="exit_threshold", code="invalid_value")
    return RequestOptions(
        sampling=sampling, stream=body.stream,
        constraint_param="format" if sampling.constraint is not None else None,
        max_tokens=o.num_predict if o.num_predict is not None and o.num_predict > 0 else None,
        stop=tuple(s for s in (o.stop or []) if s),
        speculative=parse_speculative(body.speculative if body.speculative is not None else o.speculative,
                                      spec_param),
        outline=getattr(body, "outline", None) or "auto",
        cloud=cloud_choice(getattr(body, "cloud", None)),
        exit_threshold=top if top is not None else o.exit_threshold,
    ), o.num_ctx


def history(messages: list[Message]) -> list[dict[str, Any]]:
    out = []
    for i, m in enumerate(messages):
        d: dict[str, Any] = {"role": m.role, "content": m.content or ""}
        if m.role == "assistant" and m.tool_calls:
            try:
                d["tool_calls"] = tl.history_tool_calls(m.tool_calls, f"messages[{i}].tool_calls",
                                                        arguments_as_string=False)
            except tl.ToolError as exc:
                raise exc.as_request_error() from None
        if m.role == "tool" and m.tool_name:
            d["name"] = m.tool_name
        if m.role == "assistant" and m.thinking:
            d["reasoning_content"] = m.thinking
        out.append(d)
    return out

