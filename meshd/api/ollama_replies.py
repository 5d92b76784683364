"""Ollama's reply shapes: NDJSON lines, the streamed parts of an answer, its final message.

Ollama replies echo the model name the client asked for (:mod:`meshd.api.names`)
and time everything in nanoseconds; meshd's extensions ride in the final
message beside Ollama's own counts (:mod:`meshd.api.usage`).
"""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone
from typing import Any

from aiohttp import web

from meshd.api.answer import Run
from meshd.api.usage import ollama_extensions
from meshd.engine.base import TokenEvent

NDJSON = "application/x-ndjson"


def now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def line(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"


async def ndjson(request: web.Request, objs: list[dict]) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": NDJSON})
    await resp.prepare(request)
    for o in objs:
        await resp.write(line(o))
    await resp.write_eof()
    return resp


def loaded(model: str, kind: str) -> dict[str, Any]:
    """The answer to a request with nothing to generate (Ollama: it loads the model and says so)."""
    out: dict[str, Any] = {"model": model, "created_at": now(), "done": True, "done_reason": "load"}
    if kind == "chat":
        out["message"] = {"role": "assistant", "content": ""}
    else:
        out["response"] = ""
    return out


def part(kind: str, model: str, text: str, thinking: str = "") -> dict[str, Any]:
    """One streamed piece; ``thinking``: a thinking model's reasoning (Ollama's field, left out when none)."""
    base: dict[str, Any] = {"model": model, "created_at": now()}
    if kind == "chat":
        base["message"] = {"role": "assistant", "content": text}
        if thinking:
            base["message"]["thinking"] = thinking
    else:
        base["response"] = text
        if thinking:
            base["thinking"] = thinking
    base["done"] = False
    return base


def final(request: web.Request, kind: str, model: str, ev: TokenEvent, run: Run, started_ns: int,
          prompt_ids: list[int], generated: list[int]) -> dict[str, Any]:
    out = part(kind, model, "")
    now_ns = time.monotonic_ns()
    first_ns = int(run.first_token_at * 1e9) if run.first_token_at is not None else now_ns
    start_ns = int(run.started * 1e9)
    usage = ev.usage
    out.update({
        "done": True,
        "done_reason": ev.finish_reason,
        "total_duration": now_ns - started_ns,
        "load_duration": 0,
        # as Ollama counts it: only the prompt tokens evaluated (a cached prefix is not)
        "prompt_eval_count": usage.prompt_tokens - usage.stats.cached_tokens if usage else len(prompt_ids),
        "prompt_eval_duration": max(0, first_ns - start_ns),
        "eval_count": usage.completion_tokens if usage else 0,
        "eval_duration": max(0, now_ns - first_ns),
    })
    if kind == "generate":
        out["context"] = [*prompt_ids, *generated]
    out.update(ollama_extensions(request, usage))
    return out
