"""meshd.client: the blocking and asyncio clients against a served fake engine."""

from __future__ import annotations

import asyncio
import socket

import pytest

from meshd.client import ApiError, AsyncMeshdClient, DaemonNotRunning, MeshdClient
from tests.support.api import REPLY


def test_chat_stream_yields_text_pieces_then_knows_usage_and_finish(server):
    stream = MeshdClient(server.socket_path).chat("hi", stream=True)
    pieces = list(stream)
    assert len(pieces) > 1 and "".join(pieces) == REPLY
    assert stream.text == REPLY
    assert stream.finish_reason == "stop"
    assert stream.usage["completion_tokens"] == len(REPLY)
    assert stream.ttft_s is not None and stream.elapsed_s >= stream.ttft_s


def test_chat_and_complete_without_streaming(server):
    c = MeshdClient(server.socket_path)
    r = c.chat([{"role": "user", "content": "hi"}], max_tokens=5, temperature=0)
    assert (r.text, r.finish_reason, r.usage["completion_tokens"]) == (REPLY[:5], "length", 5)
    assert c.complete("Once", stop="fake").text == "Hello from the "


def test_models_and_status(server):
    c = MeshdClient(server.socket_path)
    assert [m["id"] for m in c.models()] == ["fake-model"]
    assert c.status()["home"]["name"] == "smith-home"


def test_api_errors_carry_the_openai_error_fields(server):
    with pytest.raises(ApiError) as info:
        MeshdClient(server.socket_path).chat("hi", max_tokens=-1)
    assert (info.value.status, info.value.param) == (400, "max_tokens")


def test_missing_socket_is_daemon_not_running_naming_the_path(short_tmp):
    path = short_tmp / "meshd.sock"
    with pytest.raises(DaemonNotRunning, match=str(path)):
        MeshdClient(path).status()


def test_stale_socket_is_daemon_not_running(short_tmp):
    path = short_tmp / "meshd.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    s.close()
    with pytest.raises(DaemonNotRunning, match="nothing is listening"):
        MeshdClient(path).chat("hi")


def test_closing_a_stream_early_stops_the_generation(engine, server):
    from tests.support.waiting import wait_until

    engine.reply = "z" * 400
    engine.delay_s = 0.01
    stream = MeshdClient(server.socket_path).chat("hi", stream=True)
    next(iter(stream))
    stream.close()
    assert wait_until(lambda: engine.closed_early == 1 and engine.active == 0)


def test_async_client_streams_and_answers(server):
    async def main():
        async with AsyncMeshdClient(server.socket_path) as c:
            stream = await c.chat("hi", stream=True)
            pieces = [p async for p in stream]
            full = await c.complete("x", max_tokens=3)
            return pieces, stream, full, await c.models(), await c.status()

    pieces, stream, full, models, status = asyncio.run(main())
    assert "".join(pieces) == REPLY and stream.usage["completion_tokens"] == len(REPLY)
    assert full.text == REPLY[:3]
    assert models[0]["id"] == "fake-model" and status["home"]["name"] == "smith-home"


def test_async_client_reports_a_missing_daemon_and_api_errors(server, short_tmp):
    async def missing():
        async with AsyncMeshdClient(short_tmp / "none.sock") as c:
            await c.status()

    async def bad():
        async with AsyncMeshdClient(server.socket_path) as c:
            await c.chat("hi", temperature=9)

    with pytest.raises(DaemonNotRunning):
        asyncio.run(missing())
    with pytest.raises(ApiError, match="temperature"):
        asyncio.run(bad())
