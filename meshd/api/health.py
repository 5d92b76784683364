"""The routes that say how this daemon is: ``/health``, ``/metrics``, ``/v1/mesh/status``.

All three read the daemon's status dict (the status provider given to
:func:`meshd.api.server.create_app`) and add what only the API measures:
requests in flight, recent speed, where it listens. ``/health`` is public on
every listener (:data:`meshd.api.auth.PUBLIC_PATHS`).
"""

from __future__ import annotations

from aiohttp import web

from meshd.api.common import ENGINE, LISTENING, MESH, METRICS, status_of
from meshd.readiness import not_ready_reason


def add_routes(app: web.Application) -> None:
    app.router.add_get("/v1/mesh/status", _mesh_status)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)


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
