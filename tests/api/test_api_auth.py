"""The LAN listener: every request needs an API key; the socket and loopback do not (unless --require-keys).

Real clients: curl through the unix socket and through TCP (with and without
a key), the ``openai`` SDK and the ``ollama`` client with their usual key
options, and an HTTPS listener from a throwaway self-signed certificate.
"""

from __future__ import annotations

import json
import shutil
import subprocess

import httpx
import ollama
import openai
import pytest

from meshd.api.auth import FailureLimiter
from meshd.api.common import AUTH, LISTENING
from meshd.api.listen import ApiStartError, parse_listen
from tests.support.api import KeyedServer
from tests.support.api import REPLY, FakeEngine

BODY = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
needs_curl = pytest.mark.skipif(not shutil.which("curl"), reason="curl is not installed")


@pytest.fixture
def srv():
    with KeyedServer(FakeEngine()) as s:
        s.key = s.keys.create("ha")
        yield s


def curl(*args: str) -> tuple[int, dict | str]:
    out = subprocess.run(["curl", "-sS", "-w", "\n%{http_code}", *args], capture_output=True,
                         text=True, timeout=60, check=True).stdout
    body, _, code = out.rpartition("\n")
    try:
        return int(code), json.loads(body)
    except ValueError:
        return int(code), body


@needs_curl
def test_curl_through_the_unix_socket_needs_no_key(srv):
    code, body = curl("--unix-socket", str(srv.socket_path), "-H", "Content-Type: application/json",
                      "-d", json.dumps(BODY), "http://localhost/v1/chat/completions")
    assert code == 200 and body["choices"][0]["message"]["content"] == REPLY


@needs_curl
def test_curl_through_tcp_needs_the_key(srv):
    url = f"{srv.url}/v1/chat/completions"
    code, body = curl("-d", json.dumps(BODY), url)
    assert code == 401 and body["error"]["code"] == "invalid_api_key"
    code, body = curl("-H", "Authorization: Bearer meshd-wrong", "-d", json.dumps(BODY), url)
    assert code == 401 and "wrong" in body["error"]["message"]
    code, body = curl("-H", f"Authorization: Bearer {srv.key}", "-d", json.dumps(BODY), url)
    assert code == 200 and body["choices"][0]["message"]["content"] == REPLY


@needs_curl
def test_ollama_paths_answer_401_in_ollamas_format_and_health_is_public(srv):
    code, body = curl(f"{srv.url}/api/tags")
    assert code == 401 and isinstance(body["error"], str)
    code, body = curl(f"{srv.url}/health")
    assert code == 200 and body["status"] == "ok"
    code, body = curl(f"{srv.url}/metrics")
    assert code == 401


def test_the_openai_sdk_uses_its_api_key_option(srv):
    ok = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=srv.key, max_retries=0)
    assert ok.chat.completions.create(**BODY).choices[0].message.content == REPLY
    bad = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="meshd-nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(**BODY)


def test_the_ollama_client_sends_the_key_as_a_header(srv):
    good = ollama.Client(host=srv.url, headers={"Authorization": f"Bearer {srv.key}"})
    assert good.chat(model="fake-model", messages=BODY["messages"], stream=False).message.content == REPLY
    with pytest.raises(ollama.ResponseError) as info:
        ollama.Client(host=srv.url).chat(model="fake-model", messages=BODY["messages"])
    assert info.value.status_code == 401


def test_a_revoked_key_stops_working_without_a_restart(srv):
    h = {"Authorization": f"Bearer {srv.key}"}
    assert httpx.get(f"{srv.url}/v1/models", headers=h).status_code == 200
    srv.keys.revoke("ha")
    assert httpx.get(f"{srv.url}/v1/models", headers=h).status_code == 401
    new = srv.keys.create("ha2")
    assert httpx.get(f"{srv.url}/v1/models", headers={"Authorization": f"Bearer {new}"}).status_code == 200


def test_repeated_wrong_keys_are_rate_limited_with_retry_after(srv):
    srv.app[AUTH].limiter = FailureLimiter(max_failures=3, window_s=60)
    bad = {"Authorization": "Bearer meshd-guess"}
    codes = [httpx.get(f"{srv.url}/v1/models", headers=bad).status_code for _ in range(4)]
    assert codes == [401, 401, 401, 429]
    r = httpx.get(f"{srv.url}/v1/models", headers={"Authorization": f"Bearer {srv.key}"})
    assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1  # even a good key waits
    assert httpx.get(f"{srv.url}/health").status_code == 200


def test_stored_keys_are_hashes_only(srv):
    text = srv.keys.path.read_text()
    assert srv.key not in text and (srv.keys.path.stat().st_mode & 0o777) == 0o600


def test_a_loopback_http_listener_needs_no_key():
    with KeyedServer(FakeEngine(), http="127.0.0.1:0") as s:
        assert httpx.get(f"{s.url}/v1/models").status_code == 200


@needs_curl
def test_require_keys_asks_for_the_key_on_loopback_too_but_not_on_the_socket():
    """So a user can try the key Home Assistant will send, with curl on the daemon's own machine."""
    with KeyedServer(FakeEngine(), http="127.0.0.1:0", listen="127.0.0.1:0", require_keys=True) as s:
        key = s.keys.create("ha")
        tcp = f"http://{s.app[LISTENING]['tcp']}"
        for url in (s.url, tcp):
            assert httpx.get(f"{url}/v1/models").status_code == 401
            code, body = curl("-H", f"Authorization: Bearer {key}", "-H", "Content-Type: application/json",
                              "-d", json.dumps(BODY), f"{url}/v1/chat/completions")
            assert code == 200 and body["choices"][0]["message"]["content"] == REPLY
            assert httpx.get(f"{url}/health").status_code == 200  # probes stay public
        with pytest.raises(ollama.ResponseError) as info:
            ollama.Client(host=s.url).chat(model="fake-model", messages=BODY["messages"])
        assert info.value.status_code == 401
        assert s.app[LISTENING]["http_auth"] == "api key" and s.app[LISTENING]["tcp_auth"] == "api key"
        code, body = curl("--unix-socket", str(s.socket_path), "http://localhost/v1/models")
        assert code == 200 and body["data"][0]["id"] == "fake-model"


def test_listen_errors_name_the_flag_given():
    with pytest.raises(ApiStartError, match="--api-listen .*--http"):
        parse_listen("0.0.0.0:8080")
    with pytest.raises(ApiStartError, match="--http port"):
        parse_listen("0.0.0.0:http", flag="--http", loopback_only=False)
    assert parse_listen("0.0.0.0:0", flag="--http", loopback_only=False) == ("0.0.0.0", 0)


@pytest.mark.skipif(not shutil.which("openssl"), reason="openssl is not installed")
def test_https_with_a_certificate_and_key(tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True, timeout=60)
    with KeyedServer(FakeEngine(), tls=(cert, key)) as s:
        k = s.keys.create("ha")
        assert s.url.startswith("https://")
        r = httpx.post(f"{s.url}/v1/chat/completions", json=BODY, verify=str(cert),
                       headers={"Authorization": f"Bearer {k}"})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == REPLY
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{s.port}/health", timeout=5)  # plain HTTP is not spoken


def test_meshd_client_reaches_the_lan_listener_with_its_key(srv):
    from meshd.client import ApiError, MeshdClient

    with MeshdClient(base_url=srv.url, api_key=srv.key) as c:
        assert c.chat("hi").text == REPLY
        assert "".join(c.chat("hi", stream=True)) == REPLY
    with MeshdClient(base_url=srv.url) as c, pytest.raises(ApiError) as info:
        c.models()
    assert info.value.status == 401
