"""The OpenAI wire as a client reads and writes it, the same for the blocking and asyncio clients.

Request bodies, the answer of a finished request, and a streamed answer:
server-sent events parsed a line at a time (:class:`SSEParser`) into the text
deltas, finish reason and usage a stream accumulates (:class:`StreamState`).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from meshd.client.errors import ApiError

Messages = str | list[dict[str, Any]]


@dataclass
class Completion:
    """A finished answer."""

    text: str
    finish_reason: str | None
    usage: dict[str, int] | None
    id: str | None = None
    model: str | None = None
    raw: dict[str, Any] | None = None


class SSEParser:
    """Server-sent events, one line at a time: returns a JSON payload per event.

    Only ``data:`` fields matter for the OpenAI stream; ``[DONE]`` sets ``done``.
    """

    def __init__(self) -> None:
        self._data: list[bytes] = []
        self.done = False

    def feed(self, raw: bytes) -> dict[str, Any] | None:
        line = raw.rstrip(b"\r\n")
        if line.startswith(b"data:"):
            self._data.append(line[5:].removeprefix(b" "))
            return None
        if line or not self._data:
            return None  # comments, other fields, keep-alive blank lines
        payload, self._data = b"\n".join(self._data), []
        if payload == b"[DONE]":
            self.done = True
            return None
        return json.loads(payload)


@dataclass
class StreamState:
    """Accumulates a streamed answer; shared by the sync and async streams."""

    started: float = field(default_factory=time.monotonic)
    parts: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict[str, int] | None = None
    id: str | None = None
    model: str | None = None
    first_text_at: float | None = None
    ended_at: float | None = None
    sse: SSEParser = field(default_factory=SSEParser)

    def read(self, line: str) -> str | None:
        """The text delta one line of the stream completes ("" for none); None once the stream is done."""
        event = self.sse.feed(line.encode() + b"\n")
        if self.sse.done:
            return None
        return self.take(event) if event is not None else ""

    def take(self, event: dict[str, Any]) -> str:
        """Return the text delta in ``event`` (raises :class:`ApiError` on an error event)."""
        if "error" in event:
            err = event["error"] or {}
            raise ApiError(200, err.get("message", "generation failed"), err.get("type"),
                           err.get("code"), err.get("param"))
        self.id = event.get("id", self.id)
        self.model = event.get("model", self.model)
        if event.get("usage"):
            self.usage = event["usage"]
        text = ""
        for choice in event.get("choices") or []:
            delta = choice.get("delta")
            piece = (delta or {}).get("content") if delta is not None else choice.get("text")
            text += piece or ""
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        if text:
            if self.first_text_at is None:
                self.first_text_at = time.monotonic()
            self.parts.append(text)
        return text

    def end(self) -> None:
        self.ended_at = self.ended_at or time.monotonic()


class StreamResult:
    """What a stream knows once iterated: text, finish reason, usage, timings."""

    _state: StreamState

    @property
    def text(self) -> str:
        return "".join(self._state.parts)

    @property
    def finish_reason(self) -> str | None:
        return self._state.finish_reason

    @property
    def usage(self) -> dict[str, int] | None:
        return self._state.usage

    @property
    def ttft_s(self) -> float | None:
        """Seconds from sending the request to the first text."""
        s = self._state
        return None if s.first_text_at is None else s.first_text_at - s.started

    @property
    def elapsed_s(self) -> float:
        s = self._state
        return (s.ended_at or time.monotonic()) - s.started

    def completion(self) -> Completion:
        s = self._state
        return Completion(self.text, s.finish_reason, s.usage, s.id, s.model)


def messages_of(messages: Messages) -> list[dict[str, Any]]:
    return [{"role": "user", "content": messages}] if isinstance(messages, str) else list(messages)


def request_body(key: str, value: Any, stream: bool, model: str | None, params: dict[str, Any]) -> dict:
    body: dict[str, Any] = {key: value, "stream": stream}
    if model:
        body["model"] = model
    if stream:
        body["stream_options"] = {"include_usage": True}
    body.update({k: v for k, v in params.items() if v is not None})
    return body


def api_error(status: int, raw: bytes) -> ApiError:
    try:
        err = json.loads(raw)["error"]
        return ApiError(status, err.get("message", ""), err.get("type"), err.get("code"),
                        err.get("param"))
    except (ValueError, KeyError, TypeError, AttributeError):
        return ApiError(status, raw.decode(errors="replace").strip()[:200] or "request failed")


def completion_of(raw: dict[str, Any], chat: bool) -> Completion:
    choice = (raw.get("choices") or [{}])[0]
    text = (choice.get("message") or {}).get("content", "") if chat else choice.get("text", "")
    return Completion(text or "", choice.get("finish_reason"), raw.get("usage"),
                      raw.get("id"), raw.get("model"), raw)
