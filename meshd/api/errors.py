"""How a failure becomes an answer: the error object, its headers, and one log line.

Every path to an error (a rejected body, an engine that cannot serve, aiohttp's
own HTTP errors, a connection over the cap, a failure after a stream started)
ends in the same :class:`~meshd.api.validation.RequestError`, so clients of both
dialects read one vocabulary and the log has one ``api_request_rejected`` event
shape. The dialect is chosen by path: Ollama's errors (under ``/api/``) are one
string, OpenAI's an object.
"""

from __future__ import annotations

import math
from http import HTTPStatus
from typing import Any

from aiohttp import web

from meshd.api.common import LIMITS, METRICS, log, too_large
from meshd.api.validation import RequestError
from meshd.engine.errors import EngineError


def is_ollama_path(path: str) -> bool:
    return path.startswith("/api/")


def from_engine_error(exc: EngineError) -> RequestError:
    param = "messages" if exc.http_status == 413 else None
    return RequestError(str(exc), status=exc.http_status, type=exc.error_type,
                        param=param, code=exc.code, retry_after_s=exc.retry_after_s)


def from_http_exception(request: web.Request, exc: web.HTTPException) -> RequestError:
    if exc.status == 413:
        return too_large(request.app[LIMITS])
    kind = "not_found_error" if exc.status == 404 else "invalid_request_error"
    return RequestError(f"{exc.reason}: {request.method} {request.path}", status=exc.status,
                        type=kind)


def malformed(status: int, message: str | None) -> RequestError:
    what = message or HTTPStatus(status).phrase
    return RequestError(f"malformed HTTP request: {what}"[:300], status=status,
                        code="bad_http_request")


def internal_error() -> RequestError:
    return RequestError("internal error while handling the request; the daemon's log has the "
                        "details", status=500, type="server_error", code="internal_error")


def log_rejected(err: RequestError, path: str | None, **extra: Any) -> None:
    log.warning("api_request_rejected", status=err.status, type=err.type, code=err.code,
                param=err.param, path=path, message=err.message[:300], **extra)


def json_error(err: RequestError, headers: dict[str, str] | None = None,
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


def error_response(request: web.Request, err: RequestError, *, logged: bool = False,
                   headers: dict[str, str] | None = None) -> web.Response:
    if not logged:
        log_rejected(err, request.path)
    request.app[METRICS].rejected.labels(str(err.status)).inc()
    resp = json_error(err, headers, ollama=is_ollama_path(request.path))
    if err.status in (408, 413):
        resp.force_close()  # the body may be half read: the connection cannot be reused
    return resp
