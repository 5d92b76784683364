"""The OpenAI-compatible HTTP API, served by aiohttp on a unix socket.

``create_app`` builds the routes around an :class:`~meshd.engine.Engine` and a
status provider (a callable returning the daemon's status dict);
``start_api`` binds the socket (mode 0660) and, if asked, a loopback-only TCP
port. We never parse HTTP ourselves: aiohttp does, and this module only maps
requests to engine calls and engine events to OpenAI JSON / server-sent
events.

Hostile or broken clients must never cost more than a 4xx: every error,
aiohttp's own included, is an OpenAI error object; bodies, JSON nesting,
idle and slow connections and the number of open connections are bounded
(:class:`ApiLimits`).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import inspect
import ipaddress
import json
import math
import os
import socket
import stat
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path
from typing import Any

import structlog
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler

from meshd.api import openai_schema as oa
from meshd.api.metrics import ApiMetrics
from meshd.engine import Engine, EngineError, EngineUnavailable, GenerationRequest, TokenEvent
from meshd.errors import MeshdError
from meshd.log import get_logger
from meshd.paths import check_socket_path

log = get_logger("meshd.api")

StatusProvider = Callable[[], "dict[str, Any] | Awaitable[dict[str, Any]]"]


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

# Model ids accepted besides the engine's own: apps configured once keep
# working when the home switches models.
MODEL_ALIASES = ("meshd",)
MAX_BODY_BYTES = ApiLimits.max_body_bytes
SOCKET_MODE = 0o660
SHUTDOWN_TIMEOUT_S = 5.0
# After an error that leaves a body unread, how long aiohttp keeps reading
# (and dropping) it before closing; also how long a refused connection lingers.
LINGER_S = 2.0


class ApiStartError(MeshdError):
    """The API socket or TCP port cannot be opened."""


# --------------------------------------------------------------------------- app


def create_app(
    engine: Engine | None, status_provider: StatusProvider | None = None,
    *, limits: ApiLimits | None = None, engine_wait_s: float = 0.0,
    engine_loading: Callable[[], bool] | None = None,
) -> web.Application:
    """The aiohttp application; ``engine`` may be None until a model is ready.

    While ``engine_loading()`` says a model is still loading, a request waits up
    to ``engine_wait_s`` for it instead of failing at once (a daemon that just
    started, a request sent with ``meshd join``).
    """
    limits = limits or ApiLimits()
    app = web.Application(middlewares=[_error_middleware], client_max_size=limits.max_body_bytes)
    app[ENGINE] = engine
    app[ENGINE_SET] = asyncio.Event()
    if engine is not None:
        app[ENGINE_SET].set()
    app[ENGINE_WAIT] = (engine_wait_s, engine_loading or (lambda: False))
    app[STATUS] = status_provider
    app[METRICS] = ApiMetrics()
    app[LISTENING] = {}
    app[LIMITS] = limits
    app.router.add_post("/v1/chat/completions", _chat_completions)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/v1/models/{model_id}", _model)
    app.router.add_get("/v1/mesh/status", _mesh_status)
    return app


def set_engine(app: web.Application, engine: Engine | None) -> None:
    """Swap the engine (new plan, new model); requests already running keep theirs."""
    app[ENGINE] = engine
    if engine is not None:
        app[ENGINE_SET].set()


async def _await_engine(request: web.Request) -> Engine:
    """The engine, waiting (bounded) while the daemon is still loading its model."""
    app = request.app
    wait_s, loading = app[ENGINE_WAIT]
    if app[ENGINE] is None and wait_s > 0 and loading():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(app[ENGINE_SET].wait(), wait_s)
    return _engine(request)


def _engine(request: web.Request) -> Engine:
    engine = request.app[ENGINE]
    if engine is None:
        raise EngineUnavailable("no model is loaded yet; the daemon is still starting or planning")
    return engine


def _vocab_size(engine: Engine | None) -> int | None:
    """The vocabulary that bounds token ids and ``top_k``, where the engine tells it.

    The local engine has ``vocab_size``; the pipeline engine only has its
    model ``source``. Unknown: the schema falls back to a safe static bound.
    """
    for v in (getattr(engine, "vocab_size", None),
              getattr(getattr(getattr(engine, "source", None), "config", None), "vocab_size", None)):
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def _check_model(engine: Engine, model: str | None) -> None:
    if model is None or model == engine.model_id or model in MODEL_ALIASES:
        return
    raise oa.RequestError(
        f"model '{model}' is not served here; this mesh serves '{engine.model_id}' "
        f"(GET /v1/models)", param="model", code="model_not_found",
    )


# --------------------------------------------------------------------------- errors


@web.middleware
async def _error_middleware(request: web.Request, handler):
    """Every failure becomes an OpenAI error object and one structured log line.

    An unexpected exception is logged with its traceback here and answered
    with a generic 500: exception names and messages from inside the daemon
    are not for clients.
    """
    try:
        return await handler(request)
    except oa.RequestError as exc:
        return _error_response(request, exc)
    except EngineError as exc:
        return _error_response(request, _from_engine_error(exc))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        allow = exc.headers.get("Allow")
        return _error_response(request, _from_http_exception(request, exc),
                               headers={"Allow": allow} if allow else None)
    except HttpProcessingError as exc:  # a malformed body (bad chunking, short body)
        return _error_response(request, _malformed(exc.status or 400, exc.message))
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:  # noqa: BLE001 - the server must keep serving
        log.exception("api_internal_error", path=request.path)
        return _error_response(request, _internal_error(), logged=True)


def _from_engine_error(exc: EngineError) -> oa.RequestError:
    param = "messages" if exc.http_status == 413 else None
    return oa.RequestError(str(exc), status=exc.http_status, type=exc.error_type,
                           param=param, code=exc.code, retry_after_s=exc.retry_after_s)


def _from_http_exception(request: web.Request, exc: web.HTTPException) -> oa.RequestError:
    if exc.status == 413:
        return _too_large(request.app[LIMITS])
    kind = "not_found_error" if exc.status == 404 else "invalid_request_error"
    return oa.RequestError(f"{exc.reason}: {request.method} {request.path}", status=exc.status,
                           type=kind)


def _too_large(limits: ApiLimits) -> oa.RequestError:
    return oa.RequestError(f"request body is over the {limits.max_body_bytes} byte limit",
                           status=413, code="request_too_large")


def _malformed(status: int, message: str | None) -> oa.RequestError:
    what = message or HTTPStatus(status).phrase
    return oa.RequestError(f"malformed HTTP request: {what}"[:300], status=status,
                           code="bad_http_request")


def _internal_error() -> oa.RequestError:
    return oa.RequestError("internal error while handling the request; the daemon's log has the "
                           "details", status=500, type="server_error", code="internal_error")


def _log_rejected(err: oa.RequestError, path: str | None, **extra: Any) -> None:
    log.warning("api_request_rejected", status=err.status, type=err.type, code=err.code,
                param=err.param, path=path, message=err.message[:300], **extra)


def _json_error(err: oa.RequestError, headers: dict[str, str] | None = None) -> web.Response:
    """The error object; ``Retry-After`` (whole seconds, at least 1) when retrying helps."""
    h = dict(headers or {})
    if err.retry_after_s is not None:
        h["Retry-After"] = str(max(1, math.ceil(err.retry_after_s)))
    return web.json_response(err.body(), status=err.status, headers=h)


def _error_response(request: web.Request, err: oa.RequestError, *, logged: bool = False,
                    headers: dict[str, str] | None = None) -> web.Response:
    if not logged:
        _log_rejected(err, request.path)
    resp = _json_error(err, headers)
    if err.status in (408, 413):
        resp.force_close()  # the body may be half read: the connection cannot be reused
    return resp


# --------------------------------------------------------------------------- handlers


async def _read_json(request: web.Request) -> dict[str, Any]:
    """The body as a JSON object, read within the size and time limits.

    A declared Content-Length over the limit is refused before reading a
    byte; a chunked body is cut off by aiohttp's ``client_max_size``.
    """
    limits = request.app[LIMITS]
    if request.content_length is not None and request.content_length > limits.max_body_bytes:
        raise _too_large(limits)
    try:
        async with asyncio.timeout(limits.body_timeout_s):
            raw = await request.read()
    except TimeoutError:
        raise oa.RequestError(f"the request body did not arrive within {limits.body_timeout_s:g} s",
                              status=408, code="request_timeout") from None
    return oa.parse_json_body(raw, max_depth=limits.max_json_depth)


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    body = await _read_json(request)
    engine = await _await_engine(request)
    req = oa.parse_chat_request(body, vocab_size=_vocab_size(engine))
    _check_model(engine, req.model)
    prompt_ids = list(engine.tokenizer.apply_chat(req.messages))
    return await _serve(request, engine, "chat", prompt_ids, req.params, req.messages)


async def _completions(request: web.Request) -> web.StreamResponse:
    body = await _read_json(request)
    engine = await _await_engine(request)
    req = oa.parse_completion_request(body, vocab_size=_vocab_size(engine))
    _check_model(engine, req.model)
    if isinstance(req.prompt, str):
        prompt_ids = list(engine.tokenizer.encode(req.prompt))
    else:
        prompt_ids = req.prompt  # checked against the vocabulary by the schema
    if not prompt_ids:
        raise oa.RequestError("'prompt' is empty", param="prompt", code="invalid_value")
    return await _serve(request, engine, "text", prompt_ids, req.params, None)


async def _models(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    return web.json_response(oa.models_list([engine.model_id] if engine else []))


async def _model(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    model_id = request.match_info["model_id"]
    if engine is None or (model_id != engine.model_id and model_id not in MODEL_ALIASES):
        raise oa.RequestError(f"model '{model_id}' is not served here", status=404,
                              type="not_found_error", param="model", code="model_not_found")
    return web.json_response(oa.model_object(engine.model_id))


async def _mesh_status(request: web.Request) -> web.Response:
    provider = request.app[STATUS]
    status: dict[str, Any] = {}
    if provider is not None:
        got = provider()
        if inspect.isawaitable(got):
            got = await got
        status = dict(got or {})
    engine = request.app[ENGINE]
    metrics = request.app[METRICS]
    # The daemon's own view wins; the API fills in what only it can measure.
    status.setdefault("model", engine.model_id if engine else None)
    status.setdefault("requests_in_flight", metrics.in_flight)
    recent = dict(status.get("recent") or {})
    for k, v in metrics.recent().items():
        if recent.get(k) is None:
            recent[k] = v
    status["recent"] = recent
    status.setdefault("api", dict(request.app[LISTENING]))
    return web.json_response(status)


# --------------------------------------------------------------------------- generation


async def _serve(
    request: web.Request, engine: Engine, kind: str, prompt_ids: list[int],
    params: oa.RequestParams, messages: list[dict] | None,
) -> web.StreamResponse:
    engine.check_prompt(prompt_ids)
    room = engine.context_length - len(prompt_ids)
    rid = oa.new_id("chatcmpl" if kind == "chat" else "cmpl")
    gen = GenerationRequest(
        request_id=rid,
        prompt_ids=prompt_ids,
        max_tokens=min(params.max_tokens or room, room),
        messages=messages,
        sampling=params.sampling,
        stop=params.stop,
        stream=params.stream,
    )
    metrics = request.app[METRICS]
    run = _Run(metrics, len(prompt_ids))
    with structlog.contextvars.bound_contextvars(request_id=rid):
        try:
            async with contextlib.aclosing(engine.stream(gen)) as events:
                if params.stream:
                    resp = await _stream(request, engine, kind, rid, params, events, run)
                else:
                    resp = await _collect(engine, kind, rid, events, run)
        except asyncio.CancelledError:
            run.end(ok=False)
            log.info("request_cancelled", reason="client disconnected",
                     completion_tokens=run.tokens)
            raise
        except BaseException:
            run.end(ok=False)
            raise
        rec = run.end(ok=run.ok)
        log.info("request_done", kind=kind, stream=params.stream, ok=run.ok,
                 finish_reason=run.finish, prompt_tokens=len(prompt_ids),
                 completion_tokens=run.tokens,
                 ttft_s=None if rec.ttft_s is None else round(rec.ttft_s, 4),
                 decode_s=round(rec.decode_s, 4))
        return resp


class _Run:
    """Per-request bookkeeping for metrics and the final log line."""

    def __init__(self, metrics: ApiMetrics, prompt_tokens: int):
        self.metrics = metrics
        self.prompt_tokens = prompt_tokens
        self.started = metrics.started()
        self.first_token_at: float | None = None
        self.tokens = 0
        self.finish: str | None = None
        self.ok = True
        self._ended = None

    def saw(self, ev: TokenEvent) -> None:
        if ev.token_id is not None:
            if self.first_token_at is None:
                self.first_token_at = self.metrics._clock()
            self.tokens += 1
        if ev.finish_reason is not None:
            self.finish = ev.finish_reason
            if ev.usage is not None:
                self.tokens = ev.usage.completion_tokens

    def end(self, ok: bool):
        if self._ended is None:
            self._ended = self.metrics.finished(
                self.started, self.first_token_at, self.prompt_tokens, self.tokens, ok=ok)
        return self._ended


async def _collect(engine: Engine, kind: str, rid: str, events, run: _Run) -> web.Response:
    parts: list[str] = []
    last: TokenEvent | None = None
    async for ev in events:
        run.saw(ev)
        parts.append(ev.text)
        last = ev
    if last is None or last.usage is None:
        raise EngineError("the engine ended without a final event")
    text, usage, created = "".join(parts), last.usage.to_dict(), oa.now()
    if kind == "chat":
        body = oa.chat_response(rid, created, engine.model_id, text, last.finish_reason, usage)
    else:
        body = oa.completion_response(rid, created, engine.model_id, text, last.finish_reason, usage)
    return web.json_response(body)


async def _stream(
    request: web.Request, engine: Engine, kind: str, rid: str,
    params: oa.RequestParams, events, run: _Run,
) -> web.StreamResponse:
    # Wait for the first event before sending headers, so that errors raised
    # up front (no plan, prompt too long for the plan) keep their HTTP status.
    first = await anext(events)
    run.saw(first)
    created, model = oa.now(), engine.model_id
    resp = web.StreamResponse(headers={
        "Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Request-Id": rid,
    })
    await resp.prepare(request)

    def chunk(text: str = "", finish: str | None = None) -> bytes:
        if kind == "chat":
            return oa.sse(oa.chat_chunk(rid, created, model, delta={"content": text} if text else {},
                                        finish=finish))
        return oa.sse(oa.completion_response(rid, created, model, text, finish))

    try:
        if kind == "chat":
            await resp.write(oa.sse(oa.chat_chunk(rid, created, model,
                                                  delta={"role": "assistant", "content": ""})))
        ev: TokenEvent | None = first
        while ev is not None:
            if ev.finish_reason is not None:
                if ev.text:
                    await resp.write(chunk(ev.text))
                await resp.write(chunk(finish=ev.finish_reason))
                if params.include_usage and ev.usage is not None:
                    usage = ev.usage.to_dict()
                    if kind == "chat":
                        tail = oa.chat_chunk(rid, created, model, usage=usage, no_choices=True)
                    else:
                        tail = oa.completion_response(rid, created, model, "", None, usage,
                                                      no_choices=True)
                    await resp.write(oa.sse(tail))
                await resp.write(oa.SSE_DONE)
                break
            if ev.text:
                await resp.write(chunk(ev.text))
            ev = await anext(events, None)
            if ev is not None:
                run.saw(ev)
    except ConnectionResetError:
        run.ok = False
        log.info("request_cancelled", reason="client disconnected", completion_tokens=run.tokens)
        return resp
    except EngineError as exc:
        # Headers are gone; tell the client in-band the way OpenAI does.
        run.ok = False
        err = _from_engine_error(exc)
        _log_rejected(err, request.path, in_stream=True)
        with contextlib.suppress(ConnectionResetError):
            await resp.write(oa.sse(err.body()))
    except Exception:  # noqa: BLE001 - same in-band answer, details only in our log
        run.ok = False
        log.exception("api_internal_error", path=request.path, in_stream=True)
        with contextlib.suppress(ConnectionResetError):
            await resp.write(oa.sse(_internal_error().body()))
    with contextlib.suppress(ConnectionResetError):
        await resp.write_eof()
    return resp


# --------------------------------------------------------------------------- listening


def parse_listen(spec: str) -> tuple[str, int]:
    """``127.0.0.1:8080`` / ``[::1]:8080`` / ``localhost:8080`` -> (host, port), loopback only.

    The API has no authentication: anything that can reach it can use the
    mesh, so we refuse to listen where other machines could connect.
    """
    host, sep, port_s = spec.rpartition(":")
    if not sep or not host:
        raise ApiStartError(f"--listen expects HOST:PORT on loopback, e.g. 127.0.0.1:8080 (got {spec!r})")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        port = int(port_s)
    except ValueError:
        raise ApiStartError(f"--listen port must be a number (got {port_s!r})") from None
    if not 0 <= port <= 65535:
        raise ApiStartError(f"--listen port must be 0..65535 (got {port})")
    if host == "localhost":
        host = "127.0.0.1"
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        raise ApiStartError(f"--listen host must be a loopback IP address (got {host!r})") from None
    if not addr.is_loopback:
        raise ApiStartError(
            f"--listen {spec} refused: the API has no authentication, so it only listens on "
            f"loopback addresses (127.0.0.0/8 or ::1); use a unix socket or an SSH tunnel"
        )
    return str(addr), port


def _socket_answers(path: Path) -> bool:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(1.0)
    try:
        s.connect(str(path))
        return True
    except OSError as exc:
        if exc.errno in (errno.ECONNREFUSED, errno.ENOENT):
            return False
        raise ApiStartError(f"cannot check existing socket {path}: {exc}") from exc
    finally:
        s.close()


def _bind_unix(path: Path) -> socket.socket:
    path = check_socket_path(path)
    path.parent.mkdir(mode=0o750, parents=True, exist_ok=True)
    if path.exists() or path.is_symlink():
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise ApiStartError(f"{path} exists and is not a socket; refusing to replace it")
        if _socket_answers(path):
            raise ApiStartError(f"another meshd is already serving on {path}")
        log.info("api_stale_socket_removed", path=str(path))
        path.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(str(path))
        os.chmod(path, SOCKET_MODE)
    except OSError as exc:
        sock.close()
        raise ApiStartError(f"cannot bind the API socket {path}: {exc}") from exc
    return sock


def _bind_tcp(host: str, port: int, spec: str) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family)
    except OSError as exc:
        raise ApiStartError(f"cannot listen on {spec}: {exc}") from exc


async def start_api(
    app: web.Application, socket_path: str | os.PathLike, listen: str | None = None
) -> web.AppRunner:
    """Serve ``app`` on ``socket_path`` (0660) and optionally ``listen`` (loopback TCP).

    Both listeners share one connection cap and the limits given to
    :func:`create_app`. Returns the runner; ``await runner.cleanup()`` stops
    serving and removes the socket file (only if it is still ours).
    """
    limits = app[LIMITS]
    path = Path(socket_path)
    tcp = parse_listen(listen) if listen else None
    sock = _bind_unix(path)
    ino = os.stat(path).st_ino

    async def _remove_socket(_app: web.Application) -> None:
        with contextlib.suppress(FileNotFoundError):
            if os.stat(path).st_ino == ino:
                path.unlink()

    app.on_cleanup.append(_remove_socket)
    # handler_cancellation: a client that hangs up cancels its handler, which
    # closes the engine stream and stops the generation.
    runner = web.AppRunner(
        app, handler_cancellation=True, access_log=None, shutdown_timeout=SHUTDOWN_TIMEOUT_S,
        keepalive_timeout=limits.keepalive_timeout_s, lingering_time=LINGER_S,
        max_line_size=limits.max_line_size, max_field_size=limits.max_field_size,
    )
    await runner.setup()
    tcp_sock = None
    try:
        gate = _ConnectionGate(runner.server, limits.max_connections)
        await _GatedSite(runner, sock, gate, limits.backlog).start()
        app[LISTENING]["socket"] = str(path)
        if tcp is not None:
            tcp_sock = _bind_tcp(tcp[0], tcp[1], listen)
            await _GatedSite(runner, tcp_sock, gate, limits.backlog).start()
            host = f"[{tcp[0]}]" if ":" in tcp[0] else tcp[0]
            app[LISTENING]["tcp"] = f"{host}:{tcp_sock.getsockname()[1]}"
    except BaseException:
        await runner.cleanup()
        sock.close()
        if tcp_sock is not None:
            tcp_sock.close()
        raise
    log.info("api_listening", socket=str(path), tcp=app[LISTENING].get("tcp"),
             max_connections=limits.max_connections,
             keepalive_timeout_s=limits.keepalive_timeout_s)
    return runner


# --------------------------------------------------------------------------- connections


class _ApiRequestHandler(RequestHandler):
    """aiohttp's per-connection protocol, answering its own errors as OpenAI JSON.

    Requests aiohttp cannot parse (bad request line or method, oversized
    headers) never reach the middleware: aiohttp answers them from
    ``handle_error``, as text/plain. aiohttp has no option to choose the
    handler class, so :class:`_ConnectionGate` re-classes each handler the
    Server makes into a subclass of this one: no new slots, only methods.
    """

    __slots__ = ()
    gate: _ConnectionGate  # set on the per-gate subclass

    def handle_error(self, request, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if request.writer.output_size > 0:  # as aiohttp: too late for another response
            raise ConnectionError("response already started; cannot send the error")
        path = _safe_path(request)
        if status >= 500:
            log.error("api_internal_error", path=path, exc_info=exc)
            err = _internal_error()
        else:
            err = _malformed(status, message)
            _log_rejected(err, path)
        resp = _json_error(err)
        resp.force_close()
        return resp

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._manager is not None:  # aiohttp ignores repeated calls; count once too
            self.gate.release()
        super().connection_lost(exc)


def _safe_path(request) -> str | None:
    with contextlib.suppress(Exception):
        return request.path
    return None


class _ConnectionGate:
    """The protocol factory of every listener: at most ``limit`` open connections.

    aiohttp has no connection cap. Past it, a new connection gets one 503
    (with ``Retry-After``) and is closed, so a flood costs a socket for a
    moment instead of file descriptors and memory for as long as it lasts.
    Counting here, not in aiohttp's connection table, also covers a burst
    accepted in one go, before any of it is registered there.
    """

    def __init__(self, server: web.Server, limit: int):
        self.server = server
        self.limit = limit
        self.open = 0
        self.handler_class = type("GatedRequestHandler", (_ApiRequestHandler,),
                                  {"__slots__": (), "gate": self})

    def __call__(self) -> asyncio.Protocol:
        if self.open >= self.limit:
            return _Refusal(self.open, self.limit)
        handler = self.server()
        handler.__class__ = self.handler_class
        self.open += 1
        return handler

    def release(self) -> None:
        self.open -= 1


class _Refusal(asyncio.Protocol):
    """Answers one connection over the cap with a 503 JSON error and closes it.

    The answer waits for the request's first bytes (or ``LINGER_S``), and the
    rest is read and dropped until the client closes: closing on unread data
    resets the connection, which can destroy the answer before it is read.
    """

    def __init__(self, open_now: int, limit: int):
        self.open_now = open_now
        self.err = oa.RequestError(
            f"the API has {limit} connections open, its limit; retry shortly",
            status=503, type="service_unavailable", code="too_many_connections", retry_after_s=1.0)
        self.transport: asyncio.Transport | None = None
        self.answered = False
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.timer = asyncio.get_running_loop().call_later(LINGER_S, self._close)
        _log_rejected(self.err, None, open_connections=self.open_now)

    def data_received(self, data: bytes) -> None:
        self._answer()

    def eof_received(self) -> bool:
        self._close()
        return False

    def connection_lost(self, exc: BaseException | None) -> None:
        if self.timer is not None:
            self.timer.cancel()

    def _answer(self) -> None:
        if self.answered or self.transport is None or self.transport.is_closing():
            return
        self.answered = True
        body = json.dumps(self.err.body()).encode()
        head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json; "
                f"charset=utf-8\r\nContent-Length: {len(body)}\r\nRetry-After: 1\r\n"
                f"Connection: close\r\n\r\n")
        self.transport.write(head.encode() + body)

    def _close(self) -> None:
        self._answer()
        if self.transport is not None:
            self.transport.close()


class _GatedSite(web.SockSite):
    """A listener on our own bound socket whose connections pass the gate."""

    def __init__(self, runner: web.AppRunner, sock: socket.socket, gate: _ConnectionGate,
                 backlog: int):
        super().__init__(runner, sock, backlog=backlog)
        self._gate = gate

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site, so runner.cleanup() stops it
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._gate, sock=self._sock,
                                                backlog=self._backlog)
