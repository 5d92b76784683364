"""The HTTP server: validation, errors, status, sockets, cancellation."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import stat

import aiohttp
import httpx
import pytest

from meshd.api.common import LISTENING
from meshd.api.listen import ApiStartError, parse_listen
from meshd.api.server import create_app, start_api
from meshd.engine.errors import PromptTooLong
from tests.support.api import REPLY, STATUS, FakeEngine, ServerThread
from tests.support.waiting import wait_until

CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]


def http(srv: ServerThread) -> httpx.Client:
    return httpx.Client(transport=httpx.HTTPTransport(uds=str(srv.socket_path)),
                        base_url="http://localhost")


@pytest.mark.parametrize(
    "path, body, param",
    [
        (CHAT, {"messages": []}, "messages"),
        (CHAT, {}, "messages"),
        (CHAT, {"messages": "hi"}, "messages"),
        (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        (CHAT, {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
         "messages[0].content[0]"),
        (CHAT, {"messages": HI, "max_tokens": -1}, "max_tokens"),
        (CHAT, {"messages": HI, "max_tokens": 0}, "max_tokens"),
        (CHAT, {"messages": HI, "max_tokens": "10"}, "max_tokens"),
        (CHAT, {"messages": HI, "max_tokens": True}, "max_tokens"),
        (CHAT, {"messages": HI, "temperature": "hot"}, "temperature"),
        (CHAT, {"messages": HI, "temperature": 3}, "temperature"),
        (CHAT, {"messages": HI, "top_p": 0}, "top_p"),
        (CHAT, {"messages": HI, "seed": 1.5}, "seed"),
        (CHAT, {"messages": HI, "stop": 7}, "stop"),
        (CHAT, {"messages": HI, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        (CHAT, {"messages": HI, "stream": "yes"}, "stream"),
        (CHAT, {"messages": HI, "n": 2}, "n"),
        (CHAT, {"messages": HI, "model": 3}, "model"),
        ("/v1/completions", {"prompt": 12}, "prompt"),
        ("/v1/completions", {"prompt": ["a", "b"]}, "prompt"),
        ("/v1/completions", {"prompt": ""}, "prompt"),
        ("/v1/completions", {"prompt": "x", "echo": True}, "echo"),
    ],
)
def test_bad_fields_get_a_400_naming_the_field(server, path, body, param):
    with http(server) as c:
        r = c.post(path, json=body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param
        assert r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("raw", [b"", b"not json", b"[1, 2]", b'"text"', b"\xff\xfe"])
def test_a_body_that_is_not_a_json_object_is_400(server, raw):
    with http(server) as c:
        r = c.post(CHAT, content=raw)
        assert r.status_code == 400
        assert r.json()["error"]["code"] == "invalid_json"


def test_unknown_fields_from_openai_clients_are_ignored(server):
    with http(server) as c:
        r = c.post(CHAT, json={"messages": HI, "user": "ann", "presence_penalty": 0,
                               "logit_bias": None, "max_completion_tokens": 4})
        assert r.status_code == 200
        assert r.json()["choices"][0]["message"]["content"] == REPLY[:4]


def test_text_parts_and_developer_role_are_accepted(server, engine):
    with http(server) as c:
        r = c.post(CHAT, json={"messages": [
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        ]})
        assert r.status_code == 200
    assert engine.requests[-1].messages == [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"}]


def test_the_meshd_alias_is_accepted_as_a_model_id(server):
    with http(server) as c:
        assert c.post(CHAT, json={"messages": HI, "model": "meshd"}).status_code == 200


def test_token_id_prompts_are_accepted(server, engine):
    with http(server) as c:
        r = c.post("/v1/completions", json={"prompt": [104, 105], "max_tokens": 2})
        assert r.json()["choices"][0]["text"] == REPLY[:2]
    assert engine.requests[-1].prompt_ids == [104, 105]


def test_max_tokens_is_clipped_to_the_room_left_in_the_context():
    with ServerThread(FakeEngine(reply="y" * 100, context_length=40)) as srv, http(srv) as c:
        r = c.post("/v1/completions", json={"prompt": "x" * 30, "max_tokens": 1000})
        assert r.json()["choices"][0]["finish_reason"] == "length"
        assert r.json()["usage"]["completion_tokens"] == 10


def test_prompt_too_long_from_the_engine_is_413(engine, server):
    engine.fail_before = PromptTooLong("prompt is 900 tokens; the plan's cache holds 512")
    with http(server) as c:
        r = c.post(CHAT, json={"messages": HI, "stream": True})
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "context_length_exceeded"


def test_without_an_engine_generation_is_503_and_models_is_empty():
    with ServerThread(None) as srv, http(srv) as c:
        r = c.post(CHAT, json={"messages": HI})
        assert r.status_code == 503
        assert r.json()["error"]["code"] == "engine_unavailable"
        assert c.get("/v1/models").json() == {"object": "list", "data": []}


def test_unknown_paths_and_methods_get_openai_errors(server):
    with http(server) as c:
        r = c.get("/v1/nothing")
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
        r = c.get(CHAT)
        assert r.status_code == 405 and "error" in r.json()


def test_mesh_status_is_the_daemon_status_plus_api_measurements(server):
    with http(server) as c:
        c.post(CHAT, json={"messages": HI})
        s = c.get("/v1/mesh/status").json()
    assert s["home"]["name"] == "smith-home" and s["members"] == STATUS["members"]
    assert s["model"] == "fake-model"
    assert s["requests_in_flight"] == 0
    assert s["recent"]["requests"] == 1 and s["recent"]["ttft_s"] is not None
    assert s["api"]["socket"] == str(server.socket_path)


def test_async_status_providers_are_awaited(short_tmp):
    async def provider():
        return {"home": "async-home"}

    async def main():
        runner = await start_api(create_app(FakeEngine(), provider), short_tmp / "s.sock")
        try:
            conn = aiohttp.UnixConnector(path=str(short_tmp / "s.sock"))
            async with aiohttp.ClientSession(connector=conn) as s:
                async with s.get("http://localhost/v1/mesh/status") as r:
                    return await r.json()
        finally:
            await runner.cleanup()

    assert asyncio.run(main())["home"] == "async-home"


# --------------------------------------------------------------------------- sockets


def test_socket_is_mode_0660_in_a_created_directory_and_removed_on_stop(engine):
    with ServerThread(engine) as srv:
        st = os.stat(srv.socket_path)
        assert stat.S_ISSOCK(st.st_mode)
        assert stat.S_IMODE(st.st_mode) == 0o660
        path = srv.socket_path
    assert not path.exists()


def test_a_stale_socket_file_is_replaced(short_tmp):
    path = short_tmp / "meshd.sock"
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(str(path))
    dead.close()  # file stays, nobody listens
    with socket.socket(socket.AF_UNIX) as probe, pytest.raises(ConnectionRefusedError):
        probe.connect(str(path))

    async def main():
        runner = await start_api(create_app(FakeEngine()), path)
        try:
            async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=str(path)),
                                         base_url="http://localhost") as c:
                return (await c.get("/v1/models")).status_code
        finally:
            await runner.cleanup()

    assert asyncio.run(main()) == 200  # a live socket in its place answers


def test_a_live_daemon_socket_is_not_taken_over(server):
    async def main():
        await start_api(create_app(FakeEngine()), server.socket_path)

    with pytest.raises(ApiStartError, match="already serving"):
        asyncio.run(main())
    with http(server) as c:  # the first daemon still serves
        assert c.get("/v1/models").status_code == 200


def test_a_regular_file_at_the_socket_path_is_left_alone(short_tmp):
    path = short_tmp / "meshd.sock"
    path.write_text("precious")
    with pytest.raises(ApiStartError, match="not a socket"):
        asyncio.run(start_api(create_app(FakeEngine()), path))
    assert path.read_text() == "precious"


@pytest.mark.parametrize("spec", ["0.0.0.0:8080", "192.168.1.10:8080", ":8080", "[::]:80",
                                  "example.com:80", "127.0.0.1:http", "127.0.0.1"])
def test_tcp_listen_is_refused_off_loopback(spec):
    with pytest.raises(ApiStartError):
        parse_listen(spec)


def test_loopback_listen_specs_parse():
    assert parse_listen("127.0.0.1:8080") == ("127.0.0.1", 8080)
    assert parse_listen("localhost:0") == ("127.0.0.1", 0)
    assert parse_listen("[::1]:9") == ("::1", 9)


def test_tcp_on_loopback_serves_the_same_api(engine):
    with ServerThread(engine, listen="127.0.0.1:0") as srv:
        tcp = srv.app[LISTENING]["tcp"]
        r = httpx.post(f"http://{tcp}/v1/chat/completions", json={"messages": HI})
        assert r.json()["choices"][0]["message"]["content"] == REPLY


# --------------------------------------------------------------------------- cancellation


def test_a_client_hanging_up_mid_stream_stops_the_generation(engine, server):
    engine.reply = "z" * 400
    engine.delay_s = 0.01
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(str(server.socket_path))
        body = json.dumps({"messages": HI, "stream": True}).encode()
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                  b"application/json\r\nContent-Length: " + str(len(body)).encode()
                  + b"\r\n\r\n" + body)
        assert b"200" in s.recv(4096)
        assert wait_until(lambda: engine.active == 1)
    assert wait_until(lambda: engine.closed_early == 1 and engine.active == 0)
    assert engine.finished_normally == 0
    with http(server) as c:
        assert wait_until(lambda: c.get("/v1/mesh/status").json()["requests_in_flight"] == 0)


def test_a_non_streaming_client_hanging_up_stops_the_generation(engine, server):
    engine.reply = "z" * 400
    engine.delay_s = 0.01
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(str(server.socket_path))
        body = json.dumps({"messages": HI}).encode()
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: "
                  + str(len(body)).encode() + b"\r\n\r\n" + body)
        assert wait_until(lambda: engine.active == 1)
    assert wait_until(lambda: engine.closed_early == 1 and engine.active == 0)
