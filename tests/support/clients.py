"""Clients that talk to a served API over its unix socket: raw HTTP, the openai SDK, the ollama client.

Each takes a ``ServerThread`` (anything with ``socket_path``) or a socket path, so the in-process
servers and the real daemons are spoken to the same way.
"""

from __future__ import annotations

from os import PathLike

import httpx
import ollama
import openai
from prometheus_client.parser import text_string_to_metric_families


def _socket(where) -> str:
    return str(where if isinstance(where, (str, PathLike)) else where.socket_path)


def http(where, **kw) -> httpx.Client:
    """A raw HTTP client (use as a context manager)."""
    return httpx.Client(transport=httpx.HTTPTransport(uds=_socket(where)), base_url="http://localhost", **kw)


def get(where, path: str) -> httpx.Response:
    with http(where) as h:
        return h.get(path)


def sdk(where, timeout: float | None = None) -> openai.OpenAI:
    """The official ``openai`` package, unchanged, over the socket (no retries: a test sees each answer)."""
    extra = {} if timeout is None else {"timeout": timeout}
    return openai.OpenAI(base_url="http://localhost/v1", api_key="unused", max_retries=0,
                         http_client=httpx.Client(transport=httpx.HTTPTransport(uds=_socket(where)), **extra))


def ollama_client(where) -> ollama.Client:
    """The real ``ollama`` Python client (the one Home Assistant uses)."""
    return ollama.Client(host="http://localhost", transport=httpx.HTTPTransport(uds=_socket(where)))


def metrics(where) -> dict[str, dict]:
    """``/metrics`` parsed: name -> {labels tuple: value} for every sample."""
    r = get(where, "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out: dict[str, dict] = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out
