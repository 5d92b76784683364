"""A small client for apps talking to meshd over its unix socket (or its TCP listener).

Two flavours with the same methods — :class:`MeshdClient` (blocking) and
:class:`AsyncMeshdClient` (asyncio) — both on httpx, which speaks HTTP over a
unix socket as well as TCP, so an asyncio app does not block its loop. HTTP
is parsed by httpx; this module only speaks the OpenAI JSON and server-sent
events on top. ``base_url="http://host:11434"`` with ``api_key=`` reaches a
daemon's ``--http`` listener from another machine.

    from meshd.client import MeshdClient
    with MeshdClient() as c:
        for piece in c.chat("Why is the sky blue?", stream=True):
            print(piece, end="", flush=True)

Any OpenAI client works too (see the README), this one just knows where the
socket is and says clearly when no daemon is running.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

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


def _not_running(path: Path, exc: BaseException) -> MeshdError:
    cause = exc
    while cause.__cause__ is not None or cause.__context__ is not None:  # httpx wraps the OSError
        if isinstance(cause, OSError):
            break
        cause = cause.__cause__ or cause.__context__
    if isinstance(cause, FileNotFoundError):
        return DaemonNotRunning(path, "no socket there")
    if isinstance(cause, ConnectionRefusedError):
        return DaemonNotRunning(path, "socket exists but nothing is listening")
    if isinstance(cause, PermissionError):
        return MeshdError(
            f"permission denied on {path}; add your user to the 'meshd' group "
            f"(the socket is mode 0660) and log in again"
        )
    return DaemonNotRunning(path, str(cause))


class _Target:
    """Where requests go: the unix socket (default) or a TCP base URL, with an optional key."""

    def __init__(self, socket_path, base_url: str | None, api_key: str | None, timeout: float):
        self.socket_path = Path(socket_path) if socket_path else default_socket_path()
        self.base_url = base_url.rstrip("/") if base_url else None
        self.where = self.base_url or str(self.socket_path)
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = httpx.Timeout(timeout, connect=min(timeout, 10.0))

    def client_kwargs(self, transport_cls) -> dict[str, Any]:
        kw: dict[str, Any] = {"timeout": self.timeout, "headers": self.headers}
        if self.base_url:
            kw["base_url"] = self.base_url
        else:
            kw["base_url"] = "http://localhost"
            kw["transport"] = transport_cls(uds=str(self.socket_path))
        return kw

    def unreachable(self, exc: BaseException) -> MeshdError:
        if self.base_url:
            return DaemonNotRunning(self.base_url, f"cannot connect: {exc}")
        return _not_running(self.socket_path, exc)


# --------------------------------------------------------------------------- sync


class ChatStream(_StreamResult):
    """Iterate for text deltas; afterwards ``.text``, ``.usage``, ``.finish_reason``."""

    def __init__(self, resp: httpx.Response, state: _StreamState):
        self._resp, self._state = resp, state

    def __iter__(self) -> Iterator[str]:
        sse = _SSEParser()
        try:
            for raw in self._resp.iter_lines():
                event = sse.feed(raw.encode() + b"\n")
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
        self._resp.close()

    def __enter__(self) -> ChatStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class MeshdClient:
    """Blocking client. ``base_url``/``api_key`` reach a TCP listener instead of the socket."""

    def __init__(self, socket_path: str | os.PathLike | None = None, *,
                 timeout: float = DEFAULT_TIMEOUT_S, model: str | None = None,
                 base_url: str | None = None, api_key: str | None = None):
        self._target = _Target(socket_path, base_url, api_key, timeout)
        self.socket_path = self._target.socket_path
        self.timeout = timeout
        self.model = model
        self._http = httpx.Client(**self._target.client_kwargs(httpx.HTTPTransport))

    def _send(self, method: str, url: str, body: dict | None, stream: bool) -> httpx.Response:
        req = self._http.build_request(method, url, json=body)
        try:
            resp = self._http.send(req, stream=stream)
        except httpx.TimeoutException as exc:
            raise MeshdError(f"meshd at {self._target.where} did not answer in {self.timeout:g}s") from exc
        except httpx.TransportError as exc:
            raise self._target.unreachable(exc) from exc
        if resp.status_code >= 400:
            raw = resp.read()
            resp.close()
            raise _api_error(resp.status_code, raw)
        return resp

    def _json(self, method: str, url: str, body: dict | None = None) -> dict[str, Any]:
        resp = self._send(method, url, body, stream=False)
        return resp.json()

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
            return ChatStream(self._send("POST", url, body, stream=True), state)
        return _completion(self._json("POST", url, body), chat)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> MeshdClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _completion(raw: dict[str, Any], chat: bool) -> Completion:
    choice = (raw.get("choices") or [{}])[0]
    text = (choice.get("message") or {}).get("content", "") if chat else choice.get("text", "")
    return Completion(text or "", choice.get("finish_reason"), raw.get("usage"),
                      raw.get("id"), raw.get("model"), raw)


# --------------------------------------------------------------------------- async


class AsyncChatStream(_StreamResult):
    """``async for`` text deltas; afterwards ``.text``, ``.usage``, ``.finish_reason``."""

    def __init__(self, resp: httpx.Response, state: _StreamState):
        self._resp, self._state = resp, state

    async def __aiter__(self) -> AsyncIterator[str]:
        sse = _SSEParser()
        try:
            async for raw in self._resp.aiter_lines():
                event = sse.feed(raw.encode() + b"\n")
                if sse.done:
                    break
                text = self._state.take(event) if event is not None else ""
                if text:
                    yield text
        finally:
            self._state.end()
            await self._resp.aclose()

    async def aclose(self) -> None:
        """Stop early; the daemon notices the hang-up and stops generating."""
        await self._resp.aclose()

    async def __aenter__(self) -> AsyncChatStream:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()


class AsyncMeshdClient:
    """asyncio client (httpx); use ``async with``. Same ``base_url``/``api_key`` as the sync one."""

    def __init__(self, socket_path: str | os.PathLike | None = None, *,
                 timeout: float = DEFAULT_TIMEOUT_S, model: str | None = None,
                 base_url: str | None = None, api_key: str | None = None):
        self._target = _Target(socket_path, base_url, api_key, timeout)
        self.socket_path = self._target.socket_path
        self.timeout = timeout
        self.model = model
        self._http = httpx.AsyncClient(**self._target.client_kwargs(httpx.AsyncHTTPTransport))

    async def _send(self, method: str, url: str, body: dict | None, stream: bool) -> httpx.Response:
        req = self._http.build_request(method, url, json=body)
        try:
            resp = await self._http.send(req, stream=stream)
        except httpx.TimeoutException as exc:
            raise MeshdError(f"meshd at {self._target.where} did not answer in {self.timeout:g}s") from exc
        except httpx.TransportError as exc:
            raise self._target.unreachable(exc) from exc
        if resp.status_code >= 400:
            raw = await resp.aread()
            await resp.aclose()
            raise _api_error(resp.status_code, raw)
        return resp

    async def _json(self, method: str, url: str, body: dict | None = None) -> dict[str, Any]:
        return (await self._send(method, url, body, stream=False)).json()

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
            return AsyncChatStream(await self._send("POST", url, body, stream=True), state)
        return _completion(await self._json("POST", url, body), chat)

    async def close(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncMeshdClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
