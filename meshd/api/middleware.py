"""The two wrappers around every handler: the API key check, and errors as answers.

``auth_middleware`` runs first (inside ``error_middleware``), before a body is
read, so a client without a key costs no more than its headers.
"""

from __future__ import annotations

import asyncio

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from meshd.api.auth import PUBLIC_PATHS, Authenticator
from meshd.api.common import AUTH, METRICS, log
from meshd.api.errors import (
    error_response, from_engine_error, from_http_exception, internal_error, malformed,
)
from meshd.api.validation import RequestError
from meshd.engine.errors import EngineError


@web.middleware
async def error_middleware(request: web.Request, handler):
    """Every failure becomes an error object and one structured log line.

    An unexpected exception is logged with its traceback here and answered
    with a generic 500: exception names and messages from inside the daemon
    are not for clients.
    """
    try:
        return await handler(request)
    except RequestError as exc:
        return error_response(request, exc)
    except EngineError as exc:
        return error_response(request, from_engine_error(exc))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        allow = exc.headers.get("Allow")
        return error_response(request, from_http_exception(request, exc),
                              headers={"Allow": allow} if allow else None)
    except HttpProcessingError as exc:  # a malformed body (bad chunking, short body)
        return error_response(request, malformed(exc.status or 400, exc.message))
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:  # noqa: BLE001 - the server must keep serving
        log.exception("api_internal_error", path=request.path)
        return error_response(request, internal_error(), logged=True)


@web.middleware
async def auth_middleware(request: web.Request, handler):
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
        raise RequestError("too many requests with a wrong API key from this address; wait and "
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


class _Unauthorized(RequestError):
    def __init__(self, message: str):
        super().__init__(message, status=401, type="invalid_request_error", code="invalid_api_key")
