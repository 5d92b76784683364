"""The HTTP API, served by aiohttp on a unix socket and optional TCP listeners.

``create_app`` builds the routes around an :class:`~meshd.engine.base.Engine` and a
status provider (a callable returning the daemon's status dict): the OpenAI
routes (:mod:`meshd.api.openai_routes`), the Ollama routes
(:mod:`meshd.api.ollama_routes`), ``/health`` and Prometheus ``/metrics``
(:mod:`meshd.api.health`). ``start_api`` binds the socket (mode 0660) and, if
asked, a loopback TCP port (``--api-listen``) and a LAN listener (``--http``,
API key required, optional TLS) (:mod:`meshd.api.listen`). We never parse
HTTP ourselves: aiohttp does, and the API only maps requests to engine calls
and engine events to OpenAI or Ollama JSON.

Hostile or broken clients must never cost more than a 4xx: every error,
aiohttp's own included, is an error object in the dialect of the path
(OpenAI's ``{"error": {...}}``, Ollama's ``{"error": "..."}`` under ``/api/``;
:mod:`meshd.api.middleware`, :mod:`meshd.api.connections`); bodies, JSON
nesting, idle and slow connections and the number of open connections are
bounded (:class:`~meshd.api.common.ApiLimits`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from meshd.api import health, ollama_routes, openai_routes
from meshd.api.auth import Authenticator
from meshd.api.common import (
    AUTH, DEBUG, ENGINE, ENGINE_SET, ENGINE_WAIT, LIMITS, LISTENING, MESH, METRICS, MODEL_INFO, NAMES, STATUS,
    ApiLimits, log,
)
from meshd.api.connections import LINGER_S, ConnectionGate, GatedSite
from meshd.api.listen import ApiStartError, bind_tcp, bind_unix, is_loopback, parse_listen, tls_context
from meshd.api.metrics import ApiMetrics, MeshCollector
from meshd.api.middleware import auth_middleware, error_middleware
from meshd.api.names import ModelNames
from meshd.apikeys import ApiKeyStore
from meshd.engine.base import Engine

StatusProvider = Callable[[], "dict[str, Any] | Awaitable[dict[str, Any]]"]

SHUTDOWN_TIMEOUT_S = 5.0


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
    limits = limits or ApiLimits()
    app = web.Application(middlewares=[error_middleware, auth_middleware],
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
    openai_routes.add_routes(app)
    health.add_routes(app)
    ollama_routes.add_routes(app)
    return app


def set_engine(app: web.Application, engine: Engine | None) -> None:
    """Swap the engine (new plan, new model); requests already running keep theirs."""
    app[ENGINE] = engine
    if engine is not None:
        app[ENGINE_SET].set()


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
    sock = bind_unix(path)
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
        gate = ConnectionGate(runner.server, limits.max_connections)
        await GatedSite(runner, sock, gate, limits.backlog).start()
        app[LISTENING]["socket"] = str(path)
        for name, spec, flag, (host, port) in tcp:
            s = bind_tcp(host, port, spec, flag)
            tcp_socks.append(s)
            keyed = app[AUTH].keyed(is_loopback(host))
            await GatedSite(runner, s, gate, limits.backlog,
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
