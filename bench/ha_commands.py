"""Do Home Assistant commands work? Command success per model, through the OpenAI and the Ollama API.

For each model: one real daemon (``meshd join --new-home``, unix socket + loopback TCP),
Home Assistant's request shape (bench/ha_home.py: its system prompt with 71 exposed
entities in 13 areas, the 16 Assist tools, one spoken command), greedy. Commands go through
``/v1/chat/completions`` with the ``openai`` SDK (not streamed) and through ``/api/chat`` with
the ``ollama`` client (streamed, as Home Assistant's integration does).
Per model it reports exact success (the call Home Assistant needs, names as the home lists
them), name-insensitive success, unparsed calls (an answer that is a call but came back as
text), wrong tool, no call, and latency per request. ``--overhead N`` also times N commands
in-process with and without the tool grammar (same engine, same prompts) to state what the
grammar costs a request.

    .venv/bin/python bench/ha_commands.py [--quick] [--json] [--models a,b] [--weights MODE] [--core N]
        [--llama-cpp]
    .venv/bin/python bench/ha_commands.py --turns [--quick] [--mesh] [--models NAME] [--llama-bin DIR] [--json]

Commands alternate between the two APIs (``--both``: every command through both); ``--quick``:
the first 20 commands, on the 0.5B and the embedded model unless ``--models`` says. Models not in the cache are skipped with the reason (``meshd model
pull NAME`` fetches them).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import finish, machine_banner  # noqa: E402
from bench.ha_home import COMMANDS, HOME, TOOLS, Command, judge, system_prompt  # noqa: E402

MODELS = ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct")
QUICK_MODELS = MODELS[1:]
EMBEDDED = "smollm2-135m-instruct"  # the embedded default model, by a name (the daemon takes its path)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Daemon:
    """One ``meshd join --new-home`` serving ``model`` alone (a one-device home)."""

    def __init__(self, root: Path, model: str, weights: str, core: int | None = None):
        self.root, self.model = root, model
        self.sock = root / "api.sock"
        self.port = _free_port()
        pin = ["taskset", "-c", str(core)] if core is not None else []
        cmd = [*pin, sys.executable, "-m", "meshd", "join", "--new-home", "ha-bench", "--name", "ha-bench",
               "--state-dir", str(root / "state"), "--socket", str(self.sock), "--listen", "127.0.0.1",
               "--port", "0", "--pairing-port", "0", "--api-listen", f"127.0.0.1:{self.port}",
               "--model", model, "--log-format", "json"]
        if weights != "auto":
            cmd += ["--weights", weights]
        self.log_path = root / "daemon.log"
        threads = {"OMP_NUM_THREADS": "1"} if core is not None else {}
        self.proc = subprocess.Popen(cmd, stdout=open(self.log_path, "wb"), stderr=subprocess.STDOUT,
                                     env={**os.environ, "MESHD_SELF_PROFILE": "off", **threads})

    def count(self, event: str) -> int:
        """Log lines of ``event`` so far (``request_replaying``: a request started over)."""
        return sum(f'"event": "{event}"' in line or f"'event': '{event}'" in line or f" {event} " in line
                   for line in self.log_path.read_text(errors="replace").splitlines())

    def wait_ready(self, timeout_s: float, every_s: float = 0.5) -> None:
        """Until ``/health`` answers 200, asked every ``every_s`` (a timing wants it short)."""
        import httpx

        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited {self.proc.returncode}: {self.tail()}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(every_s)
        raise RuntimeError(f"daemon not ready in {timeout_s:.0f} s: {self.tail()}")

    def tail(self, n: int = 8) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def messages_for(cmd: Command) -> list[dict]:
    return [{"role": "system", "content": system_prompt()}, {"role": "user", "content": cmd.text}]


def via_openai(d: Daemon, model: str, cmd: Command) -> tuple[list, str]:
    import httpx
    import openai

    client = openai.OpenAI(base_url="http://meshd/v1", api_key="-", timeout=900, max_retries=0,
                           http_client=httpx.Client(transport=httpx.HTTPTransport(uds=str(d.sock)), timeout=900))
    r = client.chat.completions.create(model=model, messages=messages_for(cmd), tools=TOOLS, temperature=0,
                                       max_tokens=96, seed=0)
    msg = r.choices[0].message
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls or []]
    return calls, msg.content or ""


def via_ollama(d: Daemon, model: str, cmd: Command) -> tuple[list, str]:
    import ollama

    client = ollama.Client(host=f"http://127.0.0.1:{d.port}", timeout=900)
    content, calls = "", []
    for part in client.chat(model=f"{model}:latest", messages=messages_for(cmd), tools=TOOLS, stream=True,
                            keep_alive="300s", options={"num_ctx": 8192, "temperature": 0, "num_predict": 96,
                                                        "seed": 0}):
        content += part.message.content or ""
        calls += [(tc.function.name, dict(tc.function.arguments)) for tc in part.message.tool_calls or []]
    return calls, content


def run_model(model: str, path: str, commands: list[Command], apis: list[list[str]], weights: str,
              core: int | None = None) -> dict:
    with tempfile.TemporaryDirectory(prefix="ha-bench-") as tmp:
        d = Daemon(Path(tmp), path, weights, core)
        try:
            t = time.monotonic()
            d.wait_ready(600)
            log(f"[{model}] daemon ready in {time.monotonic() - t:.1f} s")
            rows = []
            for i, (cmd, which) in enumerate(zip(commands, apis)):
                for api in which:
                    t = time.perf_counter()
                    try:
                        calls, content = (via_openai if api == "openai" else via_ollama)(d, model, cmd)
                        error = None
                    except Exception as exc:  # noqa: BLE001 - recorded per request (e.g. a 400 for no tools)
                        calls, content, error = [], "", f"{type(exc).__name__}: {exc}"[:300]
                    dt = time.perf_counter() - t
                    verdict = judge(cmd, calls, content) if error is None else \
                        {"exact": False, "loose": False, "unparsed": False, "wrong_tool": False, "no_call": False}
                    rows.append({"command": cmd.text, "api": api, "expected": cmd.tool, "calls": calls,
                                 "content": content[:200], "latency_s": round(dt, 3), "error": error, **verdict})
                    mark = "ok " if verdict["exact"] else ("~  " if verdict["loose"] else "ERR" if error else "x  ")
                    log(f"[{model}] {i + 1:2d}/{len(commands)} {api:6s} {dt:6.1f}s {mark} {cmd.text!r} -> "
                        f"{error or (calls if calls else repr(content[:80]))}")
            out = summarize(rows)
            out["request_replaying"] = d.count("request_replaying")
            return out
        finally:
            d.stop()


def llama_server_times(path: str, commands: list[Command], core: int) -> dict:
    """The same requests through ``llama-server --jinja`` (same GGUF, one thread pinned to ``core``,
    its prompt cache on): what a home gets from its best device alone."""
    from bench.llama_server import LlamaServer

    if not LlamaServer.available():
        return {"skipped": "llama.cpp is not built (bench/build_llama_cpp.sh)"}
    times = []
    with LlamaServer(Path(path), core=core) as srv:
        for i, cmd in enumerate(commands):
            r = srv.chat(messages_for(cmd), TOOLS, 96)
            times.append(r.total_s)
            log(f"[llama-server] {i + 1:2d}/{len(commands)} {r.total_s:6.1f}s prompt {r.prompt_tokens} "
                f"cached {r.cached}")
    return {"requests": len(times), "median_request_s": round(statistics.median(times), 3),
            "setup": f"llama-server --jinja, -t 1 pinned to core {core}, cache_prompt on, the same GGUF"}


def summarize(rows: list[dict]) -> dict:
    answered = [r for r in rows if r["error"] is None]
    n = len(rows)

    def frac(key: str) -> float:
        return round(sum(bool(r[key]) for r in rows) / n, 4) if n else 0.0

    lat = [r["latency_s"] for r in answered]
    per_api = {}
    for api in sorted({r["api"] for r in rows}):
        sub = [r for r in rows if r["api"] == api]
        per_api[api] = {"requests": len(sub), "success": round(sum(r["exact"] for r in sub) / len(sub), 4),
                        "median_latency_s": round(statistics.median([r["latency_s"] for r in sub]), 3)}
    return {"requests": n, "errors": n - len(answered), "success": frac("exact"),
            "name_insensitive_success": frac("loose"), "unparsed": frac("unparsed"),
            "wrong_tool": frac("wrong_tool"), "no_call": frac("no_call"),
            "median_latency_s": round(statistics.median(lat), 3) if lat else None,
            "p90_latency_s": round(sorted(lat)[int(0.9 * (len(lat) - 1))], 3) if lat else None,
            "per_api": per_api, "rows": rows}


async def grammar_overhead(model: str, commands: list[Command], dtype: str) -> dict:
    """What the tool grammar costs a request, two ways, in-process on the same engine (greedy).

    A/B: each command without and with the grammar. The answers may differ (the
    grammar turns a malformed call into a valid one, often of another length), so
    the request times are not for the same tokens; the second way is exact: the
    answer the grammar produced is replayed through a fresh constraint (built from
    the spec, a mask and ``masked_fill`` over the vocabulary and an advance per
    token: everything the sampler does for it), timed, against that request's time.
    The grammar engine is set up for the vocabulary first, as the daemon's last stage does.
    """
    import torch

    from decoding.constrained import make_constraint, warm
    from decoding.sampling import SamplingParams, SamplingSpec
    from meshd.api.generation import constrain_tool_calls
    from meshd.engine.base import GenerationRequest
    from meshd.engine.local import LocalEngine
    from meshd.engine.options import RequestOptions

    engine = await LocalEngine.open(model, dtype=getattr(torch, dtype))
    tok = engine.tokenizer
    warm(tok.path, engine.vocab_size, tuple(tok.eos_ids))
    out: dict[str, list] = {"with": [], "without": []}
    try:
        for k, cmd in enumerate(commands):
            ids = tok.apply_chat(messages_for(cmd), tools=TOOLS)
            for mode in ("without", "with"):
                p = RequestOptions(sampling=SamplingSpec(SamplingParams(temperature=0)))
                if mode == "with":
                    p = constrain_tool_calls(engine, p, TOOLS)
                req = GenerationRequest(request_id=f"o{k}{mode}", prompt_ids=ids, max_tokens=96,
                                        options=RequestOptions(sampling=p.sampling))
                t, first, got = time.perf_counter(), None, []
                async for ev in engine.stream(req):
                    if ev.token_id is not None:
                        got.append(ev.token_id)
                        first = first or time.perf_counter()
                end = time.perf_counter()
                row = {"total_s": end - t, "ttft_s": first - t, "tokens": len(got),
                       "decode_s_per_token": (end - first) / max(1, len(got) - 1)}
                if mode == "with":
                    row["grammar_s"] = _replay(make_constraint, p.sampling.constraint, tok, engine.vocab_size, got)
                    row["grammar_frac"] = row["grammar_s"] / row["total_s"]
                out[mode].append(row)
    finally:
        engine.close()

    def med(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in out[mode])

    return {"commands": len(commands),
            "tokens": {m: [r["tokens"] for r in out[m]] for m in out},
            "request_s": {m: round(med(m, "total_s"), 3) for m in out},
            "decode_s_per_token": {m: round(med(m, "decode_s_per_token"), 4) for m in out},
            "ttft_s": {m: round(med(m, "ttft_s"), 3) for m in out},
            "grammar_s_per_request": round(med("with", "grammar_s"), 4),
            "grammar_share_of_request": round(max(r["grammar_frac"] for r in out["with"]), 4),
            "per_token_ratio": round(med("with", "decode_s_per_token") / med("without", "decode_s_per_token"), 3),
            "per_request_ratio": round(med("with", "total_s") / med("without", "total_s"), 3)}


def _replay(make_constraint, spec: dict, tok, vocab: int, tokens: list[int]) -> float:
    """Seconds the sampler spends on the grammar for ``tokens``: build, then mask + advance each."""
    import torch

    logits = torch.zeros(vocab)
    t = time.perf_counter()
    c = make_constraint(spec, tok.path, vocab, tuple(tok.eos_ids))
    for tid in tokens:
        c.apply(logits)
        if tid not in tok.eos_ids:
            c.advance(tid)
    return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=None,
                    help=f"comma-separated catalog names or GGUF paths (default: {','.join(MODELS)}; with "
                         f"--quick: {','.join(QUICK_MODELS)}, which fit in 5 minutes on 2 cores)")
    ap.add_argument("--commands", type=int, default=None, help="use the first N commands")
    ap.add_argument("--quick", action="store_true", help="the first 20 commands")
    ap.add_argument("--both", action="store_true", help="every command through both APIs (default: alternate)")
    ap.add_argument("--weights", default="auto", help="the daemons' numeric mode (default: theirs, auto)")
    ap.add_argument("--dtype", default="bfloat16", help="the in-process grammar timing's dtype (--overhead)")
    ap.add_argument("--core", type=int, default=None,
                    help="pin the daemon (one torch thread) and llama-server to this core")
    ap.add_argument("--llama-cpp", action="store_true", help="also time the same requests on llama-server")
    ap.add_argument("--overhead", type=int, default=0, help="also time N commands in-process with/without grammar")
    ap.add_argument("--overhead-only", action="store_true", help="only the in-process grammar timing (no daemons)")
    ap.add_argument("--turns", action="store_true",
                    help="whole turns (command, call, tool result, answer), speculation under the grammar on and "
                         "off (bench/ha_turns.py); with --quick: the 0.5B, 3 commands")
    ap.add_argument("--mesh", action="store_true", help="--turns on a 2-device home (a daemon per core)")
    ap.add_argument("--llama-bin", default=None,
                    help="llama.cpp's bin directory for --turns (default: bench/build_llama_cpp.sh's native "
                         "build; its AVX2 build for a home CPU's figures)")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--out", default=None, help="also write the result (indented) to this file")
    args = ap.parse_args()

    from decoding.errors import ModelLoadError
    from meshd.model.store import ModelNotAvailable, resolve_model

    if args.turns:
        from bench.ha_turns_run import main_turns

        return main_turns(args)
    n = args.commands or (20 if args.quick else len(COMMANDS))
    commands = list(COMMANDS[:n])
    apis = [["openai", "ollama"]] * n if args.both else [[("openai", "ollama")[i % 2]] for i in range(n)]
    setup = {**machine_banner(), "weights": args.weights,
             "torch_threads": "daemon default (all cores)" if args.core is None else f"1, pinned to core {args.core}",
             "entities": len(HOME), "tools": len(TOOLS), "commands": n, "quick": args.quick,
             "apis": "both per command" if args.both else "alternating openai / ollama",
             "decoding": "greedy, max_tokens 96",
             "prompts": "warm as in a home: every command after a model's first reuses Home Assistant's cached "
                        "system prompt (the prefix cache is on); with --both the second API repeats the exact prompt"}
    log("setup: " + json.dumps(setup))
    result: dict = {"setup": setup, "models": {}}
    models = args.models or ",".join(QUICK_MODELS if args.quick else MODELS)
    for model in [m for m in models.split(",") if m]:
        try:
            path = str(resolve_model(None if model == EMBEDDED else model))
        except (ModelNotAvailable, ModelLoadError) as exc:
            log(f"[{model}] skipped: {exc}")
            result["models"][model] = {"skipped": str(exc)}
            continue
        if args.overhead_only:
            result["models"][model] = {"grammar_overhead": asyncio.run(
                grammar_overhead(path, commands[:args.overhead or 4], args.dtype))}
            log(f"[{model}] {json.dumps(result['models'][model])}")
            continue
        res = run_model(model, path, commands, apis, args.weights, args.core)
        if args.llama_cpp:
            res["llama_server"] = llama_server_times(path, commands, 0 if args.core is None else args.core)
        if args.overhead and not res["errors"]:
            res["grammar_overhead"] = asyncio.run(grammar_overhead(path, commands[:args.overhead], args.dtype))
        result["models"][model] = res
        log(f"[{model}] success {res['success']:.0%} (name-insensitive {res['name_insensitive_success']:.0%}), "
            f"unparsed {res['unparsed']:.0%}, wrong tool {res['wrong_tool']:.0%}, no call {res['no_call']:.0%}, "
            f"errors {res['errors']}, median {res['median_latency_s']} s, request_replaying {res['request_replaying']}"
            + (f", llama-server median {res['llama_server'].get('median_request_s')} s" if "llama_server" in res else "")
            + (f"; grammar: {res['grammar_overhead']['grammar_s_per_request']} s a request (at most "
               f"{res['grammar_overhead']['grammar_share_of_request']:.1%} of one), A/B per request "
               f"x{res['grammar_overhead']['per_request_ratio']}, per token x{res['grammar_overhead']['per_token_ratio']}"
               if "grammar_overhead" in res else ""))
    finish(result, args.out, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
