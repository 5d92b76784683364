"""The asyncio client: :class:`AsyncMeshdClient`, and :class:`AsyncChatStream` for a streamed answer.

On httpx too, so an asyncio app does not block its loop; the same methods as
the blocking client (:mod:`meshd.client.sync`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx

from meshd.client.target import ClientBase
from meshd.client.wire import (
    Messages, StreamResult, StreamState, api_error, completion_of, messages_of, request_body,
)


class AsyncChatStream(StreamResult):
    """``async for`` text deltas; afterwards ``.text``, ``.usage``, ``.finish_reason``."""

    def __init__(self, resp: httpx.Response, state: StreamState):
        self._resp, self._state = resp, state

    async def __aiter__(self) -> AsyncIterator[str]:
        try:
            async for raw in self._resp.aiter_lines():
                text = self._state.read(raw)
                if text is None:
                    break
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


class AsyncMeshdClient(ClientBase):
    """asyncio client (httpx); use ``async with``. Same ``base_url``/``api_key`` as the sync one."""

    http_class, transport_class = httpx.AsyncClient, httpx.AsyncHTTPTransport

    async def _send(self, method: str, url: str, body: dict | None, stream: bool) -> httpx.Response:
        req = self._http.build_request(method, url, json=body)
        try:
            resp = await self._http.send(req, stream=stream)
        except httpx.TransportError as exc:
            raise self._target.no_answer(exc) from exc
        if resp.status_code >= 400:
            raw = await resp.aread()
            await resp.aclose()
            raise api_error(resp.status_code, raw)
        return resp

    async def _json(self, method: str, url: str, body: dict | None = None) -> dict[str, Any]:
        return (await self._send(method, url, body, stream=False)).json()

    async def status(self) -> dict[str, Any]:
        return await self._json("GET", "/v1/mesh/status")

    async def models(self) -> list[dict[str, Any]]:
        return (await self._json("GET", "/v1/models"))["data"]

    async def chat(self, messages: Messages, *, stream: bool = False, **params: Any):
        body = request_body("messages", messages_of(messages), stream, self.model, params)
        return await self._complete("/v1/chat/completions", body, stream, chat=True)

    async def complete(self, prompt: str | list[int], *, stream: bool = False, **params: Any):
        body = request_body("prompt", prompt, stream, self.model, params)
        return await self._complete("/v1/completions", body, stream, chat=False)

    async def _complete(self, url: str, body: dict, stream: bool, chat: bool):
        state = StreamState()
        if stream:
            return AsyncChatStream(await self._send("POST", url, body, stream=True), state)
        return completion_of(await self._json("POST", url, body), chat)

    async def close(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncMeshdClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
