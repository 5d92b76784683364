"""Hostile and broken input: always a 4xx OpenAI error, never a 500, and the server keeps serving.

Each case is sent to a real server (the unix-socket app with a fake engine);
connection limits are configured short or small so the tests need no long waits.
"""

from __future__ import annotations

import json
import socket
import time

import httpx
import openai
import pytest

from meshd.api.common import LISTENING, ApiLimits
from meshd.engine.errors import EngineBusy, EngineUnavailable, GenerationFailed, NoPlan
from tests.support.api import REPLY, FakeEngine, ServerThread
from tests.support.logs import all_log_events
from tests.support.clients import http, sdk
from tests.support.waiting import wait_until

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HI = [{"role": "user", "content": "hi"}]
HI_JSON = b'[{"role": "user", "content": "hi"}]'
VOCAB = FakeEngine.vocab_size


def assert_openai_error(r: httpx.Response, status: int, param: str | None = None,
                        code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def assert_still_serving(srv: ServerThread) -> None:
    with http(srv) as c:
        r = c.post(CHAT, json={"messages": HI})
        assert r.status_code == 200
        assert r.json()["choices"][0]["message"]["content"] == REPLY


def chat_body(extra: bytes) -> bytes:
    return b'{"messages": ' + HI_JSON + b", " + extra + b"}"


# --------------------------------------------------------------------------- JSON


@pytest.mark.parametrize("raw, param", [
    (chat_body(b'"seed": ' + b"9" * 5000), None),  # over Python's int-from-string limit
    (chat_body(b'"seed": -' + b"9" * 200), None),
    (chat_body(b'"user": ' + b"[" * 100_000 + b"]" * 100_000), None),  # RecursionError depth
    (chat_body(b'"user": ' + b"[" * 70 + b"]" * 70), "user" + "[0]" * 63),  # over our 64 levels
    (chat_body(b'"metadata": ' + b'{"a": ' * 80 + b"1" + b"}" * 80), None),
    (b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages[0].content"),
    (b'{"messages": [{"role": "user", "content": "\\udfff"}]}', "messages[0].content"),
    (chat_body(b'"\\ud800": 1'), None),  # in a key
    (b'{"messages": [{"role": "user", "content": "\xed\xa0\x80"}]}', None),  # UTF-8-encoded surrogate
    (b'{"messages": [{"role": "user", "content": "\xc3"}]}', None),  # truncated UTF-8
    (chat_body(b'"temperature": NaN'), None),
    (chat_body(b'"temperature": -Infinity'), None),
    (b"\xef\xbb\xbf" + chat_body(b'"n": 1'), None),  # a BOM is not JSON
])
def test_hostile_json_is_a_400_and_the_server_keeps_serving(server, raw, param):
    with http(server) as c:
        r = c.post(CHAT, content=raw, headers={"Content-Type": "application/json"})
    err = assert_openai_error(r, 400, code="invalid_json")
    if param is not None:
        assert err["param"] == param
    assert_still_serving(server)


def test_valid_surrogate_pairs_and_shallow_nesting_are_fine(server, engine):
    raw = b'{"messages": [{"role": "user", "content": "\\ud83d\\ude00"}], "user": [[[[1]]]]}'
    with http(server) as c:
        assert c.post(CHAT, content=raw).status_code == 200
    assert "\U0001F600" in "".join(chr(t) for t in engine.requests[-1].prompt_ids)


# --------------------------------------------------------------------------- numeric ranges


@pytest.mark.parametrize("path, extra, param", [
    (CHAT, {"top_k": 10**30}, "top_k"),
    (CHAT, {"top_k": -1}, "top_k"),
    (CHAT, {"top_k": VOCAB + 1}, "top_k"),
    (CHAT, {"top_k": 2.0}, "top_k"),
    (CHAT, {"seed": 2**70}, "seed"),
    (CHAT, {"seed": 2**63}, "seed"),
    (CHAT, {"seed": -(2**63) - 1}, "seed"),
    (CHAT, {"seed": True}, "seed"),
    (CHAT, {"temperature": 2.5}, "temperature"),
    (CHAT, {"temperature": -0.1}, "temperature"),
    (CHAT, {"top_p": 1.5}, "top_p"),
    (CHAT, {"top_p": -1}, "top_p"),
    (CHAT, {"max_tokens": 0}, "max_tokens"),
    (CHAT, {"max_completion_tokens": -(10**30)}, "max_completion_tokens"),
    (CHAT, {"n": 0}, "n"),
    (CHAT, {"n": 10**30}, "n"),
    (CHAT, {"presence_penalty": 3}, "presence_penalty"),
    (CHAT, {"frequency_penalty": -2.5}, "frequency_penalty"),
    (CHAT, {"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    (COMPLETIONS, {"best_of": 10**30}, "best_of"),
])
def test_out_of_range_numbers_are_a_400_naming_the_field(server, path, extra, param):
    body = {"prompt": "hi"} if path == COMPLETIONS else {"messages": HI}
    with http(server) as c:
        r = c.post(path, json={**body, **extra})
    err = assert_openai_error(r, 400, param=param)
    assert err["type"] == "invalid_request_error"
    assert_still_serving(server)


@pytest.mark.parametrize("literal", [b"1e400", b"-1e400", b"1" + b"0" * 99])
def test_huge_number_literals_are_range_errors(server, literal):
    with http(server) as c:
        r = c.post(CHAT, content=chat_body(b'"temperature": ' + literal))
    assert_openai_error(r, 400, param="temperature", code="invalid_value")


@pytest.mark.parametrize("prompt", [[1, VOCAB], [2**63], [5, -1], [[2**64]]])
def test_token_ids_outside_the_vocabulary_are_a_400(server, prompt):
    with http(server) as c:
        r = c.post(COMPLETIONS, json={"prompt": prompt})
    assert_openai_error(r, 400, param="prompt")
    assert_still_serving(server)


@pytest.mark.parametrize("seed", [-(2**63), 2**63 - 1, 0])
def test_the_whole_signed_64_bit_seed_range_is_accepted(server, engine, seed):
    with http(server) as c:
        assert c.post(CHAT, json={"messages": HI, "seed": seed, "top_k": VOCAB}).status_code == 200
    s = engine.requests[-1].options.sampling.params
    assert (s.seed, s.top_k) == (seed, VOCAB)


def test_an_absurd_max_tokens_is_clipped_to_the_context():
    with ServerThread(FakeEngine(reply="y" * 100, context_length=40)) as srv, http(srv) as c:
        r = c.post(COMPLETIONS, json={"prompt": "x" * 30, "max_tokens": 10**30})
        assert r.status_code == 200
        assert r.json()["usage"]["completion_tokens"] == 10
        assert srv.engine.requests[-1].max_tokens == 10


# --------------------------------------------------------------------------- fields not implemented


@pytest.mark.parametrize("path, extra, param, code", [
    # the fake engine's template has no tool support, and it cannot constrain or penalise
    (CHAT, {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "tools_not_supported"),
    (CHAT, {"tool_choice": "required"}, "tool_choice", "invalid_value"),
    (CHAT, {"response_format": {"type": "json_object"}}, "response_format", "unsupported_parameter"),
    (CHAT, {"logit_bias": {"50256": -100}}, "logit_bias", "unsupported_parameter"),
    (CHAT, {"presence_penalty": 0.5}, "presence_penalty", "unsupported_parameter"),
    (CHAT, {"frequency_penalty": -1}, "presence_penalty", "unsupported_parameter"),
    (CHAT, {"logprobs": True}, "logprobs", "unsupported_parameter"),
    (CHAT, {"top_logprobs": 3}, "top_logprobs", "unsupported_parameter"),
    (CHAT, {"functions": [{"name": "f"}]}, "functions", "unsupported_parameter"),
    (COMPLETIONS, {"logit_bias": {"1": 5}}, "logit_bias", "unsupported_parameter"),
    (COMPLETIONS, {"logprobs": 2}, "logprobs", "unsupported_parameter"),
])
def test_what_cannot_be_honoured_is_refused_unless_at_its_default(server, path, extra, param, code):
    body = {"prompt": "hi"} if path == COMPLETIONS else {"messages": HI}
    with http(server) as c:
        r = c.post(path, json={**body, **extra})
    err = assert_openai_error(r, 400, param=param, code=code)
    assert "not supported" in err["message"] or code == "invalid_value"


def test_defaults_of_fields_not_implemented_are_accepted(server):
    with http(server) as c:
        r = c.post(CHAT, json={"messages": HI, "tools": [], "tool_choice": "none",
                               "response_format": {"type": "text"}, "logit_bias": {},
                               "presence_penalty": 0.0, "frequency_penalty": 0, "logprobs": False,
                               "top_logprobs": 0, "parallel_tool_calls": True, "user": "ann"})
        assert r.status_code == 200, r.text


def test_the_openai_sdk_surfaces_range_errors_as_bad_request(server):
    client = sdk(server)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="fake-model", messages=HI, seed=2**70)
    assert info.value.body["param"] == "seed"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="fake-model", messages=HI,
                                       response_format={"type": "json_object"})
    assert info.value.body["code"] == "unsupported_parameter"
    assert client.chat.completions.create(model="fake-model", messages=HI).choices[0].message.content == REPLY


# --------------------------------------------------------------------------- HTTP-level errors


def raw_exchange(srv: ServerThread, data: bytes, timeout: float = 10.0) -> bytes:
    """Send raw bytes, read until the server closes (error answers always close)."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(timeout)
        s.connect(str(srv.socket_path))
        s.sendall(data)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def parse_response(raw: bytes) -> tuple[int, dict[str, str], dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    return int(lines[0].split()[1]), headers, json.loads(body)


@pytest.mark.parametrize("data", [
    b"GARBAGE\r\n\r\n",
    b"G\x00T / HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET / HTTP/9.9x\r\nHost: x\r\n\r\n",
    b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20_000 + b"\r\n\r\n",
    b"GET /" + b"a" * 20_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
])
def test_aiohttps_own_parse_errors_are_openai_json(server, data):
    status, headers, body = parse_response(raw_exchange(server, data))
    assert 400 <= status < 500
    assert headers["content-type"].startswith("application/json")
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert_still_serving(server)


def test_bodies_over_the_limit_are_413_declared_or_chunked(engine):
    with ServerThread(engine, limits=ApiLimits(max_body_bytes=1000)) as srv, http(srv) as c:
        big = json.dumps({"messages": [{"role": "user", "content": "x" * 5000}]}).encode()
        assert_openai_error(c.post(CHAT, content=big), 413, code="request_too_large")
        assert_openai_error(c.post(CHAT, content=iter([big[:600], big[600:]])), 413,
                            code="request_too_large")  # chunked: no Content-Length
        assert c.post(CHAT, json={"messages": HI}).status_code == 200


def test_unexpected_exceptions_are_a_generic_500_without_internals(engine, server):
    def boom(_messages):
        raise KeyError("secret-internal-detail")

    engine.tokenizer.apply_chat = boom
    with http(server) as c:
        r = c.post(CHAT, json={"messages": HI})
    err = assert_openai_error(r, 500, code="internal_error")
    assert "KeyError" not in r.text and "secret" not in r.text and "Traceback" not in r.text
    assert err["type"] == "server_error"


def test_unexpected_exceptions_mid_stream_are_a_generic_in_band_error(engine, server):
    engine.fail_after = (3, KeyError("secret-internal-detail"))
    with http(server) as c:
        r = c.post(CHAT, json={"messages": HI, "stream": True})
    assert r.status_code == 200
    assert '"internal_error"' in r.text and "secret" not in r.text and "KeyError" not in r.text
    engine.fail_after = None
    assert_still_serving(server)


def test_each_rejected_request_is_one_structured_log_line(server):
    with all_log_events() as logs, http(server) as c:
        c.post(CHAT, json={"messages": HI, "top_k": -5})
    rejected = [e for e in logs if e["event"] == "api_request_rejected"]
    assert len(rejected) == 1
    assert rejected[0]["status"] == 400 and rejected[0]["param"] == "top_k"
    assert rejected[0]["path"] == CHAT and rejected[0]["code"] == "invalid_value"


# --------------------------------------------------------------------------- Retry-After


@pytest.mark.parametrize("exc, code, retry_after", [
    (EngineBusy("the KV cache is full"), "busy", "1"),
    (EngineBusy("the KV cache is full", retry_after_s=2.5), "busy", "3"),
    (NoPlan("no partition fits"), "no_plan", "2"),
    (EngineUnavailable("shutting down"), "engine_unavailable", "2"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_retryable_engine_errors_send_retry_after(engine, server, exc, code, retry_after, stream):
    engine.fail_before = exc
    with http(server) as c:
        r = c.post(CHAT, json={"messages": HI, "stream": stream})
    assert_openai_error(r, 503, code=code)
    assert r.headers["Retry-After"] == retry_after


def test_errors_that_retrying_does_not_fix_have_no_retry_after(engine, server):
    engine.fail_before = GenerationFailed("the runtime raised")
    with http(server) as c:
        r = c.post(CHAT, json={"messages": HI})
    assert_openai_error(r, 500, code="generation_failed")
    assert "Retry-After" not in r.headers
    with http(server) as c:
        assert "Retry-After" not in c.post(CHAT, json={"messages": []}).headers


def test_no_engine_yet_sends_retry_after():
    with ServerThread(None) as srv, http(srv) as c:
        r = c.post(CHAT, json={"messages": HI})
        assert_openai_error(r, 503, code="engine_unavailable")
        assert int(r.headers["Retry-After"]) >= 1


# --------------------------------------------------------------------------- connections


def closed_by_server(s: socket.socket, deadline_s: float) -> bool:
    """Whether the server closes ``s`` before ``deadline_s`` (reading and dropping what it sends)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        s.settimeout(max(0.01, end - time.monotonic()))
        try:
            if s.recv(65536) == b"":
                return True
        except TimeoutError:
            return False
        except ConnectionResetError:
            return True
    return False


@pytest.fixture
def short_server(engine):
    with ServerThread(engine, limits=ApiLimits(keepalive_timeout_s=0.3, body_timeout_s=0.3)) as srv:
        yield srv


def test_an_idle_connection_is_closed_after_the_keepalive_timeout(short_server):
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(str(short_server.socket_path))
        assert closed_by_server(s, deadline_s=15.0)


def test_a_kept_alive_connection_is_closed_once_idle(short_server):
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(str(short_server.socket_path))
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        assert closed_by_server(s, deadline_s=15.0)  # reads the answer, then sees the close


def test_a_slow_loris_sending_headers_byte_by_byte_is_closed(short_server):
    request = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + b"X-Slow: " + b"a" * 400
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(str(short_server.socket_path))
        end = time.monotonic() + 15.0
        closed = False
        for byte in request:
            try:
                s.sendall(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
            if closed_by_server(s, deadline_s=0.05):
                closed = True
                break
            if time.monotonic() > end:
                break
        assert closed


def test_a_body_that_never_arrives_is_a_408(short_server):
    raw = raw_exchange(short_server, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                                     b"Content-Length: 100\r\n\r\n{\"messages\"")
    status, _, body = parse_response(raw)
    assert status == 408 and body["error"]["code"] == "request_timeout"
    assert_still_serving(short_server)


def read_response(s: socket.socket) -> tuple[int, dict[str, str], dict]:
    """One HTTP response off ``s`` (by Content-Length: kept-alive ones are not closed)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        assert chunk, f"connection closed without an answer: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(ln.split(b":")[1] for ln in head.split(b"\r\n")
                      if ln.lower().startswith(b"content-length:")))
    while len(body) < length:
        chunk = s.recv(65536)
        assert chunk
        body += chunk
    return parse_response(head + b"\r\n\r\n" + body)


def test_a_burst_of_connections_is_queued_and_answered_past_the_cap(engine):
    n, cap = 300, 64
    with ServerThread(engine, limits=ApiLimits(max_connections=cap)) as srv:
        socks = []
        try:
            for _ in range(n):  # non-blocking: a full listen queue would be EAGAIN here
                s = socket.socket(socket.AF_UNIX)
                s.setblocking(False)
                s.connect(str(srv.socket_path))
                socks.append(s)
            statuses = []
            for s in socks:
                s.setblocking(True)
                s.settimeout(30)
                s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
            for s in socks:
                status, headers, body = read_response(s)
                statuses.append(status)
                if status == 503:
                    assert body["error"]["code"] == "too_many_connections"
                    assert headers["retry-after"] == "1"
                else:
                    assert status == 200 and body["data"][0]["id"] == "fake-model"
            assert statuses.count(200) >= cap // 2 and set(statuses) <= {200, 503}
        finally:
            for s in socks:
                s.close()
        with http(srv) as c:  # slots come back once the clients are gone
            wait_until(lambda: c.get("/v1/models").status_code == 200, 15, "a connection slot to come back")


def test_the_cap_is_shared_by_the_unix_socket_and_tcp(engine):
    with ServerThread(engine, listen="127.0.0.1:0", limits=ApiLimits(max_connections=2)) as srv:
        held = [socket.socket(socket.AF_UNIX) for _ in range(2)]
        try:
            for s in held:
                s.connect(str(srv.socket_path))
                s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
                assert read_response(s)[0] == 200  # admitted and kept alive
            r = httpx.get(f"http://{srv.app[LISTENING]['tcp']}/v1/models")
            assert_openai_error(r, 503, code="too_many_connections")
            assert r.headers["Retry-After"] == "1"
        finally:
            for s in held:
                s.close()
