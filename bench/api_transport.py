"""The API's own cost: /api/chat and /v1/chat/completions TTFT through the unix socket vs TCP.

A server process runs the real embedded model (``LocalEngine``) behind the
unix socket, a loopback TCP listener (no key) and a LAN-style listener
(``0.0.0.0``, API key checked on every request); this process is the client
(httpx), so client and server do not share a GIL. Each round sends the same
short streamed chat to every listener in turn (rotating the order) and times
the first content chunk; medians and ratios to the unix socket are printed
side by side. Also measured, on the same server: decode time per token with
and without a JSON-schema constraint (llguidance mask in the sampling loop).

    .venv/bin/python bench/api_transport.py [--quick] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import emit_json, machine_banner  # noqa: E402

SERVER = r"""
import asyncio, json, sys, torch
torch.set_num_threads(int(sys.argv[3]))
from meshd.api.server import create_app, start_api
from meshd.apikeys import ApiKeyStore
from meshd.engine.base import LocalEngine
from meshd.api.common import LISTENING
from meshd import log
log.configure("json", "warning")
async def main():
    keys = ApiKeyStore(sys.argv[2])
    engine = await LocalEngine.open(None)
    app = create_app(engine, None, api_keys=keys)
    await start_api(app, sys.argv[1], "127.0.0.1:0", http="0.0.0.0:0")
    print(json.dumps(app[LISTENING]), flush=True)
    await asyncio.Event().wait()
asyncio.run(main())
"""

MESSAGES = [{"role": "user", "content": "Name three colours."}]
SCHEMA = {"type": "object", "properties": {"colours": {"type": "array", "items": {"type": "string"},
                                                       "minItems": 3, "maxItems": 3}},
          "required": ["colours"], "additionalProperties": False}


def ttft(client, path: str, body: dict, headers: dict) -> tuple[float, float, int]:
    """(time to first content chunk, total time, chunks) of one streamed request."""
    t0 = time.perf_counter()
    first = None
    n = 0
    with client.stream("POST", path, json=body, headers=headers, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line or line == "data: [DONE]":
                continue
            obj = json.loads(line.removeprefix("data: "))
            text = (obj.get("message") or {}).get("content") if "message" in obj else \
                ((obj.get("choices") or [{}])[0].get("delta") or {}).get("content")
            if text:
                n += 1
                if first is None:
                    first = time.perf_counter() - t0
    return first or float("nan"), time.perf_counter() - t0, n


def main() -> None:
    import httpx

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the server")
    ap.add_argument("--rounds", type=int, default=None)
    args = ap.parse_args()
    rounds = args.rounds or (5 if args.quick else 20)
    banner = machine_banner() | {"server_threads": args.threads, "model": "SmolLM2-135M-Instruct Q4_1",
                                 "rounds": rounds,
                                 "prompts": "warm by design: one request repeated (its prompt held by the prefix "
                                            "cache after the warm-up), so TTFT is the API's path + one token"}
    print(f"setup: {banner}")
    tmp = Path(tempfile.mkdtemp(prefix="meshd-bench-"))
    from meshd.apikeys import ApiKeyStore

    key = ApiKeyStore(tmp).create("bench")
    sock = tmp / "api.sock"
    proc = subprocess.Popen([sys.executable, "-c", SERVER, str(sock), str(tmp), str(args.threads)],
                            stdout=subprocess.PIPE, text=True)
    try:
        listening = json.loads(proc.stdout.readline())
        http_port = listening["http"].rpartition(":")[2]
        targets = {
            "unix": (httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://localhost"), {}),
            "tcp_loopback": (httpx.Client(base_url=f"http://{listening['tcp']}"), {}),
            "tcp_lan_key": (httpx.Client(base_url=f"http://127.0.0.1:{http_port}"),
                            {"Authorization": f"Bearer {key}"}),
        }
        bodies = {
            "/api/chat": {"model": "meshd", "messages": MESSAGES, "stream": True,
                          "options": {"temperature": 0, "num_predict": 8}},
            "/v1/chat/completions": {"model": "meshd", "messages": MESSAGES, "stream": True,
                                     "temperature": 0, "max_tokens": 8},
        }
        for path, body in bodies.items():  # warm-up
            for c, h in targets.values():
                ttft(c, path, body, h)
        results: dict = {}
        names = list(targets)
        for path, body in bodies.items():
            times = {n: [] for n in names}
            for i in range(rounds):
                order = names[i % len(names):] + names[: i % len(names)]
                for n in order:
                    c, h = targets[n]
                    times[n].append(ttft(c, path, body, h)[0])
            med = {n: statistics.median(v) for n, v in times.items()}
            results[path] = {n: {"ttft_ms_median": round(med[n] * 1e3, 2),
                                 "ttft_ms_min": round(min(times[n]) * 1e3, 2),
                                 "ratio_to_unix": round(med[n] / med["unix"], 3)} for n in names}
        # The HTTP path alone (no model): a small GET per listener, many times.
        pings = {n: [] for n in names}
        for i in range(20 if args.quick else 200):
            for n in names:
                c, h = targets[n]
                t0 = time.perf_counter()
                c.get("/api/version", headers=h).raise_for_status()
                c.get("/v1/models", headers=h).raise_for_status()  # key-checked on the LAN listener
                pings[n].append((time.perf_counter() - t0) / 2)
        pmed = {n: statistics.median(v) for n, v in pings.items()}
        results["http_roundtrip"] = {n: {"ms_median": round(pmed[n] * 1e3, 3),
                                         "ratio_to_unix": round(pmed[n] / pmed["unix"], 3)} for n in names}
        # Constrained decoding end to end: per-token time after the first, with and without a schema.
        c, h = targets["unix"]
        plain = {"model": "meshd", "messages": MESSAGES, "stream": True, "temperature": 0, "max_tokens": 24,
                 "frequency_penalty": 0.0}
        constrained = dict(plain, response_format={"type": "json_schema",
                                                   "json_schema": {"name": "c", "schema": SCHEMA}})
        per_tok = {"plain": [], "json_schema": []}
        for i in range(max(3, rounds // 2)):
            for name, body in (("plain", plain), ("json_schema", constrained))[:: 1 if i % 2 == 0 else -1]:
                first, total, n = ttft(c, "/v1/chat/completions", body, h)
                if n > 1:
                    per_tok[name].append((total - first) / (n - 1))
        dec = {k: round(statistics.median(v) * 1e3, 2) for k, v in per_tok.items() if v}
        results["decode_ms_per_chunk"] = dec | {
            "constrained_ratio": round(dec["json_schema"] / dec["plain"], 3) if len(dec) == 2 else None}
    finally:
        proc.terminate()
        proc.wait(10)
    print(f"\nTTFT (ms, median of {rounds}; streamed, 8 tokens; server {args.threads} torch thread(s))")
    print(f"  {'endpoint':<22} {'listener':<14} {'median':>8} {'min':>8} {'vs unix':>8}")
    for path in bodies:
        for n, r in results[path].items():
            print(f"  {path:<22} {n:<14} {r['ttft_ms_median']:>8.2f} {r['ttft_ms_min']:>8.2f} "
                  f"{r['ratio_to_unix']:>7.3f}x")
    print("\nHTTP round trip without the model (GET, keep-alive; ms, median)")
    for n, r in results["http_roundtrip"].items():
        print(f"  {n:<14} {r['ms_median']:>8.3f} {r['ratio_to_unix']:>7.3f}x")
    d = results["decode_ms_per_chunk"]
    print(f"\ndecode per streamed chunk after the first: plain {d.get('plain')} ms, json_schema "
          f"{d.get('json_schema')} ms ({d.get('constrained_ratio')}x)")
    if args.json:
        emit_json({"setup": banner, "results": results})


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
