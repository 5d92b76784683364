"""llama.cpp's server as the anchor of a request-level benchmark: the same GGUF, one core, one thread.

llama-server keeps each slot's prompt (``cache_prompt``, on by default) and picks the slot
with the longest common prefix, so a Home Assistant turn after the first prefills only its
new tokens there too. :class:`LlamaServer` starts it pinned to one core and times a chat
request the way a client sees it: the first streamed delta (text or a tool call) is the
TTFT; its ``timings`` say how many prompt tokens it evaluated and how many came from its cache.

The binaries come from ``bench/build_llama_cpp.sh`` (a cached build; never in CI).
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

LLAMA_BIN = Path.home() / ".cache" / "meshd-anchors" / "llama.cpp" / "build" / "bin"


@dataclass
class LlamaReply:
    ttft_s: float
    total_s: float
    text: str
    prompt_tokens: int  # evaluated + cached
    evaluated: int  # prompt tokens computed for this request
    cached: int


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    def __init__(self, gguf: Path, core: int = 0, ctx: int = 8192, bin_dir: Path = LLAMA_BIN):
        self.gguf, self.core, self.ctx, self.bin_dir = Path(gguf), core, ctx, Path(bin_dir)
        self.port = _free_port()
        self.proc: subprocess.Popen | None = None
        self.log = ""

    @staticmethod
    def available(bin_dir: Path = LLAMA_BIN) -> bool:
        return (Path(bin_dir) / "llama-server").exists()

    def __enter__(self) -> "LlamaServer":
        cmd = ["taskset", "-c", str(self.core), str(self.bin_dir / "llama-server"), "-m", str(self.gguf),
               "-t", "1", "-tb", "1", "-c", str(self.ctx), "-np", "1", "--jinja", "--host", "127.0.0.1",
               "--port", str(self.port)]
        self._logf = open(f"/tmp/llama-server-{self.port}.log", "w+")
        self.proc = subprocess.Popen(cmd, stdout=self._logf, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited: {self._tail()}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"llama-server not ready in 300 s: {self._tail()}")

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._logf.close()

    def _tail(self) -> str:
        self._logf.flush()
        self._logf.seek(0)
        return self._logf.read()[-2000:]

    def chat(self, messages: list[dict], tools: list[dict] | None, max_tokens: int) -> LlamaReply:
        """One greedy chat request, streamed; TTFT at the first delta."""
        body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "cache_prompt": True, "timings_per_token": False}
        if tools:
            body["tools"] = tools
        t0 = time.perf_counter()
        ttft, parts, timings = None, [], {}
        with httpx.stream("POST", f"http://127.0.0.1:{self.port}/v1/chat/completions", json=body,
                          timeout=600) as resp:
            resp.raise_for_status()
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                timings = chunk.get("timings") or timings
                for choice in chunk.get("choices") or []:
                    delta = choice.get("delta") or {}
                    if ttft is None and (delta.get("content") or delta.get("tool_calls")):
                        ttft = time.perf_counter() - t0
                    parts.append(delta.get("content") or "")
        total = time.perf_counter() - t0
        evaluated, cached = int(timings.get("prompt_n", 0)), int(timings.get("cache_n", 0))
        return LlamaReply(ttft if ttft is not None else total, total, "".join(parts), evaluated + cached,
                          evaluated, cached)
