"""The Ollama API, so Home Assistant's Ollama integration (and any Ollama client) can use meshd.

Routes: ``/api/version``, ``/api/tags``, ``/api/show``, ``/api/ps``,
``/api/chat`` and ``/api/generate`` (NDJSON streaming by default, as
Ollama), ``/api/pull``, and ``GET /`` ("Ollama is running"). Errors are
Ollama's ``{"error": "..."}`` (the server's middleware picks the dialect by
path). A model name the home does not serve (nor alias) is Ollama's 404
``model "X" not found, try pulling it first`` (:mod:`meshd.api.names`), and
``/api/pull`` of it says why it cannot be pulled here.

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
* ``think``: only false/absent; the served models do not think (Ollama
  answers the same 400 for non-thinking models).
* ``speculative`` (meshd extension, top level or in ``options``): as on the
  OpenAI endpoints; the final message carries the speculation stats.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from datetime import datetime, timezone
from typing import Any, Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, field_validator

from decoding.penalties import Penalties
from decoding.sampling import SamplingParams, SamplingSpec
from meshd.api import openai_schema as oa
from meshd.api import tools as tl
from meshd.api.common import (
    ENGINE, MODEL_INFO, NAMES, await_engine, chat_prompt, generation_request, log, public_usage,
    read_json, served_model, constrain_tool_calls, tracked, vocab_size,
)
from meshd.api.names import name_key
from meshd.api.names import tagged as _tagged
from meshd.api.validation import validate
from meshd.engine import Engine, EngineError, TokenEvent

OLLAMA_API_VERSION = "0.12.0"  # the Ollama API release whose endpoints and fields we mirror
NDJSON = "application/x-ndjson"
# Ollama's own sampling defaults (used when a client sends no options).
DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.9}
_DURATION = re.compile(r"^-?\d+(\.\d+)?(ns|us|µs|ms|s|m|h)?$")


def add_routes(app: web.Application) -> None:
    app.router.add_get("/", _root)  # also answers HEAD
    app.router.add_get("/api/version", _version)
    app.router.add_get("/api/tags", _tags)
    app.router.add_post("/api/show", _show)
    app.router.add_get("/api/ps", _ps)
    app.router.add_post("/api/chat", _chat)
    app.router.add_post("/api/generate", _generate)
    app.router.add_post("/api/pull", _pull)
    for path in ("/api/embed", "/api/embeddings", "/api/create", "/api/copy", "/api/push"):
        app.router.add_post(path, _not_implemented)
    app.router.add_delete("/api/delete", _not_implemented)


# --------------------------------------------------------------------------- request models


class Options(BaseModel):
    """Ollama ``options``; see the module docstring for what each one does here."""

    model_config = ConfigDict(extra="forbid")

    temperature: float | None = Field(None, ge=0, le=5)
    top_k: int | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    num_predict: int | None = Field(None, ge=-2)
    num_ctx: int | None = Field(None, ge=1)
    stop: list[str] | None = Field(None, max_length=oa.MAX_STOP_STRINGS)
    repeat_penalty: float | None = Field(None, gt=0, le=10)
    repeat_last_n: int | None = Field(None, ge=-1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    speculative: Any = None  # meshd extension; parsed with SpeculativeParams
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
    images: list[str] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_name: str | None = None
    thinking: str | None = None  # a thinking model's earlier reasoning; templates here drop it

    @field_validator("images")
    @classmethod
    def _no_images(cls, v):
        if v:
            raise ValueError("images are not supported: the served models read text only")
        return v


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field("", max_length=512)
    stream: bool = True  # Ollama streams unless told not to
    format: str | dict[str, Any] | None = None
    options: Options | None = None
    keep_alive: int | float | str | None = None
    think: bool | str | None = None
    speculative: Any = None  # meshd extension
    outline: Literal["auto", "on", "off"] | None = None  # meshd extension: outline-based parallel decoding
    cloud: oa.Cloud | None = None  # meshd extension: a paired cloud verifier ("auto", "off", budget 0..1)

    @field_validator("keep_alive")
    @classmethod
    def _duration(cls, v):
        if isinstance(v, str) and not _DURATION.match(v.strip()):
            raise ValueError("must be a duration such as '5m', '300s', '-1' or a number of seconds")
        return v

    @field_validator("think")
    @classmethod
    def _no_thinking(cls, v):
        if v not in (None, False):
            raise ValueError("the served model does not support thinking")
        return v


class ChatBody(_Common):
    messages: list[Message] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None


class GenerateBody(_Common):
    prompt: str = ""
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool = False
    images: list[str] | None = None

    @field_validator("suffix", "template")
    @classmethod
    def _unsupported(cls, v, info):
        if v:
            raise ValueError(f"'{info.field_name}' is not supported by meshd")
        return v

    @field_validator("images")
    @classmethod
    def _no_images(cls, v):
        if v:
            raise ValueError("images are not supported: the served models read text only")
        return v


class NameBody(BaseModel):
    model_config = ConfigDict(extra="allow")  # /api/show's "verbose", /api/pull's "insecure"...

    model: str | None = Field(None, max_length=512)
    name: str | None = Field(None, max_length=512)  # the older spelling of "model"
    stream: bool = True

    @property
    def target(self) -> str:
        return self.model or self.name or ""


# --------------------------------------------------------------------------- model metadata


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _source(engine: Engine):
    return getattr(engine, "source", None)


def _details(engine: Engine) -> dict[str, Any]:
    src = _source(engine)
    cfg = getattr(src, "config", None)
    arch = getattr(cfg, "arch", None) or "unknown"
    return {"parent_model": "", "format": "gguf" if str(getattr(src, "path", "")).endswith(".gguf") else "",
            "family": arch, "families": [arch], "parameter_size": _param_size(cfg),
            "quantization_level": _quant(src)}


def _param_count(cfg) -> int | None:
    if cfg is None:
        return None
    h, i, n, v = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.vocab_size
    kv = cfg.num_kv_heads * cfg.head_dim
    per_layer = h * (cfg.num_heads * cfg.head_dim) * 2 + h * kv * 2 + 3 * h * i + 2 * h
    return n * per_layer + v * h * (1 if cfg.tie_embeddings else 2) + h


def _param_size(cfg) -> str:
    n = _param_count(cfg)
    if not n:
        return ""
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"


def _quant(src) -> str:
    try:
        import gguf

        return gguf.LlamaFileType(int(src._field("general.file_type"))).name.removeprefix("MOSTLY_")
    except Exception:  # noqa: BLE001 - metadata only: unknown is an honest answer
        return ""


def _file_info(request: web.Request, engine: Engine) -> dict[str, Any]:
    """size, digest, modified_at of the served model file (from the daemon, or the engine's source)."""
    provider = request.app[MODEL_INFO]
    if provider is not None:
        return dict(provider())
    src = _source(engine)
    path = getattr(src, "path", None)
    info: dict[str, Any] = {"size": 0, "digest": "", "modified_at": _now()}
    with contextlib.suppress(OSError, TypeError, AttributeError):
        st = path.stat()
        info["size"] = st.st_size
        info["modified_at"] = datetime.fromtimestamp(st.st_mtime, timezone.utc).isoformat()
    ident = str(getattr(src, "identity", "") or "")
    info["digest"] = ident.rpartition("@")[2]
    return info


def _model_entry(request: web.Request, engine: Engine, name: str | None = None) -> dict[str, Any]:
    f = _file_info(request, engine)
    name = _tagged(name or engine.model_id)
    return {"name": name, "model": name, "modified_at": f["modified_at"], "size": f["size"],
            "digest": f["digest"], "details": _details(engine)}


def _capabilities(engine: Engine) -> list[str]:
    caps = ["completion"]
    if getattr(engine.tokenizer, "supports_tools", False):
        caps.append("tools")
    return caps


# --------------------------------------------------------------------------- metadata routes


async def _root(request: web.Request) -> web.Response:
    return web.Response(text="Ollama is running (meshd)")


async def _version(request: web.Request) -> web.Response:
    from meshd import __version__

    return web.json_response({"version": OLLAMA_API_VERSION, "meshd": __version__})


async def _tags(request: web.Request) -> web.Response:
    """The served model, then each configured alias (as Ollama lists a copy: same digest).

    Home Assistant looks its configured model up here and pulls it when absent.
    """
    engine = request.app[ENGINE]
    names = request.app[NAMES].listed(engine.model_id) if engine else []
    return web.json_response({"models": [_model_entry(request, engine, n) for n in names]})


async def _ps(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    if engine is None:
        return web.json_response({"models": []})
    entry = _model_entry(request, engine)
    entry.update({"expires_at": "2318-01-01T00:00:00Z",  # loaded while the daemon runs
                  "size_vram": 0, "context_length": engine.context_length})
    return web.json_response({"models": [entry]})


async def _show(request: web.Request) -> web.Response:
    body = validate(NameBody, await read_json(request))
    engine = await await_engine(request)
    served_model(request, engine, body.target, ollama=True)
    src = _source(engine)
    cfg = getattr(src, "config", None)
    arch = getattr(cfg, "arch", "unknown")
    info: dict[str, Any] = {"general.architecture": arch,
                            "general.parameter_count": _param_count(cfg) or 0,
                            f"{arch}.context_length": engine.context_length}
    if cfg is not None:
        info.update({f"{arch}.embedding_length": cfg.hidden_size, f"{arch}.block_count": cfg.num_layers,
                     f"{arch}.attention.head_count": cfg.num_heads,
                     f"{arch}.attention.head_count_kv": cfg.num_kv_heads,
                     f"{arch}.vocab_size": cfg.vocab_size})
    template = getattr(getattr(engine.tokenizer, "meta", None), "chat_template", None) or ""
    params = "\n".join(f"{k:<15} {v}" for k, v in DEFAULTS.items())
    f = _file_info(request, engine)
    # FROM names the model, not its file: where the daemon keeps it is not for clients.
    return web.json_response({
        "license": "", "modelfile": f"# served by meshd as {body.target or engine.model_id}\n"
                                    f"FROM {engine.model_id}\n",
        "parameters": params, "template": template, "details": _details(engine),
        "model_info": info, "capabilities": _capabilities(engine), "modified_at": f["modified_at"],
    })


async def _not_implemented(request: web.Request) -> web.Response:
    raise oa.RequestError(f"{request.path} is not implemented by meshd (it serves one chat model "
                          f"for the home; models are managed with 'meshd model')", status=501,
                          code="not_implemented")


# --------------------------------------------------------------------------- pull


async def _pull(request: web.Request) -> web.StreamResponse:
    """Success for a name the home serves (it is there); Ollama's pull error for any other.

    Nothing is downloaded: a home serves one model, held by every member, so
    fetching another onto this device would change nothing a client can use
    and would report a success that ``/api/chat`` then contradicts. A catalog
    model gets the commands that do switch the home; any other name, Ollama's
    own "file does not exist". Errors take Ollama's two forms: streamed, a
    ``{"error": ...}`` line in a 200 NDJSON reply; not streamed, a 500 with
    the same object (the status Ollama answers a failed pull with).
    """
    from meshd import model_store

    body = validate(NameBody, await read_json(request))
    engine = await await_engine(request)
    served, names = engine.model_id, request.app[NAMES]
    if body.target.strip() and names.known(served, body.target):
        if body.stream:
            return await _ndjson(request, [{"status": "success"}])
        return web.json_response({"status": "success"})
    name, wanted = body.target.strip(), name_key(body.target)
    if wanted in model_store.CATALOG:
        message = (f"{wanted} is not the model this home serves ({served}), and a pull through the API "
                   f"cannot change that: every member holds the home's one model. To serve {wanted}, run "
                   f"'meshd model pull {wanted}' on each member and restart them with --model {wanted}")
    else:
        listed = ", ".join(names.listed(served))
        message = (f"pull model manifest: file does not exist: meshd cannot fetch {name!r}; this home "
                   f"serves {listed} (the config's model_aliases can admit other names)")
    log.warning("ollama_pull_refused", model=name, served=served)
    if body.stream:
        return await _ndjson(request, [{"error": message}])
    return web.json_response({"error": message}, status=500)


async def _ndjson(request: web.Request, objs: list[dict]) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": NDJSON})
    await resp.prepare(request)
    for o in objs:
        await resp.write(_line(o))
    await resp.write_eof()
    return resp


def _line(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"


# --------------------------------------------------------------------------- generation


def _sampling_spec(body: _Common, vocab: int | None) -> SamplingSpec:
    """Ollama's options and ``format`` -> the request's sampling, penalties and grammar."""
    o = body.options or Options()
    temperature = DEFAULTS["temperature"] if o.temperature is None else o.temperature
    top_k = DEFAULTS["top_k"] if o.top_k is None else o.top_k
    if vocab and top_k > vocab:
        raise oa.RequestError(f"'options.top_k' must be at most the vocabulary size {vocab}",
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
            constraint = oa.checked_constraint({"type": "json_schema", "schema": body.format}, "format")
        else:
            raise oa.RequestError("'format' must be \"json\" or a JSON schema object", param="format",
                                  code="invalid_value")
    return SamplingSpec(params, penalties, constraint)


def _params(body: _Common, vocab: int | None) -> tuple[oa.RequestParams, int | None]:
    """Ollama's options and fields -> (our request params, num_ctx)."""
    o = body.options or Options()
    sampling = _sampling_spec(body, vocab)
    p = oa.RequestParams(sampling=sampling, stream=body.stream,
                         constraint_param="format" if sampling.constraint is not None else None)
    p.max_tokens = o.num_predict if o.num_predict is not None and o.num_predict > 0 else None
    if o.num_predict == 0:
        raise oa.RequestError("'options.num_predict' 0 generates nothing; use -1 for no limit",
                              param="options.num_predict", code="invalid_value")
    p.stop = [s for s in (o.stop or []) if s]
    if body.speculative is not None and o.speculative is not None:
        raise oa.RequestError("'speculative' given both at the top level and in options",
                              param="speculative", code="invalid_value")
    spec_param = "speculative" if body.speculative is not None else "options.speculative"
    p.speculative = oa.parse_speculative(body.speculative if body.speculative is not None
                                         else o.speculative, spec_param)
    p.outline = getattr(body, "outline", None) or "auto"
    cloud = getattr(body, "cloud", None)
    p.cloud = "auto" if cloud is None else (cloud if isinstance(cloud, str) else float(cloud))
    return p, o.num_ctx


def _history(messages: list[Message]) -> list[dict[str, Any]]:
    out = []
    for i, m in enumerate(messages):
        d: dict[str, Any] = {"role": m.role, "content": m.content or ""}
        if m.role == "assistant" and m.tool_calls:
            try:
                d["tool_calls"] = tl.history_tool_calls(m.tool_calls, f"messages[{i}].tool_calls",
                                                        arguments_as_string=False)
            except tl.ToolError as exc:
                raise oa.RequestError(str(exc), param=exc.param, code="invalid_value") from None
        if m.role == "tool" and m.tool_name:
            d["name"] = m.tool_name
        out.append(d)
    return out


async def _chat(request: web.Request) -> web.StreamResponse:
    body = validate(ChatBody, await read_json(request))
    engine = await await_engine(request)
    served_model(request, engine, body.model, ollama=True)
    params, num_ctx = _params(body, vocab_size(engine))
    if not body.messages:  # Ollama: an empty chat loads the model and answers at once
        return await _loaded(engine, body, "chat")
    try:
        tools = tl.parse_tools(body.tools)
    except tl.ToolError as exc:
        raise oa.RequestError(str(exc), param=exc.param, code="invalid_value") from None
    messages = _history(body.messages)
    prompt_ids = chat_prompt(engine, messages, tools)
    constrain_tool_calls(engine, params, tools)
    return await _run(request, engine, body, params, num_ctx, prompt_ids, messages,
                      tl.tool_names(tools), "chat")


async def _generate(request: web.Request) -> web.StreamResponse:
    body = validate(GenerateBody, await read_json(request))
    engine = await await_engine(request)
    served_model(request, engine, body.model, ollama=True)
    params, num_ctx = _params(body, vocab_size(engine))
    if not body.prompt and not body.context:
        return await _loaded(engine, body, "generate")
    vocab = vocab_size(engine) or oa.MAX_VOCAB
    context = list(body.context or [])
    bad = next((t for t in context if not 0 <= t < vocab), None)
    if bad is not None:
        raise oa.RequestError(f"'context' holds token id {bad}, outside the vocabulary [0, {vocab})",
                              param="context", code="invalid_value")
    if body.raw:
        prompt_ids = context + list(engine.tokenizer.encode(body.prompt))
        messages = None
    else:
        messages = ([{"role": "system", "content": body.system}] if body.system else []) + [
            {"role": "user", "content": body.prompt}]
        prompt_ids = context + chat_prompt(engine, messages, [])
    return await _run(request, engine, body, params, num_ctx, prompt_ids, messages, [], "generate")


async def _loaded(engine: Engine, body: _Common, kind: str) -> web.Response:
    out: dict[str, Any] = {"model": body.model or _tagged(engine.model_id), "created_at": _now(), "done": True,
                           "done_reason": "load"}
    if kind == "chat":
        out["message"] = {"role": "assistant", "content": ""}
    else:
        out["response"] = ""
    return web.json_response(out)


def _part(kind: str, model: str, text: str) -> dict[str, Any]:
    base: dict[str, Any] = {"model": model, "created_at": _now()}
    if kind == "chat":
        base["message"] = {"role": "assistant", "content": text}
    else:
        base["response"] = text
    base["done"] = False
    return base


def _final(request: web.Request, kind: str, model: str, ev: TokenEvent, run, started_ns: int,
           prompt_ids: list[int], generated: list[int], calls: list[tl.ToolCall]) -> dict[str, Any]:
    out = _part(kind, model, "")
    now_ns = time.monotonic_ns()
    first_ns = int(run.first_token_at * 1e9) if run.first_token_at is not None else now_ns
    start_ns = int(run.started * 1e9)
    usage = ev.usage
    out.update({
        "done": True,
        "done_reason": ev.finish_reason,
        "total_duration": now_ns - started_ns,
        "load_duration": 0,
        "prompt_eval_count": usage.prompt_tokens if usage else len(prompt_ids),
        "prompt_eval_duration": max(0, first_ns - start_ns),
        "eval_count": usage.completion_tokens if usage else 0,
        "eval_duration": max(0, now_ns - first_ns),
    })
    if kind == "generate":
        out["context"] = [*prompt_ids, *generated]
    if usage is not None and usage.speculative is not None:
        out["speculative"] = public_usage(request, usage)["speculative"]  # meshd extension
    if usage is not None and usage.outline is not None:
        out["outline"] = dict(usage.outline)  # meshd extension: how an outline attempt went
    return out


async def _run(request: web.Request, engine: Engine, body: _Common, params: oa.RequestParams,
               num_ctx: int | None, prompt_ids: list[int], messages, offered: list[str],
               kind: str) -> web.StreamResponse:
    started_ns = time.monotonic_ns()
    rid = oa.new_id("ollama")
    gen = generation_request(engine, rid, prompt_ids, params, messages, context_limit=num_ctx,
                             penalty_param="options.repeat_penalty")
    model = body.model or _tagged(engine.model_id)
    filt = tl.ToolStreamFilter(offered)
    generated: list[int] = []
    async with tracked(request, engine, gen, "ollama", f"/api/{kind}") as (events, run):
        first = await anext(events)  # errors before the first token keep their HTTP status
        run.saw(first)
        resp: web.StreamResponse | None = None
        if body.stream:
            resp = web.StreamResponse(headers={"Content-Type": NDJSON, "X-Request-Id": rid})
            await resp.prepare(request)
        parts: list[str] = []
        ev: TokenEvent | None = first
        try:
            while ev is not None:
                if ev.token_id is not None:
                    generated.append(ev.token_id)
                if ev.finish_reason is not None:
                    text = filt.feed(ev.text)
                    tail, calls = filt.finish()
                    parts.append(text + tail)
                    if resp is not None:
                        if text + tail:
                            await resp.write(_line(_part(kind, model, text + tail)))
                        if calls:
                            msg = _part(kind, model, "")
                            msg["message"]["tool_calls"] = [c.ollama() for c in calls]
                            await resp.write(_line(msg))
                        await resp.write(_line(_final(request, kind, model, ev, run, started_ns, prompt_ids,
                                                      generated, calls)))
                        await resp.write_eof()
                        return resp
                    final = _final(request, kind, model, ev, run, started_ns, prompt_ids, generated, calls)
                    content = "".join(parts)
                    if kind == "chat":
                        final["message"] = {"role": "assistant", "content": content}
                        if calls:
                            final["message"]["tool_calls"] = [c.ollama() for c in calls]
                    else:
                        final["response"] = content
                    return web.json_response(final)
                text = filt.feed(ev.text)
                if text:
                    if resp is not None:
                        await resp.write(_line(_part(kind, model, text)))
                    else:
                        parts.append(text)
                ev = await anext(events, None)
                if ev is not None:
                    run.saw(ev)
        except ConnectionResetError:
            run.ok = False
            log.info("request_cancelled", reason="client disconnected", completion_tokens=run.tokens)
            return resp or web.Response(status=499)
        except EngineError as exc:
            if resp is None:
                raise
            run.ok = False  # headers are gone: Ollama reports a failure in-band
            log.warning("api_request_failed_in_stream", path=request.path, error=str(exc))
            with contextlib.suppress(ConnectionResetError):
                await resp.write(_line({"error": str(exc)}))
                await resp.write_eof()
            return resp
        raise EngineError("the engine ended without a final event")
