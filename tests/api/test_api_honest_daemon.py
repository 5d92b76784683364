"""An honest API through a real daemon with the real model: what a client on the LAN sees.

One ``meshd join`` process serves the embedded model with ``--require-keys`` on two loopback TCP
listeners (``--api-listen``, ``--http``), the way a user tries Home Assistant's key on the daemon's
own machine, and one alias (``--model-aliases llama3.2:1b``). Its Medusa heads are configured to a file in its state directory that does not exist,
so speculation falls back for a reason that quotes a path: the reason goes to the log, not to clients.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import ollama
import openai
import pytest

import meshd
from meshd.model import store as model_store
from tests.support.daemons import Mesh, meshd_status_json, run_cli
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

HI = [{"role": "user", "content": "Repeat: red green blue, red green blue."}]
NOT_FOUND = 'model "llama3.2:3b" not found, try pulling it first'


@pytest.fixture(scope="module")
def daemon():
    if not model_store.is_pulled():
        model_store.pull(quiet=True)
    mesh = Mesh()
    try:
        missing_heads = mesh.root / "solo" / "state" / "medusa-heads.safetensors"
        d = mesh.spawn("solo", "--model", str(model_store.default_model_path()), "--api-listen", "127.0.0.1:0",
                       "--http", "127.0.0.1:0", "--require-keys", "--model-aliases", "llama3.2:1b",
                       new_home="honest",
                       env={"MESHD_MEDUSA_HEADS": str(missing_heads)})
        wait_until(lambda: d.status().get("ready"), 180, what="the daemon to serve its model")
        rc, out = run_cli("apikey", "create", "ha", "--state-dir", str(d.state_dir), "--json")
        assert rc == 0, out
        d.key = json.loads(out.strip().splitlines()[-1])["key"]
        d.api = d.status()["api"]
        yield d
    finally:
        mesh.cleanup()


def _every_endpoint(h: httpx.Client, served: str) -> dict[str, httpx.Response]:
    """One request to each route (answers and errors alike), keyed by a readable label."""
    medusa = {"drafter": "medusa"}
    calls = {
        "GET /": ("GET", "/", None),
        "GET /api/version": ("GET", "/api/version", None),
        "GET /api/tags": ("GET", "/api/tags", None),
        "GET /api/ps": ("GET", "/api/ps", None),
        "POST /api/show": ("POST", "/api/show", {"model": served}),
        "POST /api/show unknown": ("POST", "/api/show", {"model": "llama3.2:3b"}),
        "POST /api/chat": ("POST", "/api/chat", {"model": served, "messages": HI, "stream": False,
                                                 "options": {"num_predict": 8}, "speculative": medusa}),
        "POST /api/chat stream": ("POST", "/api/chat", {"model": served, "messages": HI,
                                                        "options": {"num_predict": 8}, "speculative": medusa}),
        "POST /api/chat unknown": ("POST", "/api/chat", {"model": "llama3.2:3b", "messages": HI}),
        "POST /api/generate": ("POST", "/api/generate", {"model": served, "prompt": "Red, green,",
                                                         "options": {"num_predict": 4}}),
        "POST /api/pull": ("POST", "/api/pull", {"model": served, "stream": False}),
        "POST /api/pull unknown": ("POST", "/api/pull", {"model": "llama3.2:3b"}),
        "POST /api/pull catalog": ("POST", "/api/pull", {"model": "qwen2.5-coder-1.5b-instruct", "stream": False}),
        "POST /api/embed": ("POST", "/api/embed", {"model": served, "input": "x"}),
        "GET /v1/models": ("GET", "/v1/models", None),
        "GET /v1/models/id": ("GET", f"/v1/models/{served}", None),
        "GET /v1/models/unknown": ("GET", "/v1/models/gpt-4o-mini", None),
        "POST /v1/chat/completions": ("POST", "/v1/chat/completions", {
            "messages": HI, "max_tokens": 8, "speculative": medusa}),
        "POST /v1/chat/completions stream": ("POST", "/v1/chat/completions", {
            "messages": HI, "max_tokens": 8, "stream": True, "stream_options": {"include_usage": True},
            "speculative": medusa}),
        "POST /v1/chat/completions unknown": ("POST", "/v1/chat/completions", {"model": "gpt-4o-mini",
                                                                               "messages": HI}),
        "POST /v1/completions": ("POST", "/v1/completions", {"prompt": "Red, green,", "max_tokens": 4}),
        "POST /v1/completions too long": ("POST", "/v1/completions", {"prompt": "red " * 9000,
                                                                      "max_tokens": 4}),
        "POST /v1/chat/completions bad json": ("POST", "/v1/chat/completions", b"{not json"),
        "GET /v1/mesh/status": ("GET", "/v1/mesh/status", None),
        "GET /health": ("GET", "/health", None),
        "GET /metrics": ("GET", "/metrics", None),
        "GET /nowhere": ("GET", "/nowhere", None),
    }
    out = {}
    for label, (method, path, body) in calls.items():
        kw = {"content": body} if isinstance(body, bytes) else {"json": body} if body is not None else {}
        out[label] = h.request(method, path, **kw)
    return out


def test_no_response_body_names_the_install_the_state_or_the_model_file(daemon):
    secrets = {"install dir": str(Path(meshd.__file__).resolve().parents[1]),
               "state dir": str(daemon.state_dir), "model file": str(model_store.default_model_path()),
               "model cache": str(model_store.meshd_home())}
    served = daemon.status()["model"]
    unix = httpx.Client(transport=httpx.HTTPTransport(uds=str(daemon.socket)), base_url="http://localhost",
                        timeout=240)
    lan = httpx.Client(base_url=f"http://{daemon.api['http']}", timeout=240,
                       headers={"Authorization": f"Bearer {daemon.key}"})
    with unix, lan:
        for where, client in (("socket", unix), ("tcp", lan)):
            answers = _every_endpoint(client, served)
            assert answers["POST /api/chat"].status_code == 200, answers["POST /api/chat"].text
            assert answers["POST /api/chat unknown"].status_code == 404
            assert answers["POST /v1/completions too long"].status_code in (400, 413)
            for label, r in answers.items():
                for what, path in secrets.items():
                    assert path not in r.text, f"{where} {label} ({r.status_code}) shows the {what}: {r.text[:400]}"
                assert "\"fallback_reason\"" not in r.text, f"{where} {label}: {r.text[:400]}"
    # The reason is not lost: the daemon's log has it.
    wait_until(lambda: any(e.get("event") in ("medusa_unavailable", "speculation_fallback")
                         and str(daemon.state_dir) in json.dumps(e) for e in daemon.events()),
             30, what="the Medusa fallback and its reason in the daemon's log")


def test_unknown_models_are_not_found_for_the_ollama_client_and_the_openai_sdk(daemon):
    o = ollama.Client(host=f"http://{daemon.api['http']}", headers={"Authorization": f"Bearer {daemon.key}"})
    with pytest.raises(ollama.ResponseError) as info:
        o.chat(model="llama3.2:3b", messages=HI, stream=False)
    assert info.value.status_code == 404 and info.value.error == NOT_FOUND
    with pytest.raises(ollama.ResponseError) as info:
        o.pull("llama3.2:3b")
    assert "file does not exist" in info.value.error
    served = daemon.status()["model"]
    assert [m.model for m in o.list().models] == [f"{served}:latest", "llama3.2:1b"]
    assert o.pull(served).status == "success"
    assert o.chat(model="llama3.2:1b", messages=HI, stream=False, options={"num_predict": 2}).model == "llama3.2:1b"
    sdk = openai.OpenAI(base_url=f"http://{daemon.api['tcp']}/v1", api_key=daemon.key, max_retries=0)
    with pytest.raises(openai.NotFoundError) as err:
        sdk.chat.completions.create(model="gpt-4o-mini", messages=HI, max_tokens=4)
    assert err.value.code == "model_not_found"
    assert sdk.chat.completions.create(model=served, messages=HI, max_tokens=4).model == served


def test_require_keys_holds_on_both_loopback_listeners_and_the_socket_stays_open(daemon):
    assert daemon.api["http_auth"] == "api key" and daemon.api["tcp_auth"] == "api key"
    for listener in (daemon.api["http"], daemon.api["tcp"]):
        assert httpx.get(f"http://{listener}/api/tags").status_code == 401
        assert httpx.get(f"http://{listener}/api/tags",
                         headers={"Authorization": f"Bearer {daemon.key}"}).status_code == 200
    assert meshd_status_json(daemon)["ready"]  # `meshd status` over the socket needs no key
