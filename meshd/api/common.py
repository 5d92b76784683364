"""What every API dialect (OpenAI, Ollama) shares: app state, body reading, one generation's life.

``server`` (OpenAI routes, listeners, errors) and ``ollama`` (Ollama routes)
both turn a request into a :class:`~meshd.engine.GenerationRequest` with
:func:`generation_request`, which is also where a request that needs an
engine capability the engine lacks gets its 400, and both run it inside
:func:`tracked`, which does the metrics and the one ``request_done`` log line.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from decoding.tool_grammar import style_of, tool_spec
from meshd.api import openai_schema as oa
from meshd.api.metrics import ApiMetrics
from meshd.engine import Engine, EngineUnavailable, GenerationRequest, TokenEvent
from meshd.log import get_logger
from meshd.model_store import RECOMMENDED_FOR_HOME_ASSISTANT
from partition.ids import RequestId

log = get_logger("meshd.api")


@dataclass(frozen=True)
class ApiLimits:
    """Bounds that keep one misbehaving client from taking the API down.

    ``keepalive_timeout_s`` also bounds how long a connection may take to send
    a request's headers (aiohttp closes a connection still waiting for a whole
    request line and headers then), which is what stops slow-loris clients;
    ``body_timeout_s`` does the same for the body. Past ``max_connections``
    new connections get a 503 and are closed; ``backlog`` is the listen queue,
    large enough that a burst of connects is queued rather than refused.
    """

    max_body_bytes: int = 4 * 1024 * 1024
    max_json_depth: int = oa.MAX_JSON_DEPTH
    keepalive_timeout_s: float = 15.0
    body_timeout_s: float = 30.0
    max_connections: int = 256
    backlog: int = 1024
    max_line_size: int = 8190
    max_field_size: int = 8190


ENGINE = web.AppKey("engine", object)  # Engine | None
ENGINE_SET = web.AppKey("engine_set", asyncio.Event)  # set whenever an engine is installed
ENGINE_WAIT = web.AppKey("engine_wait", object)  # (seconds, still_loading() -> bool)
STATUS = web.AppKey("status_provider", object)
METRICS = web.AppKey("metrics", ApiMetrics)
LISTENING = web.AppKey("listening", dict)
LIMITS = web.AppKey("limits", ApiLimits)
AUTH = web.AppKey("auth", object)  # meshd.api.auth.Authenticator
MODEL_INFO = web.AppKey("model_info", object)  # () -> dict: file, size, digest, modified (Ollama tags)
NAMES = web.AppKey("model_names", object)  # meshd.api.names.ModelNames: the names requests may use
DEBUG = web.AppKey("debug_responses", bool)  # replies may carry internal notes (fallback reasons)


async def status_of(app: web.Application) -> dict[str, Any]:
    """The daemon's status dict (empty without a provider)."""
    import inspect

    provider = app[STATUS]
    if provider is None:
        return {}
    got = provider()
    if inspect.isawaitable(got):
        got = await got
    return dict(got or {})


async def read_json(request: web.Request) -> dict[str, Any]:
    """The body as a JSON object, read within the size and time limits.

    A declared Content-Length over the limit is refused before reading a
    byte; a chunked body is cut off by aiohttp's ``client_max_size``.
    """
    limits = request.app[LIMITS]
    if request.content_length is not None and request.content_length > limits.max_body_bytes:
        raise too_large(limits)
    try:
        async with asyncio.timeout(limits.body_timeout_s):
            raw = await request.read()
    except TimeoutError:
        raise oa.RequestError(f"the request body did not arrive within {limits.body_timeout_s:g} s",
                              status=408, code="request_timeout") from None
    return oa.parse_json_body(raw, max_depth=limits.max_json_depth)


def too_large(limits: ApiLimits) -> oa.RequestError:
    return oa.RequestError(f"request body is over the {limits.max_body_bytes} byte limit",
                           status=413, code="request_too_large")


async def await_engine(request: web.Request) -> Engine:
    """The engine, waiting (bounded) while the daemon is still loading its model."""
    app = request.app
    wait_s, loading = app[ENGINE_WAIT]
    if app[ENGINE] is None and wait_s > 0 and loading():
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait_s):
                await app[ENGINE_SET].wait()
    return engine_of(request)


def engine_of(request: web.Request) -> Engine:
    engine = request.app[ENGINE]
    if engine is None:
        raise EngineUnavailable("no model is loaded yet; the daemon is still starting or planning")
    return engine


def served_model(request: web.Request, engine: Engine, asked: str | None, *, ollama: bool) -> None:
    """A 404 in the path's dialect unless ``asked`` names the served model or an alias (``meshd.api.names``)."""
    request.app[NAMES].check(engine.model_id, asked, ollama=ollama)


def public_usage(request: web.Request, usage) -> dict[str, Any]:
    """``usage`` as a reply carries it: without internal notes unless ``debug_responses`` asks.

    A ``fallback_reason`` (why speculation fell back, e.g. Medusa heads that
    did not load) can quote files of the install or the state directory;
    clients on the LAN get the counts, the daemon's log keeps the reason.
    """
    d = usage.to_dict()
    if not request.app[DEBUG]:
        _drop_notes(d)
    return d


def _drop_notes(d: Any) -> None:
    if isinstance(d, dict):
        d.pop("fallback_reason", None)
        for v in d.values():
            _drop_notes(v)


def vocab_size(engine: Engine | None) -> int | None:
    """The vocabulary that bounds token ids and ``top_k``, where the engine tells it.

    The local engine has ``vocab_size``; the pipeline engine only has its
    model ``source``. Unknown: the schema falls back to a safe static bound.
    """
    for v in (getattr(engine, "vocab_size", None),
              getattr(getattr(getattr(engine, "source", None), "config", None), "vocab_size", None)):
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


# --------------------------------------------------------------------------- capabilities


def chat_prompt(engine: Engine, messages: list[dict[str, Any]], tools: list[dict[str, Any]],
                param: str = "tools") -> list[int]:
    """Token ids of the conversation; tools go through the model's own chat template."""
    if not tools:
        return list(engine.tokenizer.apply_chat(messages))
    if not getattr(engine.tokenizer, "supports_tools", False):
        raise oa.RequestError(
            f"tools are not supported by model '{engine.model_id}': its chat template has no tool support "
            f"(send the request without '{param}', or serve a tool-capable model such as "
            f"{RECOMMENDED_FOR_HOME_ASSISTANT})", param=param, code="tools_not_supported")
    return list(engine.tokenizer.apply_chat(messages, tools=tools))


def constrain_tool_calls(engine: Engine, params: oa.RequestParams, tools: list[dict[str, Any]],
                 choice: str | None = None, parallel: bool = True) -> None:
    """Offered tools put the answer under their grammar (``decoding.tool_grammar``).

    The model still answers in words when it wants to; a call it starts is
    written under the tools' grammar, so it always parses, names an offered
    tool and has arguments valid against that tool's schema. ``choice``
    "required" or a tool name constrains from the first token. A
    ``response_format`` already constrains the whole answer (and a forced
    choice with one was refused when parsing), so it is left as it is.
    ``params.tools_offered`` records that calls may come (outline mode stays away).
    """
    params.tools_offered = bool(tools) and choice != "none"
    if not tools or choice == "none" or params.sampling.constraint is not None:
        return
    forced = choice is not None
    if not forced and not getattr(engine, "supports_constraints", False):
        return  # calls are parsed from free text (generation_request refuses the forced case)
    meta = getattr(getattr(engine, "tokenizer", None), "meta", None)
    spec = tool_spec(tools, style_of(getattr(meta, "chat_template", None)), required=choice == "required",
                     parallel=parallel, only=choice if forced and choice != "required" else None)
    params.sampling = params.sampling.with_constraint(oa.checked_constraint(spec, "tools"))
    params.constraint_param = "tool_choice" if forced else "tools"


def generation_request(engine: Engine, rid: RequestId, prompt_ids: list[int], params: oa.RequestParams,
                       messages: list[dict] | None, *, context_limit: int | None = None,
                       penalty_param: str = "presence_penalty") -> GenerationRequest:
    """The engine request, or a 400 when it needs something the engine cannot do.

    ``context_limit`` (Ollama's ``num_ctx``) narrows the engine's context for
    this request.
    """
    if params.sampling.constraint is not None and not getattr(engine, "supports_constraints", False):
        raise oa.RequestError("structured output is not supported by this engine (yet): it cannot "
                              "constrain the tokens it samples", param=params.constraint_param,
                              code="unsupported_parameter")
    if params.sampling.penalties.active and not getattr(engine, "supports_penalties", False):
        raise oa.RequestError("repetition penalties are not supported by this engine (yet); send "
                              "them at their defaults", param=penalty_param, code="unsupported_parameter")
    if params.outline == "on" and not getattr(engine, "supports_outline", False):
        raise oa.RequestError("outline decoding needs the mesh's pipeline engine; send outline \"auto\" or "
                              "\"off\"", param="outline", code="unsupported_parameter")
    if params.outline == "on" and not messages:
        raise oa.RequestError("outline decoding needs a chat request (it asks the model for an outline of "
                              "its answer)", param="outline", code="unsupported_parameter")
    if params.cloud not in ("auto", "off") and not getattr(engine, "supports_cloud", False):
        raise oa.RequestError("cloud verification needs the mesh's pipeline engine paired with a verifier; "
                              "send cloud \"auto\" or \"off\"", param="cloud", code="unsupported_parameter")
    engine.check_prompt(prompt_ids)
    ctx = engine.context_length if context_limit is None else min(engine.context_length, context_limit)
    room = ctx - len(prompt_ids)
    if room < 1:
        raise oa.RequestError(f"the prompt is {len(prompt_ids)} tokens; the context for this request "
                              f"is {ctx}", status=400, param="messages", code="context_length_exceeded")
    return GenerationRequest(
        request_id=rid, prompt_ids=prompt_ids, max_tokens=min(params.max_tokens or room, room),
        messages=messages, sampling=params.sampling, stop=params.stop, stream=params.stream,
        speculative=params.speculative,
        outline=params.outline, tools_offered=params.tools_offered, cloud=params.cloud,
    )


# --------------------------------------------------------------------------- bookkeeping


class Run:
    """Per-request bookkeeping for metrics and the final log line."""

    def __init__(self, metrics: ApiMetrics, prompt_tokens: int, api: str, endpoint: str):
        self.metrics = metrics
        self.prompt_tokens = prompt_tokens
        self.api, self.endpoint = api, endpoint
        self.started = metrics.started()
        self.first_token_at: float | None = None
        self.tokens = 0
        self.finish: str | None = None
        self.ok = True
        self._ended = None

    def saw(self, ev: TokenEvent) -> None:
        if ev.token_id is not None:
            if self.first_token_at is None:
                self.first_token_at = self.metrics.clock()
                self.metrics.first_token()
            self.tokens += 1
        if ev.finish_reason is not None:
            self.finish = ev.finish_reason
            if ev.usage is not None:
                self.tokens = ev.usage.completion_tokens

    def end(self, ok: bool, outcome: str | None = None):
        if self._ended is None:
            self._ended = self.metrics.finished(
                self.started, self.first_token_at, self.prompt_tokens, self.tokens, ok=ok,
                api=self.api, endpoint=self.endpoint,
                outcome=outcome or ("ok" if ok else "error"))
        return self._ended


@contextlib.asynccontextmanager
async def tracked(request: web.Request, engine: Engine, gen: GenerationRequest, api: str,
                  endpoint: str):
    """Run ``gen`` on ``engine``: yields (events, run); metrics and the log line on the way out."""
    import structlog

    run = Run(request.app[METRICS], len(gen.prompt_ids), api, endpoint)
    with structlog.contextvars.bound_contextvars(request_id=gen.request_id):
        try:
            async with contextlib.aclosing(engine.stream(gen)) as events:
                yield events, run
        except asyncio.CancelledError:
            run.end(ok=False, outcome="cancelled")
            log.info("request_cancelled", reason="client disconnected", completion_tokens=run.tokens)
            raise
        except BaseException:
            run.end(ok=False)
            raise
        rec = run.end(ok=run.ok)
        log.info("request_done", api=api, endpoint=endpoint, stream=gen.stream, ok=run.ok,
                 finish_reason=run.finish, prompt_tokens=len(gen.prompt_ids),
                 completion_tokens=run.tokens,
                 ttft_s=None if rec.ttft_s is None else round(rec.ttft_s, 4),
                 decode_s=round(rec.decode_s, 4))


Clock = Callable[[], float]
