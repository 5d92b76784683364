"""A generation's statistics as replies carry them: the one place the API reads them.

The engine hands its statistics over once, as the final event's
:class:`~meshd.engine.base.Usage` (token counts; how speculation, the cloud
verifier and an outline attempt went). OpenAI replies carry it whole as
``usage``; Ollama's final message has its own counts and meshd's extensions
beside them. Either way internal notes stay in the daemon's log unless the
app was made with ``debug_responses``.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from meshd.api.common import DEBUG
from meshd.engine.base import Usage


def public_usage(request: web.Request, usage: Usage) -> dict[str, Any]:
    """``usage`` as a reply carries it: without internal notes unless ``debug_responses`` asks.

    A ``fallback_reason`` (why speculation fell back, e.g. Medusa heads that
    did not load) can quote files of the install or the state directory;
    clients on the LAN get the counts, the daemon's log keeps the reason.
    """
    d = usage.to_dict()
    if not request.app[DEBUG]:
        _drop_notes(d)
    return d


def ollama_extensions(request: web.Request, usage: Usage | None) -> dict[str, Any]:
    """meshd's additions to Ollama's final message: how speculation, an outline attempt and early exits went."""
    out: dict[str, Any] = {}
    stats = usage.stats if usage is not None else None
    if stats is not None and stats.speculative is not None:
        out["speculative"] = public_usage(request, usage)["speculative"]
    if stats is not None and stats.outline is not None:
        out["outline"] = dict(stats.outline)
    if stats is not None and stats.exits is not None:
        out["exits"] = dict(stats.exits)
    return out


def _drop_notes(d: Any) -> None:
    if isinstance(d, dict):
        d.pop("fallback_reason", None)
        for v in d.values():
            _drop_notes(v)
