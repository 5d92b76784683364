"""The blocking client: :class:`MeshdClient`, and :class:`ChatStream` for a streamed answer."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx

from meshd.client.target import ClientBase
from meshd.client.wire import (
    Completion, Messages, StreamResult, StreamState, api_error, completion_of, messages_of,
    request_body,
)


class ChatStream(StreamResult):
    """Iterate for text deltas; afterwards ``.text``, ``.usage``, ``.finish_reason``."""

    def __init__(self, resp: httpx.Response, state: StreamState):
        self._resp, self._state = resp, state

    def __iter__(self) -> Iterator[str]:
        try:
            for raw in self._resp.iter_lines():
                text = self._state.read(raw)
                if text is None:
                    break
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


class MeshdClient(ClientBase):
    """Blocking client. ``base_url``/``api_key`` reach a TCP listener instead of the socket."""

    http_class, transport_class = httpx.Client, httpx.HTTPTransport

    def _send(self, method: str, url: str, body: dict | None, stream: bool) -> httpx.Response:
        req = self._http.build_request(method, url, json=body)
        try:
            resp = self._http.send(req, stream=stream)
        except httpx.TransportError as exc:
            raise self._target.no_answer(exc) from exc
        if resp.status_code >= 400:
            raw = resp.read()
            resp.close()
            raise api_error(resp.status_code, raw)
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
        body = request_body("messages", messages_of(messages), stream, self.model,
                            dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                 seed=seed, stop=stop, **extra))
        return self._complete("/v1/chat/completions", body, stream, chat=True)

    def complete(self, prompt: str | list[int], *, stream: bool = False,
                 max_tokens: int | None = None, temperature: float | None = None,
                 top_p: float | None = None, seed: int | None = None,
                 stop: str | list[str] | None = None, **extra: Any) -> Completion | ChatStream:
        """Plain text completion of ``prompt``."""
        body = request_body("prompt", prompt, stream, self.model,
                            dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                 seed=seed, stop=stop, **extra))
        return self._complete("/v1/completions", body, stream, chat=False)

    def _complete(self, url: str, body: dict, stream: bool, chat: bool):
        state = StreamState()
        if stream:
            return ChatStream(self._send("POST", url, body, stream=True), state)
        return completion_of(self._json("POST", url, body), chat)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> MeshdClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
