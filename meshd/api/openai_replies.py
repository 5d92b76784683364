"""OpenAI's reply shapes: completions, stream chunks, the model list, server-sent events.

Pure builders of the JSON objects OpenAI clients parse; the routes
(:mod:`meshd.api.openai_routes`) decide which to send when.
"""

from __future__ import annotations

import json
import time
from typing import Any


def now() -> int:
    return int(time.time())


def models_list(model_ids: list[str]) -> dict[str, Any]:
    return {"object": "list", "data": [model_object(m) for m in model_ids]}


def model_object(model_id: str) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": 0, "owned_by": "meshd"}


def chat_response(
    rid: str, created: int, model: str, text: str, finish: str, usage: dict[str, Any],
    tool_calls: list[dict[str, Any]] | None = None, reasoning: str = "",
) -> dict[str, Any]:
    """``reasoning``: a thinking model's think block, as ``reasoning_content`` (left out when none)."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if tool_calls:
        message = {"role": "assistant", "content": text or None, "tool_calls": tool_calls}
    if reasoning:
        message["reasoning_content"] = reasoning
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": None,
                "finish_reason": finish,
            }
        ],
        "usage": usage,
    }


def chat_chunk(
    rid: str,
    created: int,
    model: str,
    *,
    delta: dict[str, Any] | None = None,
    finish: str | None = None,
    usage: dict[str, int] | None = None,
    no_choices: bool = False,
) -> dict[str, Any]:
    """One ``chat.completion.chunk``; ``no_choices`` makes the trailing usage chunk."""
    chunk: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": []
        if no_choices
        else [{"index": 0, "delta": delta or {}, "logprobs": None, "finish_reason": finish}],
    }
    if usage is not None:
        chunk["usage"] = usage
    return chunk


def completion_response(
    rid: str, created: int, model: str, text: str, finish: str | None,
    usage: dict[str, int] | None = None, *, no_choices: bool = False,
) -> dict[str, Any]:
    """A ``text_completion`` object; streaming chunks use the same shape."""
    body: dict[str, Any] = {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": []
        if no_choices
        else [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
    }
    if usage is not None:
        body["usage"] = usage
    return body


def sse(obj: dict[str, Any]) -> bytes:
    """One server-sent event carrying a JSON object."""
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
