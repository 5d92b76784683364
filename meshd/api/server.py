"""The OpenAI-compatible HTTP API, served by aiohttp on a unix socket.

``create_app`` builds the routes around an :class:`~meshd.engine.Engine` and a
status provider (a callable returning the daemon's status dict);
``start_api`` binds the socket (mode 0660) and, if asked, a loopback-only TCP
port. We never parse HTTP ourselves: aiohttp does, and this module only maps
requests to engine calls and engine events to OpenAI JSON / server-sent
events.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import inspect
import ipaddress
import os
import socket
import stat
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import structlog
from aiohttp import web

from meshd.api import openai_schema as oa
from meshd.api.metrics import ApiMetrics
from meshd.engine import Engine, EngineError, EngineUnavailable, GenerationRequest, TokenEvent
from meshd.errors import MeshdError
from meshd.log import get_logger
from meshd.paths import check_socket_path

log = get_logger("meshd.api")

StatusProvider = Callable[[], "dict[str, Any] | Awaitable[dict[str, Any]]"]

ENGINE = web.AppKey("engine", object)  # Engine | None
STATUS = web.AppKey("status_provider", object)
METRICS = web.AppKey("metrics", ApiMetrics)
LISTENING = web.AppKey("listening", dict)

# Model ids accepted besides the engine's own: apps configured once keep
# working when the home switches models.
MODEL_ALIASES = ("meshd",)
MAX_BODY_BYTES = 16 * 1024 * 1024
SOCKET_MODE = 0o660
SHUTDOWN_TIMEOUT_S = 5.0


class ApiStartError(MeshdError):
    """The API socket or TCP port cannot be opened."""


# --------------------------------------------------------------------------- app


def create_app(engine: Engine | None, status_provider: StatusProvider | None = None) -> web.Application:
    """The aiohttp application; ``engine`` may be None until a model is ready."""
    app = web.Application(middlewares=[_error_middleware], client_max_size=MAX_BODY_BYTES)
    app[ENGINE] = engine
    app[STATUS] = status_provider
    app[METRICS] = ApiMetrics()
    app[LISTENING] = {}
    app.router.add_post("/v1/chat/completions", _chat_completions)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/v1/models/{model_id}", _model)
    app.router.add_get("/v1/mesh/status", _mesh_status)
    return app


def set_engine(app: web.Application, engine: Engine | None) -> None:
    """Swap the engine (new plan, new model); requests already running keep theirs."""
    app[ENGINE] = engine


def _engine(request: web.Request) -> Engine:
    engine = request.app[ENGINE]
    if engine is None:
        raise EngineUnavailable("no model is loaded yet; the daemon is still starting or planning")
    return engine


def _check_model(engine: Engine, model: str | None) -> None:
    if model is None or model == engine.model_id or model in MODEL_ALIASES:
        return
    raise oa.RequestError(
        f"model '{model}' is not served here; this mesh serves '{engine.model_id}' "
        f"(GET /v1/models)", param="model", code="model_not_found",
    )


@web.middleware
async def _error_middleware(request: web.Request, handler):
    """Every failure becomes an OpenAI error object and one structured log line."""
    try:
        return await handler(request)
    except oa.RequestError as exc:
        return _error_response(request, exc)
    except EngineError as exc:
        return _error_response(request, _from_engine_error(exc))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        kind = "not_found_error" if exc.status == 404 else "invalid_request_error"
        message = f"{exc.reason}: {request.method} {request.path}"
        if exc.status == 413:
            message = f"request body is over the {MAX_BODY_BYTES} byte limit"
        return _error_response(request, oa.RequestError(message, status=exc.status, type=kind))
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as exc:  # noqa: BLE001 - the server must keep serving
        log.exception("api_internal_error", path=request.path)
        return _error_response(
            request,
            oa.RequestError(f"internal error: {type(exc).__name__}: {exc}", status=500,
                            type="server_error", code="internal_error"),
            logged=True,
        )


def _from_engine_error(exc: EngineError) -> oa.RequestError:
    param = "messages" if exc.http_status == 413 else None
    return oa.RequestError(str(exc), status=exc.http_status, type=exc.error_type,
                           param=param, code=exc.code)


def _error_response(request: web.Request, err: oa.RequestError, *, logged: bool = False) -> web.Response:
    if not logged:
        log.warning("api_error", status=err.status, type=err.type, code=err.code,
                    param=err.param, path=request.path, message=err.message)
    return web.json_response(err.body(), status=err.status)


# --------------------------------------------------------------------------- handlers


async def _read_json(request: web.Request) -> dict[str, Any]:
    return oa.parse_json_body(await request.read())


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    req = oa.parse_chat_request(await _read_json(request))
    engine = _engine(request)
    _check_model(engine, req.model)
    prompt_ids = list(engine.tokenizer.apply_chat(req.messages))
    return await _serve(request, engine, "chat", prompt_ids, req.params, req.messages)


async def _completions(request: web.Request) -> web.StreamResponse:
    req = oa.parse_completion_request(await _read_json(request))
    engine = _engine(request)
    _check_model(engine, req.model)
    if isinstance(req.prompt, str):
        prompt_ids = list(engine.tokenizer.encode(req.prompt))
    else:
        vocab = getattr(engine, "vocab_size", None)
        if vocab is not None and any(t >= vocab for t in req.prompt):
            raise oa.RequestError(f"'prompt' has token ids outside the vocabulary (size {vocab})",
                                  param="prompt", code="invalid_value")
        prompt_ids = req.prompt
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
    params: oa.SamplingParams, messages: list[dict] | None,
) -> web.StreamResponse:
    engine.check_prompt(prompt_ids)
    room = engine.context_length - len(prompt_ids)
    rid = oa.new_id("chatcmpl" if kind == "chat" else "cmpl")
    gen = GenerationRequest(
        request_id=rid,
        prompt_ids=prompt_ids,
        max_tokens=min(params.max_tokens or room, room),
        messages=messages,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        seed=params.seed,
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
    params: oa.SamplingParams, events, run: _Run,
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
        log.warning("api_error", status=err.status, type=err.type, code=err.code,
                    path=request.path, message=err.message, in_stream=True)
        with contextlib.suppress(ConnectionResetError):
            await resp.write(oa.sse(err.body()))
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


async def start_api(
    app: web.Application, socket_path: str | os.PathLike, listen: str | None = None
) -> web.AppRunner:
    """Serve ``app`` on ``socket_path`` (0660) and optionally ``listen`` (loopback TCP).

    Returns the runner; ``await runner.cleanup()`` stops serving and removes the
    socket file (only if it is still ours).
    """
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
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                           shutdown_timeout=SHUTDOWN_TIMEOUT_S)
    await runner.setup()
    try:
        await web.SockSite(runner, sock).start()
        app[LISTENING]["socket"] = str(path)
        if tcp is not None:
            site = web.TCPSite(runner, tcp[0], tcp[1])
            try:
                await site.start()
            except OSError as exc:
                raise ApiStartError(f"cannot listen on {listen}: {exc}") from exc
            ports = [a[1] for a in runner.addresses if isinstance(a, tuple)]
            host = f"[{tcp[0]}]" if ":" in tcp[0] else tcp[0]
            app[LISTENING]["tcp"] = f"{host}:{ports[0] if ports else tcp[1]}"
    except BaseException:
        await runner.cleanup()
        sock.close()
        raise
    log.info("api_listening", socket=str(path), tcp=app[LISTENING].get("tcp"))
    return runner
