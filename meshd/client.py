"""A small client for apps talking to the local meshd over its unix socket.

Two flavours with the same methods — :class:`MeshdClient` (blocking, stdlib
``http.client`` over ``AF_UNIX``) and :class:`AsyncMeshdClient` (aiohttp's
``UnixConnector``) — so that a script needs no dependency beyond meshd and an
asyncio app does not block its loop. HTTP itself is parsed by those libraries;
this module only speaks the OpenAI JSON and server-sent events on top.

    from meshd.client import MeshdClient
    with MeshdClient() as c:
        for piece in c.chat("Why is the sky blue?", stream=True):
            print(piece, end="", flush=True)

Any OpenAI client works too (see the README), this one just knows where the
socket is and says clearly when no daemon is running.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshd.errors import MeshdError
from meshd.paths import default_socket_path

DEFAULT_TIMEOUT_S = 600.0  # a long answer on slow devices takes minutes


class DaemonNotRunning(MeshdError):
    """No meshd answers on the socket (missing, refused, or not accessible)."""

    def __init__(self, socket_path: str | os.PathLike, why: str):
        self.socket_path = str(socket_path)
        super().__init__(
            f"no meshd daemon is running at {socket_path} ({why}); start it with "
            f"'systemctl start meshd' (or 'meshd join' in a terminal), or pass --socket PATH "
            f"if it listens elsewhere"
        )


class ApiError(MeshdError):
    """The daemon answered with an OpenAI-style error object."""

    def __init__(self, status: int, message: str, type: str | None = None,
                 code: str | None = None, param: str | None = None):
        self.status, self.type, self.code, self.param = status, type, code, param
        super().__init__(f"{message} (HTTP {status}{', ' + code if code else ''})")


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


@dataclass
class _StreamState:
    """Accumulates a streamed answer; shared by the sync and async streams."""

    started: float = field(default_factory=time.monotonic)
    parts: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict[str, int] | None = None
    id: str | None = None
    model: str | None = None
    first_text_at: float | None = None
    ended_at: float | None = None

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


class _StreamResult:
    """What a stream knows once iterated: text, finish reason, usage, timings."""

    _state: _StreamState

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


def _messages(messages: Messages) -> list[dict[str, Any]]:
    return [{"role": "user", "content": messages}] if isinstance(messages, str) else list(messages)


def _body(key: str, value: Any, stream: bool, model: str | None, params: dict[str, Any]) -> dict:
    body: dict[str, Any] = {key: value, "stream": stream}
    if model:
        body["model"] = model
    if stream:
        body["stream_options"] = {"include_usage": True}
    body.update({k: v for k, v in params.items() if v is not None})
    return body


class _SSEParser:
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


def _api_error(status: int, raw: bytes) -> ApiError:
    try:
        err = json.loads(raw)["error"]
        return ApiError(status, err.get("message", ""), err.get("type"), err.get("code"),
                        err.get("param"))
    except (ValueError, KeyError, TypeError, AttributeError):
        return ApiError(status, raw.decode(errors="replace").strip()[:200] or "request failed")


def _not_running(path: Path, exc: OSError) -> MeshdError:
    if isinstance(exc, FileNotFoundError):
        return DaemonNotRunning(path, "no socket there")
    if isinstance(exc, ConnectionRefusedError):
        return DaemonNotRunning(path, "socket exists but nothing is listening")
    if isinstance(exc, PermissionError):
        return MeshdError(
            f"permission denied on {path}; add your user to the 'meshd' group "
            f"(the socket is mode 0660) and log in again"
        )
    return DaemonNotRunning(path, str(exc))


# --------------------------------------------------------------------------- sync


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self._unix_path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self._unix_path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


class ChatStream(_StreamResult):
    """Iterate for text deltas; afterwards ``.text``, ``.usage``, ``.finish_reason``."""

    def __init__(self, conn: _UnixHTTPConnection, resp: http.client.HTTPResponse, state: _StreamState):
        self._conn, self._resp, self._state = conn, resp, state

    def __iter__(self) -> Iterator[str]:
        sse = _SSEParser()
        try:
            for raw in iter(self._resp.readline, b""):
                event = sse.feed(raw)
                if sse.done:
                    break
                text = self._state.take(event) if event is not None else ""
                if text:
                    yield text
        finally:
            self._state.end()
            self.close()

    def close(self) -> None:
        """Stop early: closing the connection makes the daemon stop generating."""
        self._conn.close()

    def __enter__(self) -> ChatStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class MeshdClient:
    """Blocking client; one connection per request (the socket is local and cheap)."""

    def __init__(self, socket_path: str | os.PathLike | None = None, *,
                 timeout: float = DEFAULT_TIMEOUT_S, model: str | None = None):
        self.socket_path = Path(socket_path) if socket_path else default_socket_path()
        self.timeout = timeout
        self.model = model

    def _request(self, method: str, url: str, body: dict | None = None):
        conn = _UnixHTTPConnection(str(self.socket_path), self.timeout)
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if data is not None else {}
        try:
            conn.request(method, url, body=data, headers=headers)
            resp = conn.getresponse()
        except OSError as exc:
            conn.close()
            if isinstance(exc, (socket.timeout, TimeoutError)):
                raise MeshdError(f"meshd at {self.socket_path} did not answer in {self.timeout:g}s") from exc
            raise _not_running(self.socket_path, exc) from exc
        if resp.status >= 400:
            raw = resp.read()
            conn.close()
            raise _api_error(resp.status, raw)
        return conn, resp

    def _json(self, method: str, url: str, body: dict | None = None) -> dict[str, Any]:
        conn, resp = self._request(method, url, body)
        try:
            return json.loads(resp.read())
        finally:
            conn.close()

    def status(self) -> dict[str, Any]:
        """The mesh status dict (members, plan, model, recent speed)."""
        return self._json("GET", "/v1/mesh/status")

    def models(self) -> list[dict[str, Any]]:
        return self._json("GET", "/v1/models")["data"]

    def chat(self, messages: Messages, *, stream: bool = False, max_tokens: int | None = None,
             temperature: float | None = None, top_p: float | None = None,
             seed: int | None = None, stop: str | list[str] | None = None,
             **extra: Any) -> Completion | ChatStream:
        """Chat completion; ``messages`` may be a plain string (one user turn)."""
        body = _body("messages", _messages(messages), stream, self.model,
                     dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                          seed=seed, stop=stop, **extra))
        return self._complete("/v1/chat/completions", body, stream, chat=True)

    def complete(self, prompt: str | list[int], *, stream: bool = False,
                 max_tokens: int | None = None, temperature: float | None = None,
                 top_p: float | None = None, seed: int | None = None,
                 stop: str | list[str] | None = None, **extra: Any) -> Completion | ChatStream:
        """Plain text completion of ``prompt``."""
        body = _body("prompt", prompt, stream, self.model,
                     dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                          seed=seed, stop=stop, **extra))
        return self._complete("/v1/completions", body, stream, chat=False)

    def _complete(self, url: str, body: dict, stream: bool, chat: bool):
        state = _StreamState()
        if stream:
            conn, resp = self._request("POST", url, body)
            return ChatStream(conn, resp, state)
        raw = self._json("POST", url, body)
        return _completion(raw, chat)

    def __enter__(self) -> MeshdClient:
        return self

    def __exit__(self, *exc) -> None:
        pass


def _completion(raw: dict[str, Any], chat: bool) -> Completion:
    choice = (raw.get("choices") or [{}])[0]
    text = (choice.get("message") or {}).get("content", "") if chat else choice.get("text", "")
    return Completion(text or "", choice.get("finish_reason"), raw.get("usage"),
                      raw.get("id"), raw.get("model"), raw)


# --------------------------------------------------------------------------- async


class AsyncChatStream(_StreamResult):
    """``async for`` text deltas; afterwards ``.text``, ``.usage``, ``.finish_reason``."""

    def __init__(self, resp, state: _StreamState):
        self._resp, self._state = resp, state

    async def __aiter__(self) -> AsyncIterator[str]:
        sse = _SSEParser()
        try:
            async for raw in self._resp.content:
                event = sse.feed(raw)
                if sse.done:
                    break
                text = self._state.take(event) if event is not None else ""
                if text:
                    yield text
        finally:
            self._state.end()
            self._resp.release()

    async def aclose(self) -> None:
        """Stop early; the daemon notices the hang-up and stops generating."""
        self._resp.close()

    async def __aenter__(self) -> AsyncChatStream:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()


class AsyncMeshdClient:
    """asyncio client over aiohttp's UnixConnector; use ``async with``."""

    def __init__(self, socket_path: str | os.PathLike | None = None, *,
                 timeout: float = DEFAULT_TIMEOUT_S, model: str | None = None):
        self.socket_path = Path(socket_path) if socket_path else default_socket_path()
        self.timeout = timeout
        self.model = model
        self._session = None

    def _sess(self):
        import aiohttp

        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.UnixConnector(path=str(self.socket_path)),
                timeout=aiohttp.ClientTimeout(total=None, sock_read=self.timeout),
            )
        return self._session

    async def _request(self, method: str, url: str, body: dict | None = None):
        import aiohttp

        try:
            resp = await self._sess().request(method, "http://localhost" + url, json=body)
        except aiohttp.ClientConnectorError as exc:
            raise _not_running(self.socket_path, exc.os_error) from exc
        if resp.status >= 400:
            raw = await resp.read()
            resp.release()
            raise _api_error(resp.status, raw)
        return resp

    async def _json(self, method: str, url: str, body: dict | None = None) -> dict[str, Any]:
        resp = await self._request(method, url, body)
        try:
            return json.loads(await resp.read())
        finally:
            resp.release()

    async def status(self) -> dict[str, Any]:
        return await self._json("GET", "/v1/mesh/status")

    async def models(self) -> list[dict[str, Any]]:
        return (await self._json("GET", "/v1/models"))["data"]

    async def chat(self, messages: Messages, *, stream: bool = False, **params: Any):
        body = _body("messages", _messages(messages), stream, self.model, params)
        return await self._complete("/v1/chat/completions", body, stream, chat=True)

    async def complete(self, prompt: str | list[int], *, stream: bool = False, **params: Any):
        body = _body("prompt", prompt, stream, self.model, params)
        return await self._complete("/v1/completions", body, stream, chat=False)

    async def _complete(self, url: str, body: dict, stream: bool, chat: bool):
        state = _StreamState()
        if stream:
            return AsyncChatStream(await self._request("POST", url, body), state)
        return _completion(await self._json("POST", url, body), chat)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def __aenter__(self) -> AsyncMeshdClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
