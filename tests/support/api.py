"""Shared fakes for the client-API tests: a deterministic engine and servers on their own threads.

The fake engine tokenises one character per token, so stop strings always
span several tokens and the byte-level corner cases are exercised for free.
The ``engine``/``server``/``short_tmp`` fixtures built on these are in tests/conftest.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import sys
import tempfile
import threading
from collections.abc import AsyncIterator
from pathlib import Path

from meshd import log
from meshd.api.common import ApiLimits
from meshd.api.server import create_app, start_api
from meshd.apikeys import ApiKeyStore
from meshd.engine.base import Engine, GenerationRequest

EOS = 0
REPLY = "Hello from the fake mesh. It is deterministic."

STATUS = {
    "node_id": "n-abc123",
    "name": "desk-pc",
    "home": {"name": "smith-home", "digest": "0123abcd"},
    "state": "serving",
    "members": [
        {"node_id": "n-abc123", "name": "desk-pc", "state": "active",
         "address": "192.168.1.10:7400", "memory_budget": 6144, "self": True, "layers": [0, 18],
         "last_seen_s": 0.0},
        {"node_id": "n-def456", "name": "kitchen-pi", "state": "joining",
         "address": "192.168.1.20:7400", "memory_budget": 1536, "layers": [18, 30],
         "last_seen_s": 3.2},
    ],
    "not_admitted": [
        {"name": "neighbour-nas", "address": "192.168.1.50:7400", "reason": "another home"},
    ],
    "interfaces": [{"name": "eth0", "addresses": ["192.168.1.10"]}],
    "plan": {"version": 3,
             "stages": [{"node_id": "n-abc123", "layers": [0, 18]},
                        {"node_id": "n-def456", "layers": [18, 30]}],
             "predicted_bottleneck": 0.041, "leader": "n-abc123", "reason": "member joined"},
}


class CharTokenizer:
    eos_ids = (EOS,)

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids) -> str:
        return "".join(chr(i) for i in ids if i != EOS)

    def apply_chat(self, messages) -> list[int]:
        return self.encode("".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>")


class FakeEngine(Engine):
    """Replies ``reply`` then EOS; can be slowed down or made to fail."""

    model_id = "fake-model"
    vocab_size = 0x110000  # one token per Unicode code point

    def __init__(self, reply: str = REPLY, context_length: int = 512):
        self.tokenizer = CharTokenizer()
        self.context_length = context_length
        self.reply = reply
        self.delay_s = 0.0
        self.fail_before: Exception | None = None
        self.fail_after: tuple[int, Exception] | None = None
        self.active = 0
        self.started = 0
        self.finished_normally = 0
        self.closed_early = 0
        self.requests: list[GenerationRequest] = []

    async def token_ids(self, req: GenerationRequest) -> AsyncIterator[int]:
        self.requests.append(req)
        if self.fail_before is not None:
            raise self.fail_before
        self.active += 1
        self.started += 1
        done = False
        try:
            for i, tid in enumerate([*self.tokenizer.encode(self.reply), EOS]):
                if self.fail_after is not None and i == self.fail_after[0]:
                    raise self.fail_after[1]
                await asyncio.sleep(self.delay_s)  # sleep-ok: delay_s (0 unless a test sets it) simulates a slow engine
                yield tid
            done = True
        finally:
            self.active -= 1
            if done:
                self.finished_normally += 1
            else:
                self.closed_early += 1


class ServerThread:
    """The API on a unix socket, served by its own event loop in a thread.

    Blocking clients (the ``openai`` package, ``MeshdClient``, the CLI) can then
    be used from the test's own thread.
    """

    def __init__(self, engine: Engine | None, status: dict | None = None, listen: str | None = None,
                 limits: ApiLimits | None = None, **app_options):
        """``app_options`` go to ``create_app`` (``model_aliases``, ``debug_responses``...)."""
        self.engine = engine
        self.status = dict(STATUS if status is None else status)
        self.listen = listen
        # pytest's tmp_path can exceed the 107-byte unix socket limit.
        self.dir = Path(tempfile.mkdtemp(prefix="meshd-api-", dir="/tmp"))
        self.socket_path = self.dir / "run" / "meshd.sock"
        self.loop = asyncio.new_event_loop()
        self.app = create_app(engine, lambda: self.status, limits=limits, **app_options)
        self.runner = None
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def call(self, coro, timeout: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def __enter__(self) -> ServerThread:
        # Another test may have configured logging onto a capsys stream that is
        # closed by now; a failing log write would turn answers into 500s.
        # fd 2 is still captured by pytest.
        log.configure("console", "info", stream=sys.__stderr__)
        self._thread.start()
        self.runner = self.call(start_api(self.app, self.socket_path, self.listen))
        return self

    def __exit__(self, *exc) -> None:
        with contextlib.suppress(Exception):
            self.call(self.runner.cleanup())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()
        shutil.rmtree(self.dir, ignore_errors=True)


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


def status_of(name: str = "desk-pc") -> dict:
    return {**STATUS, "name": name}


class ToolTokenizer(CharTokenizer):
    """A chat template that renders tools and tool results (like Qwen's), one char per token."""

    supports_tools = True

    def __init__(self):
        self.rendered: list[str] = []

    def apply_chat(self, messages, tools=None):
        text = "".join(f"<{m['role']}>{m.get('content') or ''}"
                       f"{json.dumps(m.get('tool_calls')) if m.get('tool_calls') else ''}\n"
                       for m in messages)
        if tools:
            text = f"<tools>{json.dumps(tools)}</tools>\n" + text
        self.rendered.append(text)
        return self.encode(text + "<assistant>")


class ToolEngine(FakeEngine):
    """Answers with a tool call while the last message is the user's, then with text."""

    CALL = '<tool_call>\n{"name": "HassTurnOn", "arguments": {"name": "kitchen light"}}\n</tool_call>'

    def __init__(self):
        super().__init__(reply=self.CALL)
        self.tokenizer = ToolTokenizer()

    async def token_ids(self, req):
        rendered = self.tokenizer.rendered[-1] if self.tokenizer.rendered else ""
        self.reply = "The kitchen light is on." if "<tool>" in rendered else self.CALL
        async for t in super().token_ids(req):
            yield t
