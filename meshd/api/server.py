"""The HTTP API, served by aiohttp on a unix socket and optional TCP listeners.

``create_app`` builds the routes around an :class:`~meshd.engine.Engine` and a
status provider (a callable returning the daemon's status dict): the OpenAI
routes here, the Ollama routes from :mod:`meshd.api.ollama`, ``/health`` and
Prometheus ``/metrics``. ``start_api`` binds the socket (mode 0660) and, if
asked, a loopback TCP port (``--api-listen``) and a LAN listener (``--http``,
API key required, optional TLS). We never parse HTTP ourselves: aiohttp does,
and this module only maps requests to engine calls and engine events to
OpenAI JSON / server-sent events.

Hostile or broken clients must never cost more than a 4xx: every error,
aiohttp's own included, is an error object in the dialect of the path
(OpenAI's ``{"error": {...}}``, Ollama's ``{"error": "..."}`` under ``/api/``);
bodies, JSON nesting, idle and slow connections and the number of open
connections are bounded (:class:`ApiLimits`).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import ipaddress
import json
import math
import os
import socket
import ssl
import stat
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from pathlib import Path
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler

from meshd.api import openai_schema as oa
from meshd.api import tools as tl
from meshd.api.auth import PUBLIC_PATHS, Authenticator
from meshd.api.common import (  # noqa: F401 - LIMITS, LISTENING and ApiLimits are part of this module's API
    AUTH, DEBUG, ENGINE, ENGINE_SET, ENGINE_WAIT, LIMITS, LISTENING, METRICS, MODEL_INFO, NAMES, STATUS,
    ApiLimits, await_engine, chat_prompt, generation_request, log, public_usage, read_json, served_model,
    status_of, constrain_tool_calls, too_large, tracked, vocab_size,
)
from meshd.api.names import ModelNames, not_found
from meshd.api.metrics import ApiMetrics, MeshCollector
from meshd.apikeys import ApiKeyStore
from meshd.engine import Engine, EngineError, TokenEvent
from meshd.errors import MeshdError
from meshd.paths import check_socket_path
from meshd.readiness import not_ready_reason

StatusProvider = Callable[[], "dict[str, Any] | Awaitable[dict[str, Any]]"]
MESH = web.AppKey("mesh_collector", MeshCollector)

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
    api_keys: ApiKeyStore | None = None,
    model_info: Callable[[], dict[str, Any]] | None = None,
    model_aliases: list[str] | tuple[str, ...] = (), debug_responses: bool = False,
    require_keys: bool = False,
) -> web.Application:
    """The aiohttp application; ``engine`` may be None until a model is ready.

    While ``engine_loading()`` says a model is still loading, a request waits up
    to ``engine_wait_s`` for it instead of failing at once (a daemon that just
    started, a request sent with ``meshd join``). ``api_keys`` checks keys on
    LAN listeners, and on every TCP listener with ``require_keys``;
    ``model_info`` serves Ollama's model endpoints. ``model_aliases`` are the
    other names requests may give the served model (:mod:`meshd.api.names`);
    ``debug_responses`` lets replies carry internal notes such as why
    speculation fell back (they may quote file paths; off, only the log has them).
    """
    from meshd.api import ollama

    limits = limits or ApiLimits()
    app = web.Application(middlewares=[_error_middleware, _auth_middleware],
                          client_max_size=limits.max_body_bytes)
    app[ENGINE] = engine
    app[ENGINE_SET] = asyncio.Event()
    if engine is not None:
        app[ENGINE_SET].set()
    app[ENGINE_WAIT] = (engine_wait_s, engine_loading or (lambda: False))
    app[STATUS] = status_provider
    app[METRICS] = ApiMetrics()
    app[MESH] = MeshCollector()
    app[METRICS].registry.register(app[MESH])
    app[LISTENING] = {}
    app[LIMITS] = limits
    app[AUTH] = Authenticator(api_keys, require_keys=require_keys)
    app[MODEL_INFO] = model_info
    app[NAMES] = ModelNames.of(model_aliases)
    app[DEBUG] = bool(debug_responses)
    app.router.add_post("/v1/chat/completions", _chat_completions)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/v1/models/{model_id}", _model)
    app.router.add_get("/v1/mesh/status", _mesh_status)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    ollama.add_routes(app)
    return app


def set_engine(app: web.Application, engine: Engine | None) -> None:
    """Swap the engine (new plan, new model); requests already running keep theirs."""
    app[ENGINE] = engine
    if engine is not None:
        app[ENGINE_SET].set()


# --------------------------------------------------------------------------- errors


def is_ollama_path(path: str) -> bool:
    return path.startswith("/api/")


@web.middleware
async def _error_middleware(request: web.Request, handler):
    """Every failure becomes an error object and one structured log line.

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


@web.middleware
async def _auth_middleware(request: web.Request, handler):
    """Requests on a LAN listener need ``Authorization: Bearer <key>`` (before the body is read)."""
    auth: Authenticator = request.app[AUTH]
    sockname = request.transport.get_extra_info("sockname") if request.transport else None
    if request.path in PUBLIC_PATHS or not auth.requires_key(sockname):
        return await handler(request)
    peer = request.remote or "?"
    metrics = request.app[METRICS]
    wait = auth.limiter.retry_after(peer)
    if wait is not None:
        metrics.auth_failures.labels("429").inc()
        raise oa.RequestError("too many requests with a wrong API key from this address; wait and "
                              "retry", status=429, type="rate_limit_error", code="too_many_auth_failures",
                              retry_after_s=wait)
    key = auth.check(request.headers.get("Authorization"))
    if key is None:
        auth.limiter.failed(peer)
        metrics.auth_failures.labels("401").inc()
        given = "a wrong" if request.headers.get("Authorization") else "no"
        raise _Unauthorized(
            f"this listener needs an API key and the request carried {given} one: send "
            f"'Authorization: Bearer <key>' with a key from 'meshd apikey create' on the daemon's device")
    return await handler(request)


class _Unauthorized(oa.RequestError):
    def __init__(self, message: str):
        super().__init__(message, status=401, type="invalid_request_error", code="invalid_api_key")


def _from_engine_error(exc: EngineError) -> oa.RequestError:
    param = "messages" if exc.http_status == 413 else None
    return oa.RequestError(str(exc), status=exc.http_status, type=exc.error_type,
                           param=param, code=exc.code, retry_after_s=exc.retry_after_s)


def _from_http_exception(request: web.Request, exc: web.HTTPException) -> oa.RequestError:
    if exc.status == 413:
        return too_large(request.app[LIMITS])
    kind = "not_found_error" if exc.status == 404 else "invalid_request_error"
    return oa.RequestError(f"{exc.reason}: {request.method} {request.path}", status=exc.status,
                           type=kind)


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


def _json_error(err: oa.RequestError, headers: dict[str, str] | None = None,
                ollama: bool = False) -> web.Response:
    """The error object; ``Retry-After`` (whole seconds, at least 1) when retrying helps."""
    h = dict(headers or {})
    if err.retry_after_s is not None:
        h["Retry-After"] = str(max(1, math.ceil(err.retry_after_s)))
    if err.status == 401:
        h["WWW-Authenticate"] = 'Bearer realm="meshd"'
    if ollama:  # Ollama's errors are one string: name the field in it
        named = err.param is None or f"'{err.param}'" in err.message
        body: dict[str, Any] = {"error": err.message if named else f"{err.param}: {err.message}"}
    else:
        body = err.body()
    return web.json_response(body, status=err.status, headers=h)


def _error_response(request: web.Request, err: oa.RequestError, *, logged: bool = False,
                    headers: dict[str, str] | None = None) -> web.Response:
    if not logged:
        _log_rejected(err, request.path)
    request.app[METRICS].rejected.labels(str(err.status)).inc()
    resp = _json_error(err, headers, ollama=is_ollama_path(request.path))
    if err.status in (408, 413):
        resp.force_close()  # the body may be half read: the connection cannot be reused
    return resp


# --------------------------------------------------------------------------- handlers


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    engine = await await_engine(request)
    req = oa.parse_chat_request(body, vocab_size=vocab_size(engine))
    served_model(request, engine, req.model, ollama=False)
    prompt_ids = chat_prompt(engine, req.messages, req.tools)
    constrain_tool_calls(engine, req.params, req.tools, req.tool_choice, req.parallel_tool_calls)
    return await _serve(request, engine, "chat", prompt_ids, req.params, req.messages,
                        tl.tool_names(req.tools), req.parallel_tool_calls)


async def _completions(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    engine = await await_engine(request)
    req = oa.parse_completion_request(body, vocab_size=vocab_size(engine))
    served_model(request, engine, req.model, ollama=False)
    if isinstance(req.prompt, str):
        prompt_ids = list(engine.tokenizer.encode(req.prompt))
    else:
        prompt_ids = req.prompt  # checked against the vocabulary by the schema
    if not prompt_ids:
        raise oa.RequestError("'prompt' is empty", param="prompt", code="invalid_value")
    return await _serve(request, engine, "text", prompt_ids, req.params, None, [], True)


async def _models(request: web.Request) -> web.Response:
    """The served model, then each configured alias (clients pick from this list)."""
    engine = request.app[ENGINE]
    return web.json_response(oa.models_list(request.app[NAMES].listed(engine.model_id) if engine else []))


async def _model(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    asked = request.match_info["model_id"]
    if engine is None:
        raise oa.RequestError("no model is loaded yet", status=404, type="not_found_error",
                              param="model", code="model_not_found")
    if not asked.strip() or not request.app[NAMES].known(engine.model_id, asked):
        raise not_found(asked, engine.model_id, ollama=False)
    return web.json_response(oa.model_object(asked if request.app[NAMES].is_alias(engine.model_id, asked)
                                             else engine.model_id))


async def _mesh_status(request: web.Request) -> web.Response:
    status = await status_of(request.app)
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
    if not _on_unix_socket(request):  # file paths are for this machine's users only
        status["api"] = {k: v for k, v in status["api"].items() if k != "socket"}
    return web.json_response(status)


def _on_unix_socket(request: web.Request) -> bool:
    sockname = request.transport.get_extra_info("sockname") if request.transport else None
    return isinstance(sockname, str)


async def _health(request: web.Request) -> web.Response:
    """200 when a request sent now would be served; 503 with the reason otherwise.

    Public on every listener (load balancers and Home Assistant probe it
    without a key); it says only "ok" or why not.
    """
    engine = request.app[ENGINE]
    status = await status_of(request.app)
    reason = None
    if engine is None:
        load = status.get("load_state")
        reason = {"none": "this device runs no model (model = none)",
                  "failed": "the model failed to load; see the daemon's log"}.get(
            load, "loading the model")
    elif status.get("state") == "draining":
        reason = "shutting down"
    elif status and status.get("ready") is False:
        reason = not_ready_reason(status)
    if reason is not None:
        return web.json_response({"status": "unavailable", "reason": reason}, status=503,
                                 headers={"Retry-After": "2"})
    return web.json_response({"status": "ok", "model": engine.model_id})


async def _metrics(request: web.Request) -> web.Response:
    from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

    request.app[MESH].snapshot = await status_of(request.app)
    body = generate_latest(request.app[METRICS].registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


# --------------------------------------------------------------------------- generation


async def _serve(
    request: web.Request, engine: Engine, kind: str, prompt_ids: list[int],
    params: oa.RequestParams, messages: list[dict] | None, offered: list[str], parallel: bool,
) -> web.StreamResponse:
    rid = oa.new_id("chatcmpl" if kind == "chat" else "cmpl")
    gen = generation_request(engine, rid, prompt_ids, params, messages)
    endpoint = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    async with tracked(request, engine, gen, "openai", endpoint) as (events, run):
        if params.stream:
            return await _stream(request, engine, kind, rid, params, events, run, offered, parallel)
        return await _collect(request, engine, kind, rid, events, run, offered, parallel)


def _calls(text: str, offered: list[str], parallel: bool) -> tuple[str, list[tl.ToolCall]]:
    content, calls = tl.parse_tool_calls(text, offered)
    return content, (calls if parallel else calls[:1])


async def _collect(request: web.Request, engine: Engine, kind: str, rid: str, events, run, offered: list[str],
                   parallel: bool) -> web.Response:
    parts: list[str] = []
    last: TokenEvent | None = None
    async for ev in events:
        run.saw(ev)
        parts.append(ev.text)
        last = ev
    if last is None or last.usage is None:
        raise EngineError("the engine ended without a final event")
    text, usage, created = "".join(parts), public_usage(request, last.usage), oa.now()
    if kind == "chat":
        content, calls = _calls(text, offered, parallel)
        finish = "tool_calls" if calls else last.finish_reason
        body = oa.chat_response(rid, created, engine.model_id, content if calls else text, finish,
                                usage, [c.openai() for c in calls] or None)
    else:
        body = oa.completion_response(rid, created, engine.model_id, text, last.finish_reason, usage)
    return web.json_response(body)


async def _stream(
    request: web.Request, engine: Engine, kind: str, rid: str,
    params: oa.RequestParams, events, run, offered: list[str], parallel: bool,
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
    calls_filter = tl.ToolStreamFilter(offered)

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
                finish = ev.finish_reason
                text = calls_filter.feed(ev.text)
                tail, calls = calls_filter.finish()
                if not parallel:
                    calls = calls[:1]
                if text + tail:
                    await resp.write(chunk(text + tail))
                if calls:
                    finish = "tool_calls"
                    await resp.write(oa.sse(oa.chat_chunk(rid, created, model, delta={
                        "tool_calls": [c.openai(index=i) for i, c in enumerate(calls)]})))
                await resp.write(chunk(finish=finish))
                if params.include_usage and ev.usage is not None:
                    usage = public_usage(request, ev.usage)
                    if kind == "chat":
                        tail_chunk = oa.chat_chunk(rid, created, model, usage=usage, no_choices=True)
                    else:
                        tail_chunk = oa.completion_response(rid, created, model, "", None, usage,
                                                            no_choices=True)
                    await resp.write(oa.sse(tail_chunk))
                await resp.write(oa.SSE_DONE)
                break
            text = calls_filter.feed(ev.text)
            if text:
                await resp.write(chunk(text))
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


def parse_listen(spec: str, *, flag: str = "--api-listen", loopback_only: bool = True) -> tuple[str, int]:
    """``127.0.0.1:8080`` / ``[::1]:8080`` / ``localhost:8080`` -> (host, port).

    ``--api-listen`` (``loopback_only``) serves this machine only and needs no
    key (unless ``--require-keys``). ``--http`` may name any address; listeners
    off loopback require an API key on every request. Errors name the flag the
    user actually gave.
    """
    host, sep, port_s = spec.rpartition(":")
    if not sep or not host:
        raise ApiStartError(f"{flag} expects HOST:PORT, e.g. 127.0.0.1:8080 (got {spec!r})")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        port = int(port_s)
    except ValueError:
        raise ApiStartError(f"{flag} port must be a number (got {port_s!r})") from None
    if not 0 <= port <= 65535:
        raise ApiStartError(f"{flag} port must be 0..65535 (got {port})")
    if host == "localhost":
        host = "127.0.0.1"
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        raise ApiStartError(f"{flag} host must be an IP address (got {host!r})") from None
    if loopback_only and not addr.is_loopback:
        raise ApiStartError(
            f"{flag} {spec} refused: {flag} serves this machine only, without authentication, so it "
            f"listens on loopback addresses (127.0.0.0/8 or ::1); for the LAN use "
            f"--http {spec} with an API key from 'meshd apikey create'"
        )
    return str(addr), port


def is_loopback(host: str) -> bool:
    return ipaddress.ip_address(host).is_loopback


def tls_context(cert: str | os.PathLike, key: str | os.PathLike) -> ssl.SSLContext:
    """A server TLS context from a PEM certificate chain and key (TLS 1.2+)."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(str(cert), str(key))
    except (OSError, ssl.SSLError) as exc:
        raise ApiStartError(f"cannot load the TLS certificate {cert} / key {key}: {exc}") from None
    return ctx


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
            raise ApiStartError(f"another meshd is already serving on {path}; a second daemon on this "
                                f"machine needs its own --socket and --state-dir, and --port 0 "
                                f"--pairing-port 0")
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


def _bind_tcp(host: str, port: int, spec: str, flag: str = "--api-listen") -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family)
    except OSError as exc:
        raise ApiStartError(f"cannot listen on {spec} ({flag}): {bind_error(exc, flag, port)}") from exc


OLLAMA_PORT = 11434


def bind_error(exc: OSError, flag: str, port: int) -> str:
    """Why an API port cannot be bound, and what to change: the API's own flag, not other ports."""
    reason = os.strerror(exc.errno) if exc.errno else str(exc)
    if exc.errno != errno.EADDRINUSE:
        return reason
    who = (" (an Ollama server listens there by default: stop it, e.g. 'systemctl stop ollama')"
           if port == OLLAMA_PORT else "")
    return f"{reason}: another program listens on that port{who}; stop it or give {flag} another port"


async def start_api(
    app: web.Application, socket_path: str | os.PathLike, listen: str | None = None, *,
    http: str | None = None, tls_cert: str | os.PathLike | None = None,
    tls_key: str | os.PathLike | None = None,
) -> web.AppRunner:
    """Serve ``app`` on ``socket_path`` (0660), optionally ``listen`` and ``http`` (TCP).

    ``listen`` is loopback only, without keys. ``http`` may be any address; off
    loopback (and on every TCP listener when the app was made with
    ``require_keys``) every request needs an API key (and with ``tls_cert``/``tls_key``
    it speaks HTTPS). All listeners share one connection cap and the limits
    given to :func:`create_app`. Returns the runner; ``await
    runner.cleanup()`` stops serving and removes the socket file (only if it
    is still ours).
    """
    limits = app[LIMITS]
    path = Path(socket_path)
    tcp = []
    if listen:
        tcp.append(("tcp", listen, "--api-listen", parse_listen(listen)))
    if http:
        tcp.append(("http", http, "--http", parse_listen(http, flag="--http", loopback_only=False)))
    if (tls_cert is None) != (tls_key is None):
        raise ApiStartError("--tls-cert and --tls-key go together")
    tls = tls_context(tls_cert, tls_key) if tls_cert is not None else None
    if tls is not None and not http:
        raise ApiStartError("--tls-cert/--tls-key need --http HOST:PORT")
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
    tcp_socks: list[socket.socket] = []
    try:
        gate = _ConnectionGate(runner.server, limits.max_connections)
        await _GatedSite(runner, sock, gate, limits.backlog).start()
        app[LISTENING]["socket"] = str(path)
        for name, spec, flag, (host, port) in tcp:
            s = _bind_tcp(host, port, spec, flag)
            tcp_socks.append(s)
            keyed = app[AUTH].keyed(is_loopback(host))
            await _GatedSite(runner, s, gate, limits.backlog,
                             ssl_context=tls if name == "http" else None).start()
            bound = s.getsockname()[1]
            if keyed:
                app[AUTH].keyed_ports.add(bound)
            shown = f"[{host}]" if ":" in host else host
            scheme = "https" if (tls is not None and name == "http") else "http"
            app[LISTENING][name] = f"{shown}:{bound}"
            if name == "http":
                app[LISTENING]["http_url"] = f"{scheme}://{shown}:{bound}"
                app[LISTENING]["http_auth"] = "api key" if keyed else "none (loopback)"
            elif keyed:
                app[LISTENING]["tcp_auth"] = "api key"
            if keyed and app[AUTH].store is None:
                raise ApiStartError(f"{flag} {spec} needs API keys, and this server has no key store")
    except BaseException:
        await runner.cleanup()
        sock.close()
        for s in tcp_socks:
            s.close()
        raise
    if app[AUTH].keyed_ports and app[AUTH].store is not None and not app[AUTH].store.keys():
        log.warning("api_no_keys", hint="the keyed TCP listener refuses every request until a key "
                    "exists: run 'meshd apikey create NAME'")
    log.info("api_listening", socket=str(path), tcp=app[LISTENING].get("tcp"),
             http=app[LISTENING].get("http_url"), http_auth=app[LISTENING].get("http_auth"),
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
                 backlog: int, ssl_context: ssl.SSLContext | None = None):
        super().__init__(runner, sock, backlog=backlog, ssl_context=ssl_context)
        self._gate = gate

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site, so runner.cleanup() stops it
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._gate, sock=self._sock,
                                                backlog=self._backlog, ssl=self._ssl_context)
