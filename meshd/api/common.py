"""What every handler of both dialects (OpenAI, Ollama) needs from the app.

The app's state keys, the limits that bound a client, the request body read
within them, the engine (waiting while the daemon loads it), and the check
that a request names the served model. A request then becomes a generation in
:mod:`meshd.api.generation` and is served through :mod:`meshd.api.answer`.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from meshd.api.json_body import MAX_JSON_DEPTH, parse_json_body
from meshd.api.metrics import ApiMetrics, MeshCollector
from meshd.api.validation import RequestError
from meshd.engine.base import Engine
from meshd.engine.errors import EngineUnavailable
from meshd.log import get_logger

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
    max_json_depth: int = MAX_JSON_DEPTH
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
MESH = web.AppKey("mesh_collector", MeshCollector)  # mesh gauges, refreshed when /metrics is scraped


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
        raise RequestError(f"the request body did not arrive within {limits.body_timeout_s:g} s",
                           status=408, code="request_timeout") from None
    return parse_json_body(raw, max_depth=limits.max_json_depth)


def too_large(limits: ApiLimits) -> RequestError:
    return RequestError(f"request body is over the {limits.max_body_bytes} byte limit",
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
