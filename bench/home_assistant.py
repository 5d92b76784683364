"""Home Assistant on a 2-device mesh: what the prefix KV cache saves when the same system prompt comes back.

Home Assistant sends one long system message with every request (the Assist instructions, the
YAML of every exposed entity, the Assist tools as JSON schemas: 2,000-3,500 tokens), and one
spoken command is several requests: the command -> the model's tool call -> the tool result
appended -> the spoken answer. meshd keeps finished requests' KV in every pipeline stage, keyed
on exact token ids, so a later request prefills only what follows the longest cached prefix.

Setup: 2 devices, each a real ``meshd join`` daemon (loopback, ``--port 0``, paired with an
invite token) pinned to its own core with one torch thread (``sched_setaffinity`` in the child,
``OMP_NUM_THREADS=1``), a memory budget that makes the plan split the model between them
(checked: the plan must have 2 stages, loaded and unchanged for a few seconds, before anything
is measured); the embedded SmolLM2-135M unless ``--model``, in the daemons' numeric mode
(``--weights``: theirs, ``auto``: packed on a CPU with a bfloat16 unit, else gguf; float32 with ``--quick``). Requests go over loopback TCP
(``--api-listen``) to the first daemon, which coordinates.

Conversations (bench/ha_home.py: 71 entities in 13 areas, the 16 Assist tools, its commands
that need a tool): request 1 = [system, user command] -> whatever the model answers; request 2
= the same + an assistant message carrying the command's *expected* call + a ``tool`` message
with a result shaped like Home Assistant's -> the spoken answer. Conversations alternate
between the Ollama API (the ``ollama`` client, ``/api/chat``, streamed as Home Assistant does)
and the OpenAI API (the ``openai`` SDK, ``/v1/chat/completions``, streamed with
``stream_options.include_usage``); greedy, ``--max-tokens`` (48). A model whose chat template
has no tools (the embedded SmolLM2) gets them the way a Hermes-style template writes them:
the schemas (compact JSON) in the system message, calls as ``<tool_call>`` text (mode "inline").

Measured per request: prompt tokens, cached tokens (OpenAI: ``usage.prompt_tokens_details.
cached_tokens``; Ollama: prompt tokens - ``prompt_eval_count``), tokens prefilled, and TTFT.
TTFT is the coordinator's own (``request_done ttft_s`` in its log, matched by ``X-Request-Id``:
the request entering the engine to its first token) because Ollama's stream holds back text
that may be a tool call, so its first line can come at the end of the answer; the client's
time to the first streamed chunk is printed beside it. The run's first request (nothing
cached) is the cold one; all later ones are warm. ``new_tokens_prefill_s``: what prefilling only
a warm request's new tokens costs with nothing in the way — each stage of the plan, in its own
process on its daemon's core with one thread and the daemons' numeric mode, times the forward of
those tokens after as many held positions as the request reused; summed over the stages (one
chunk crosses them in turn); the median over the warm requests. A warm request's TTFT over it is
what the cache's machinery (probe, fork, hops, the API) adds. Beside it, ``fresh_prompt_prefill_s``:
a fresh prompt of as many tokens, sharing no prefix with anything cached (``--probes`` of them,
through ``/v1/completions``): cheaper, as it attends to no context. Targets (the issue): warm median TTFT <= 0.15x cold and <= 1.2x new-token prefill.

Parity: the same conversations (the first ``--parity-conversations``; all but with ``--quick``), same
order, on a fresh 2-device home started with ``--prefix-cache-share 0`` (cache off; started beside the
first home, on the same two cores, and idle until the first home is done and stopped); every answer
(text and tool calls) must be equal.

    .venv/bin/python bench/home_assistant.py [--quick] [--json] [--model NAME_OR_PATH] [--weights MODE]
        [--conversations N] [--max-tokens N] [--probes N] [--no-parity] [--parity-conversations N]
        [--memory-budget-mb N]

``--quick``: 10 conversations (20 requests), max_tokens 32, 8 probes, float32 weights, parity on the
first 5 conversations: for 5 minutes on an idle 2-core machine with the embedded model.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._cold import CacheHit  # noqa: E402
from bench._common import daemon_env, finish, machine_banner, pinned_child  # noqa: E402
from bench.ha_home import COMMANDS, HOME, TOOLS, Command, system_prompt  # noqa: E402
from bench.soak import invite, stop_all  # noqa: E402 - the soak's daemon handling: stop by pid, invite

EMBEDDED = "smollm2-135m-instruct"  # the embedded default model, by a name (the daemon takes its path)
MODEL_NAME = "meshd"  # the API's name for "whatever this home serves"
# Quick gossip, but a member is not given up on a busy 2-core machine (a re-plan drops the prefix cache).
MEMBERSHIP = ["--heartbeat-interval", "0.5", "--suspect-after", "10", "--gone-after", "20"]
WARM_TARGET = 0.15  # warm median TTFT / cold TTFT, at most
NEW_TOKENS_TARGET = 1.2  # warm median TTFT / new-token prefill TTFT, at most
PLAN_STABLE_S = 3.0
REQUEST_TIMEOUT_S = 600.0


def log(msg: str) -> None:
    print(msg, flush=True)


# --------------------------------------------------------------------------- the conversations


@dataclass(frozen=True)
class Conversation:
    index: int
    cmd: Command
    api: str  # "ollama" or "openai"


def conversations(n: int) -> list[Conversation]:
    """The first ``n`` commands that need a tool, alternating Ollama / OpenAI (Ollama first)."""
    cmds = [c for c in COMMANDS if c.tool is not None][:n]
    if len(cmds) < n:
        raise SystemExit(f"only {len(cmds)} commands with a tool in bench/ha_home.py")
    return [Conversation(i, c, ("ollama", "openai")[i % 2]) for i, c in enumerate(cmds)]


def _entity_id(name: str) -> str:
    e = next((e for e in HOME if e.name == name), None)
    return f"{e.domain if e else 'entity'}.{re.sub(r'[^a-z0-9]+', '_', name.lower()).strip('_')}"


def expected_call(cmd: Command) -> tuple[str, dict]:
    return cmd.tool, dict(cmd.args[0])


def tool_result(cmd: Command) -> str:
    """What Home Assistant returns for the call, as the ``tool`` message's content."""
    if cmd.tool == "GetLiveContext":
        target = "Front Door Lock" if "door" in cmd.text.lower() else "Bedroom Temperature"
        return json.dumps({"success": True, "result": f"- names: {target}\n  domain: {_entity_id(target).split('.')[0]}"
                                                      f"\n  state: {'locked' if 'Lock' in target else '19.5 °C'}"})
    if cmd.tool in ("HassGetCurrentTime", "HassGetCurrentDate"):
        said = "15:04" if cmd.tool == "HassGetCurrentTime" else "Thursday, November 27"
        return json.dumps({"speech": {"plain": {"speech": said}}, "response_type": "action_done", "data": {}})
    targets = [{"name": cmd.target, "type": "entity", "id": _entity_id(cmd.target)}] if cmd.target else \
        [{"name": cmd.area, "type": "area", "id": (cmd.area or "").lower().replace(" ", "_")}] if cmd.area else []
    return json.dumps({"success": True, "speech": {}, "response_type": "action_done",
                       "data": {"targets": [], "success": targets, "failed": []}})


def inline_tools_text() -> str:
    """The tools the way a Hermes-style chat template writes them (for a template without tools)."""
    return ("\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
            + "\n".join(json.dumps(t, separators=(",", ":")) for t in TOOLS)
            + "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
              "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
              '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


@dataclass(frozen=True)
class Prompting:
    """How requests carry the tools: "tools" (the API's ``tools``; the template renders them) or
    "inline" (the template has none: schemas in the system message, calls as text)."""

    mode: str

    def system(self) -> str:
        return system_prompt() + (inline_tools_text() if self.mode == "inline" else "")

    def tools(self) -> list[dict] | None:
        return TOOLS if self.mode == "tools" else None

    def messages(self, conv: Conversation, step: int) -> list[dict]:
        """Request ``step`` (1 or 2) of ``conv`` in its API's message shape."""
        msgs = [{"role": "system", "content": self.system()}, {"role": "user", "content": conv.cmd.text}]
        if step == 1:
            return msgs
        name, args = expected_call(conv.cmd)
        result = tool_result(conv.cmd)
        call_id = f"call_{conv.index}"
        if self.mode == "inline":
            text = "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"
            return msgs + [{"role": "assistant", "content": text}, {"role": "tool", "content": result}]
        if conv.api == "openai":
            return msgs + [
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}]},
                {"role": "tool", "tool_call_id": call_id, "content": result}]
        return msgs + [
            {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": name, "arguments": args}}]},
            {"role": "tool", "content": result, "tool_name": name}]

    def template_messages(self) -> list[dict]:
        return [{"role": "system", "content": self.system()}]


# --------------------------------------------------------------------------- daemons


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Daemon:
    """One ``meshd join`` process pinned to one core, one torch thread, logging JSON lines."""

    def __init__(self, root: Path, name: str, core: int, args: list[str]):
        self.name, self.core, self.args = name, core, args
        self.dir = root / name
        self.dir.mkdir(parents=True)
        self.state, self.socket, self.log = self.dir / "state", self.dir / "api.sock", self.dir / "daemon.log"
        self.proc: subprocess.Popen | None = None
        self.api_port: int | None = None

    def start(self, first: list[str], api: bool = False) -> "Daemon":
        extra = []
        if api:
            self.api_port = _free_port()
            extra = ["--api-listen", f"127.0.0.1:{self.api_port}"]
        cmd = [sys.executable, "-m", "meshd", "join", "--state-dir", str(self.state), "--socket", str(self.socket),
               "--name", self.name, "--port", "0", "--pairing-port", "0", "--interface", "127.0.0.1",
               "--listen", "127.0.0.1", "--log-format", "json", *MEMBERSHIP, *self.args, *extra, *first]
        env = daemon_env(ROOT)
        preexec = pinned_child(self.core)

        self.proc = subprocess.Popen(cmd, stdout=open(self.log, "ab"), stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                     preexec_fn=preexec, start_new_session=True)
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def node_id(self) -> str | None:
        try:
            return (self.state / "node_id").read_text().strip()
        except OSError:
            return None

    def affinity(self) -> list[int] | None:
        try:
            return sorted(os.sched_getaffinity(self.proc.pid))
        except (OSError, AttributeError):
            return None

    def status(self) -> dict | None:
        import httpx

        if not self.alive():
            return None
        try:
            with httpx.Client(transport=httpx.HTTPTransport(uds=str(self.socket)), timeout=5.0) as c:
                r = c.get("http://meshd/v1/mesh/status")
            return r.json() if r.status_code == 200 else None
        except Exception:  # noqa: BLE001 - not up (yet)
            return None

    def events(self) -> list[dict]:
        out = []
        with contextlib.suppress(OSError):
            for line in self.log.read_text(errors="replace").splitlines():
                with contextlib.suppress(ValueError):
                    ev = json.loads(line)
                    if isinstance(ev, dict):
                        out.append(ev)
        return out

    def tail(self, n: int = 15) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def wait_for(what: str, cond, timeout: float, daemons: list[Daemon], interval: float = 0.25):
    """Poll ``cond`` until truthy; a daemon that exits or the deadline raises (with its log tail)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        for d in daemons:
            if d.proc is not None and d.proc.poll() is not None:
                raise RuntimeError(f"{d.name} exited ({d.proc.returncode}) while waiting for {what}:\n{d.tail()}")
        value = cond()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}:\n"
                       + "\n".join(f"--- {d.name} ---\n{d.tail(8)}" for d in daemons))


class PlanWatch:
    """A plan with one stage per daemon, every daemon ready and loaded at it, unchanged ``stable_s``."""

    def __init__(self, daemons: list[Daemon], stable_s: float = PLAN_STABLE_S):
        self.daemons, self.stable_s = daemons, stable_s
        self._seen, self._since = None, 0.0

    def __call__(self) -> dict | None:
        sts = [d.status() for d in self.daemons]
        if any(s is None or not s.get("ready") for s in sts):
            self._seen = None
            return None
        plans = [s.get("plan") or {} for s in sts]
        key = (plans[0].get("version"), json.dumps(plans[0].get("stages"), sort_keys=True))
        ids = {d.node_id() for d in self.daemons}
        if any((p.get("version"), json.dumps(p.get("stages"), sort_keys=True)) != key for p in plans) \
                or {st.get("node_id") for st in plans[0].get("stages") or []} != ids \
                or any((s.get("stage") or {}).get("plan_version") != key[0] for s in sts):
            self._seen = None
            return None
        now = time.monotonic()
        if key != self._seen:
            self._seen, self._since = key, now
        return sts[0] if now - self._since >= self.stable_s else None


@dataclass
class Home:
    """A 2-device home: ``daemons[0]`` created it, serves the API on loopback TCP and coordinates."""

    label: str
    daemons: list[Daemon]
    plan: dict = field(default_factory=dict)
    up_s: float = 0.0

    @property
    def coordinator(self) -> Daemon:
        return self.daemons[0]

    def plan_version(self) -> int | None:
        return ((self.coordinator.status() or {}).get("plan") or {}).get("version")

    def cache_status(self) -> dict:
        """What each daemon's status says about prefix caching (its stage's cache, the coordinator's reuse)."""
        out = {}
        for d in self.daemons:
            st = d.status() or {}
            out[d.name] = _find_keys(st, ("prefix", "reuse"))
        return out

    def layout(self) -> list[str]:
        names = {d.node_id(): d.name for d in self.daemons}
        return [f"{names.get(s['node_id'], s['node_id'])} layers {s['layers'][0]}-{s['layers'][1] - 1}"
                for s in self.plan.get("stages", [])]


def _find_keys(obj, words: tuple[str, ...], path: str = "") -> dict:
    """Every entry of a nested status whose key mentions one of ``words``, by its dotted path."""
    found = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            where = f"{path}.{k}" if path else str(k)
            if any(w in str(k).lower() for w in words):
                found[where] = v
            else:
                found.update(_find_keys(v, words, where))
    return found


def start_homes(root: Path, extras: dict[str, list[str]], daemon_args: list[str], cores: list[int],
                spawned: list[Daemon], timeout_s: float) -> list[Home]:
    """One 2-device home per label in ``extras`` (its extra daemon flags), started side by side: in
    each, daemon a (``--new-home``, core 0) and daemon b (``--token``, core 1); waits until each home
    has a plan of 2 stages, loaded and stable."""
    t = time.monotonic()
    pairs = []
    for label, extra in extras.items():
        a = Daemon(root / label, f"{label}-a", cores[0], [*daemon_args, *extra])
        b = Daemon(root / label, f"{label}-b", cores[1 % len(cores)], [*daemon_args, *extra])
        spawned += [a, b]
        a.start(["--new-home", f"ha-{label}"], api=True)
        pairs.append((label, a, b))
    for _, a, _ in pairs:
        wait_for(f"{a.name} to serve its API", a.status, timeout_s, [a])
    for _, a, b in pairs:
        b.start(["--token", invite(a)])
    homes = []
    for label, a, b in pairs:
        st = wait_for(f"a plan over {a.name} and {b.name} (2 stages, loaded, stable {PLAN_STABLE_S:.0f} s)",
                      PlanWatch([a, b]), max(30.0, timeout_s - (time.monotonic() - t)), [a, b])
        wait_for(f"{a.name}'s TCP API", lambda: _tcp_health(a.api_port), 30, [a, b])
        homes.append(Home(label, [a, b], st["plan"], time.monotonic() - t))
    return homes


def _tcp_health(port: int) -> bool:
    import httpx

    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


# --------------------------------------------------------------------------- requests


@dataclass
class Reply:
    text: str = ""
    calls: list = field(default_factory=list)  # [(name, arguments dict)]
    prompt_tokens: int | None = None
    cached: int | None = None
    prefilled: int | None = None
    client_ttft_s: float | None = None  # request sent -> first streamed chunk
    ttft_s: float | None = None  # the coordinator's: request in the engine -> first token
    request_id: str | None = None
    error: str | None = None


class Api:
    """The ``openai`` SDK and the ``ollama`` client on one home's loopback TCP API; an httpx response
    hook keeps each reply's ``X-Request-Id`` (the key of its ``request_done`` log line)."""

    def __init__(self, home: Home):
        import httpx
        import ollama
        import openai

        self.home = home
        self.rid: str | None = None
        hooks = {"response": [self._on_response]}
        port = home.coordinator.api_port
        self.openai = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0,
                                    timeout=REQUEST_TIMEOUT_S,
                                    http_client=httpx.Client(timeout=REQUEST_TIMEOUT_S, event_hooks=hooks))
        self.ollama = ollama.Client(host=f"http://127.0.0.1:{port}", timeout=REQUEST_TIMEOUT_S, event_hooks=hooks)

    def _on_response(self, response) -> None:
        self.rid = response.headers.get("x-request-id")

    def chat(self, api: str, messages: list[dict], tools: list[dict] | None, max_tokens: int) -> Reply:
        self.rid = None
        reply = Reply()
        t0 = time.perf_counter()
        try:
            (self._openai_chat if api == "openai" else self._ollama_chat)(reply, t0, messages, tools, max_tokens)
        except Exception as exc:  # noqa: BLE001 - recorded per request
            reply.error = f"{type(exc).__name__}: {exc}"[:300]
        reply.request_id = self.rid
        self._server_side(reply)
        return reply

    def _openai_chat(self, reply: Reply, t0: float, messages, tools, max_tokens: int) -> None:
        kw = {"tools": tools} if tools else {}
        stream = self.openai.chat.completions.create(
            model=MODEL_NAME, messages=messages, temperature=0, max_tokens=max_tokens, seed=0, stream=True,
            stream_options={"include_usage": True}, **kw)
        calls: dict[int, list] = {}
        for chunk in stream:
            if reply.client_ttft_s is None:
                reply.client_ttft_s = time.perf_counter() - t0
            for ch in chunk.choices:
                reply.text += ch.delta.content or ""
                for tc in ch.delta.tool_calls or []:
                    slot = calls.setdefault(tc.index, ["", ""])
                    slot[0] += (tc.function.name or "") if tc.function else ""
                    slot[1] += (tc.function.arguments or "") if tc.function else ""
            if chunk.usage is not None:
                reply.prompt_tokens = chunk.usage.prompt_tokens
                details = chunk.usage.prompt_tokens_details
                reply.cached = (details.cached_tokens if details is not None else None) or 0
        reply.calls = [(n, json.loads(a) if a.strip() else {}) for n, a in (calls[i] for i in sorted(calls))]
        if reply.prompt_tokens is not None:
            reply.prefilled = reply.prompt_tokens - reply.cached

    def _ollama_chat(self, reply: Reply, t0: float, messages, tools, max_tokens: int) -> None:
        for part in self.ollama.chat(model=MODEL_NAME, messages=messages, tools=tools, stream=True,
                                     keep_alive="300s", options={"num_ctx": 8192, "temperature": 0,
                                                                 "num_predict": max_tokens, "seed": 0}):
            if reply.client_ttft_s is None:
                reply.client_ttft_s = time.perf_counter() - t0
            reply.text += part.message.content or ""
            reply.calls += [(tc.function.name, dict(tc.function.arguments)) for tc in part.message.tool_calls or []]
            if part.done:
                reply.prefilled = part.prompt_eval_count

    def complete_ids(self, ids: list[int]) -> Reply:
        """A token-id prompt through ``/v1/completions``, one token out (the new-token probe)."""
        self.rid = None
        reply = Reply()
        t0 = time.perf_counter()
        try:
            for chunk in self.openai.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=1, temperature=0,
                                                        stream=True, stream_options={"include_usage": True}):
                if reply.client_ttft_s is None:
                    reply.client_ttft_s = time.perf_counter() - t0
                if chunk.usage is not None:
                    reply.prompt_tokens = chunk.usage.prompt_tokens
                    details = chunk.usage.prompt_tokens_details
                    reply.cached = (details.cached_tokens if details is not None else None) or 0
                    reply.prefilled = reply.prompt_tokens - reply.cached
        except Exception as exc:  # noqa: BLE001 - recorded
            reply.error = f"{type(exc).__name__}: {exc}"[:300]
        reply.request_id = self.rid
        self._server_side(reply)
        return reply

    def _server_side(self, reply: Reply, timeout_s: float = 10.0) -> None:
        """The coordinator's ``request_done`` line for this reply: its TTFT and prompt tokens."""
        if reply.request_id is None:
            return
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            rec = next((e for e in reversed(self.home.coordinator.events())
                        if e.get("event") == "request_done" and e.get("request_id") == reply.request_id), None)
            if rec is not None:
                reply.ttft_s = rec.get("ttft_s")
                if reply.prompt_tokens is None and rec.get("prompt_tokens") is not None:
                    reply.prompt_tokens = rec["prompt_tokens"]
                if reply.cached is None and reply.prompt_tokens is not None and reply.prefilled is not None:
                    reply.cached = reply.prompt_tokens - reply.prefilled
                return
            time.sleep(0.05)


# --------------------------------------------------------------------------- runs


def replay(home: Home, convs: list[Conversation], prompting: Prompting, max_tokens: int) -> list[dict]:
    """Every conversation's two requests, in order, one at a time; a row per request."""
    api = Api(home)
    rows = []
    for conv in convs:
        for step in (1, 2):
            r = api.chat(conv.api, prompting.messages(conv, step), prompting.tools(), max_tokens)
            row = {"conversation": conv.index + 1, "api": conv.api, "request": step, "command": conv.cmd.text,
                   **{k: getattr(r, k) for k in ("prompt_tokens", "cached", "prefilled", "ttft_s", "client_ttft_s",
                                                 "request_id", "error")},
                   "text": r.text, "calls": r.calls}
            rows.append(row)
            log(f"  [{home.label}] {conv.index + 1:2d}.{step} {conv.api:6s} prompt {r.prompt_tokens} cached {r.cached} "
                f"ttft {_f(r.ttft_s)} s" + (f" ERROR {r.error}" if r.error else
                                            f" -> {r.calls if r.calls else repr(r.text[:60])}"))
    return rows


PROBE_WORDS = ("amber river quietly folds paper lanterns under seven copper bridges while distant owls count "
               "marble stones beside a narrow canal where bakers whistle old songs and bicycles lean against "
               "green shutters near the harbour market selling figs olives cheese bread honey and salt").split()


def probe_ids(tok, n: int, seed: int) -> list[int]:
    """``n`` token ids of seeded word salad: starts unlike any chat prompt (no template, random words)."""
    rng = random.Random(1000 + seed)
    words: list[str] = []
    ids: list[int] = []
    while len(ids) < n:
        words += rng.sample(PROBE_WORDS, len(PROBE_WORDS))
        ids = list(tok.encode(" ".join(words).capitalize()))
    return ids[:n]


def probe_new_tokens(home: Home, rows: list[dict], tok, max_probes: int) -> list[dict]:
    """For warm requests (at most ``max_probes``, spread over their prefilled counts), a fresh prompt of
    that many tokens: its TTFT is what prefilling only the new tokens costs on this mesh."""
    warm = sorted((r for r in rows[1:] if not r["error"] and r["prefilled"]), key=lambda r: r["prefilled"])
    if len(warm) > max_probes > 0:
        step = (len(warm) - 1) / (max_probes - 1) if max_probes > 1 else 0
        warm = [warm[round(i * step)] for i in range(max_probes)]
    api, probes = Api(home), []
    for k, row in enumerate(warm):
        r = api.complete_ids(probe_ids(tok, row["prefilled"], k))
        probes.append({"for": f"{row['conversation']}.{row['request']}", "tokens": row["prefilled"],
                       "prompt_tokens": r.prompt_tokens, "cached": r.cached, "ttft_s": r.ttft_s,
                       "client_ttft_s": r.client_ttft_s, "error": r.error})
        row["probe_ttft_s"] = r.ttft_s
        log(f"  [probe] {row['prefilled']:5d} fresh tokens (for {row['conversation']}.{row['request']}): ttft "
            f"{_f(r.ttft_s)} s, cached {r.cached}" + (f" ERROR {r.error}" if r.error else ""))
    return probes


def _stage_forward_times(model: str, weights: str, layers: tuple[int, int], core: int,
                         cases: list[tuple[int, int]], out) -> None:
    """(child process) One stage of the plan on its own core, one thread, in the daemons' numeric mode:
    for each (cached, new) case, the forward of ``new`` rows after ``cached`` held positions (best of 2)."""
    import torch

    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    from decoding.device import resolve_weights
    from decoding.loader import open_model

    src = open_model(model)
    dtype, packed = resolve_weights(weights, torch.device("cpu"))
    stage = src.load_stage(layers[0], layers[1], dtype, packed=packed)
    longest = max(c + n for c, n in cases)
    gen = torch.Generator().manual_seed(0)

    def rows(n):
        if stage.is_first:
            return torch.randint(100, 20000, (n,), generator=gen)
        return torch.randn(n, src.config.hidden_size, generator=gen)

    kv = stage.new_cache(longest + 64)
    kv.create("s", longest + 64)
    with torch.inference_mode():
        stage.forward(kv, "s", rows(max(c for c, _ in cases)), all_logits=False, head=False)
        times = []
        for cached, new in cases:
            best = None
            for _ in range(2):
                held = kv.length("s")
                if held > cached:
                    kv.truncate("s", cached)
                elif held < cached:  # the positions it reused (not timed)
                    stage.forward(kv, "s", rows(cached - held), all_logits=False, head=False)
                t = time.perf_counter()
                stage.forward(kv, "s", rows(new), all_logits=False, head=stage.is_last)
                best = min(best or 1e9, time.perf_counter() - t)
            times.append(best)
    out.put((layers, times))


def in_context_prefill(model: Path, weights: str, plan: dict, cores: list[int], rows: list[dict]) -> list[float]:
    """What prefilling only a warm request's new tokens costs on this plan with nothing in the way: each
    stage's forward of those rows after the cached positions (its own layers, its own core, one thread, the
    daemons' mode), summed over the stages (one chunk crosses them in turn). The warm request's TTFT over
    this is what the cache's machinery (probe, fork, hops, the API) adds."""
    import multiprocessing as mp

    cases = [(r["cached"], r["prefilled"]) for r in rows]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    stages = [tuple(st["layers"]) for st in plan.get("stages", [])]
    procs = [ctx.Process(target=_stage_forward_times, args=(str(model), weights, lay, cores[i % len(cores)],
                                                             cases, q)) for i, lay in enumerate(stages)]
    for p in procs:
        p.start()
    results = []
    for _ in procs:
        while True:
            try:
                results.append(q.get(timeout=5))
                break
            except Exception:  # noqa: BLE001 - queue.Empty: is anyone still working?
                if not any(p.is_alive() for p in procs):
                    raise SystemExit("the in-context prefill measurement failed (see its traceback above)")
    for p in procs:
        p.join(60)
    return [round(sum(times[i] for _, times in results), 4) for i in range(len(cases))]


def llama_cpp_anchor(model: Path, convs: list[Conversation], prompting: Prompting, max_tokens: int,
                     core: int) -> dict:
    """The same conversations through llama.cpp's server on one core, one thread (the bar: what a home
    gets from its best device alone). Its slot keeps the last prompt (``cache_prompt``), so it too
    prefills only a warm request's new tokens."""
    from bench.llama_server import LlamaServer

    if not LlamaServer.available():
        return {"llama_cpp": "not built (bench/build_llama_cpp.sh)"}
    rows = []
    with LlamaServer(model, core=core) as srv:
        for conv in convs:
            for step in (1, 2):
                shaped = Conversation(conv.index, conv.cmd, "openai")  # llama-server speaks OpenAI's shapes
                r = srv.chat(prompting.messages(shaped, step), prompting.tools(), max_tokens)
                rows.append({"conversation": conv.index + 1, "request": step, "ttft_s": round(r.ttft_s, 4),
                             "prompt_tokens": r.prompt_tokens, "evaluated": r.evaluated, "cached": r.cached})
                log(f"  [llama.cpp] {conv.index + 1:2d}.{step} prompt {r.prompt_tokens} cached {r.cached} "
                    f"ttft {r.ttft_s:.3f} s")
    warm = _med(r["ttft_s"] for r in rows[1:])
    return {"llama_cpp_cold_ttft_s": rows[0]["ttft_s"], "llama_cpp_warm_ttft_median_s": warm,
            "llamacpp_warm_ttft_median_s": warm,  # the key issue #46 names
            "llama_cpp_setup": f"llama-server (bench/build_llama_cpp.sh), 1 thread pinned to core {core}, "
                               "cache_prompt on, one slot, the same GGUF", "llama_cpp_rows": rows}


# --------------------------------------------------------------------------- model, budget, summary


def resolve(name: str | None) -> Path:
    from meshd.model.store import resolve_model

    return Path(resolve_model(None if name in (None, "", EMBEDDED) else name)).resolve()


def default_budget_mb(model: Path, num_layers: int, weights: str) -> int:
    """A memory budget that makes the planner split the model in two: halfway between what the larger
    stage of the most even 2-way split needs and what the whole model needs (weights + KV for the plan's
    longest prompt + workspace), by the shipped profile of this model the planner takes for ``weights``
    (that mode's, else float32's, else the first: ``meshd.model.profile_files.prefer_mode``)."""
    from meshd.mesh.home_plan import PLAN_MAX_SEQ, shipped_profiles
    from partition.layers import stage_memory_bytes
    from partition.profile import DeviceProfile

    same = [d for d in shipped_profiles()
            if str((d.get("model") or {}).get("identity", "")).split("@")[0] == model.name]
    same.sort(key=lambda d: (d.get("dtype") != weights, d.get("dtype") != "float32"))
    if not same:
        raise SystemExit(f"no shipped profile of {model.name} to size a split budget: pass --memory-budget-mb "
                         "(between what half the model and what all of it needs)")
    p = DeviceProfile.from_dict(same[0])
    if p.num_layers != num_layers:
        raise SystemExit(f"the shipped profile of {model.name} has {p.num_layers} layers, the model {num_layers}")
    L = p.num_layers
    whole = stage_memory_bytes(p, 0, L, PLAN_MAX_SEQ)
    split = min(max(stage_memory_bytes(p, 0, c, PLAN_MAX_SEQ), stage_memory_bytes(p, c, L, PLAN_MAX_SEQ))
                for c in range(1, L))
    return int((split + whole) / 2 / 2**20)


def _f(x, fmt: str = "{:.3f}") -> str:
    return "-" if x is None else fmt.format(x)


def _med(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return round(statistics.median(xs), 4) if xs else None


def print_table(rows: list[dict]) -> None:
    log(f"{'conv':>4} {'api':<6} {'req':>3} {'prompt':>6} {'cached':>6} {'prefill':>7} {'TTFT s':>7} "
        f"{'client s':>8} {'fresh s':>7}  answer")
    for r in rows:
        ans = "ERROR " + r["error"] if r["error"] else (
            ", ".join(f"{n}({json.dumps(a)})" for n, a in r["calls"]) if r["calls"] else repr(r["text"]))
        log(f"{r['conversation']:>4} {r['api']:<6} {r['request']:>3} {_f(r['prompt_tokens'], '{}'):>6} "
            f"{_f(r['cached'], '{}'):>6} {_f(r['prefilled'], '{}'):>7} {_f(r['ttft_s']):>7} "
            f"{_f(r['client_ttft_s']):>8} {_f(r.get('probe_ttft_s')):>7}  {ans[:70]}")


def parity_of(on: list[dict], off: list[dict]) -> tuple[bool, int, list[str]]:
    """Request by request over the ``off`` rows (the first conversations, when the parity home replayed
    fewer): the same text and the same tool calls (errors never match)."""
    same, diffs = 0, []
    for a, b in zip(on, off):
        ok = not a["error"] and not b["error"] and a["text"] == b["text"] and \
            json.dumps(a["calls"], sort_keys=True) == json.dumps(b["calls"], sort_keys=True)
        same += ok
        if not ok:
            diffs.append(f"{a['conversation']}.{a['request']}: cache on {a['calls'] or a['text']!r} "
                         f"{a['error'] or ''} vs off {b['calls'] or b['text']!r} {b['error'] or ''}"[:300])
    return same == len(off) > 0, same, diffs


def check_cold(on: list[dict], probes: list[dict], off: list[dict] | None) -> None:
    """The cold sections — the run's first request, every fresh-prompt probe, every request of the
    cache-off home — must have reused nothing (each request's own count from the API's usage, which the
    coordinator takes from the stages' answers); otherwise a cold figure would be a cache hit."""
    hits = [f"request {r['conversation']}.{r['request']} (first of the run)" for r in on[:1] if r["cached"]]
    hits += [f"probe for {p['for']}" for p in probes if p["cached"]]
    hits += [f"cache-off request {r['conversation']}.{r['request']}" for r in (off or []) if r["cached"]]
    if hits:
        raise CacheHit(f"cold sections reused cached prompt positions: {', '.join(hits)} — their figures would be "
                       "prefix-cache hits, not prefills")


def summarize(on: list[dict], probes: list[dict], off: list[dict] | None) -> dict:
    check_cold(on, probes, off)
    cold = on[0]
    warm = [r for r in on[1:] if not r["error"]]
    warm_med = _med(r["ttft_s"] for r in warm)
    # prefilling only the new tokens: each stage's forward of them after the cached positions (no probe,
    # fork, hop or API); a fresh prompt of as many tokens (no context to attend to) is shown beside it
    new_tok = _med(r.get("in_context_prefill_s") for r in warm)
    fresh = _med(p["ttft_s"] for p in probes if not p["error"])
    cold_s = cold["ttft_s"] if not cold["error"] else None
    out = {
        "cold_ttft_s": cold_s,
        "warm_ttft_median_s": warm_med,
        "new_tokens_prefill_s": new_tok,
        "warm_vs_cold": round(warm_med / cold_s, 4) if warm_med and cold_s else None,
        "warm_vs_new_tokens": round(warm_med / new_tok, 4) if warm_med and new_tok else None,
        # the same comparison request by request: each warm request over its own in-context prefill
        "warm_vs_new_tokens_paired_median": _med(r["ttft_s"] / r["in_context_prefill_s"] for r in warm
                                                 if r.get("in_context_prefill_s") and r["ttft_s"] is not None),
        "fresh_prompt_prefill_s": fresh,
        "warm_vs_fresh_prompt_paired_median": _med(r["ttft_s"] / r["probe_ttft_s"] for r in warm
                                                   if r.get("probe_ttft_s") and r["ttft_s"] is not None),
        "cached_tokens_total": sum(r["cached"] or 0 for r in on),
        "warm_prefilled_median": _med(r["prefilled"] for r in warm),
        "warm_cached_median": _med(r["cached"] for r in warm),
        "client_cold_ttft_s": cold["client_ttft_s"],
        "client_warm_ttft_median_s": _med(r["client_ttft_s"] for r in warm),
        "errors": sum(1 for r in on if r["error"]),
    }
    out["targets"] = {
        f"warm <= {WARM_TARGET}x cold": out["warm_vs_cold"] is not None and out["warm_vs_cold"] <= WARM_TARGET,
        f"warm <= {NEW_TOKENS_TARGET}x new-token prefill": out["warm_vs_new_tokens"] is not None
        and out["warm_vs_new_tokens"] <= NEW_TOKENS_TARGET}
    if off is not None:
        parity, same, diffs = parity_of(on, off)
        out.update({"parity": parity, "parity_count": f"{same}/{len(off)}", "parity_diffs": diffs,
                    "off_cold_ttft_s": off[0]["ttft_s"], "off_ttft_median_s": _med(r["ttft_s"] for r in off[1:]),
                    "off_cached_tokens_total": sum(r["cached"] or 0 for r in off),
                    "off_errors": sum(1 for r in off if r["error"])})
    else:
        out.update({"parity": None, "parity_count": "skipped", "off_ttft_median_s": None})
    return out


# --------------------------------------------------------------------------- main


def run(args, root: Path, spawned: list[Daemon], t_begin: float) -> dict:
    from decoding.device import default_cpu_mode
    from meshd.model.store import open_model

    model = resolve(args.model)
    src = open_model(model)
    tok = src.tokenizer
    num_layers = src.config.num_layers
    prompting = Prompting("tools" if tok.supports_tools else "inline")
    sys_tokens = len(tok.apply_chat(prompting.template_messages(), add_generation_prompt=False,
                                    tools=prompting.tools()))
    # the daemons' own choice before they measure (self-profiling is off for them): packed with a bfloat16
    # unit, else gguf
    mode = args.weights if args.weights not in (None, "auto") else default_cpu_mode()
    budget = args.memory_budget_mb or default_budget_mb(model, num_layers, mode)
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    convs = conversations(args.conversations)
    setup = {**machine_banner(), "devices": 2, "daemon_cores": cores[:2] if len(cores) > 1 else cores * 2,
             "pinning": "sched_setaffinity in each daemon (one core each), OMP_NUM_THREADS=1",
             "torch_threads_per_daemon": 1, "model": model.name, "memory_budget_mb": budget,
             "self_profile": "off (the shipped profile plans)", "tools_mode": prompting.mode,
             "weights": args.weights or "the daemon's default (auto)",
             "conversations": len(convs), "requests": 2 * len(convs), "max_tokens": args.max_tokens,
             "decoding": "greedy (temperature 0, seed 0)", "apis": "alternating ollama (/api/chat, streamed) / "
             "openai (/v1/chat/completions, streamed + include_usage)", "prefix_cache_share": "default (0.5)",
             "parity_home": f"--prefix-cache-share 0, the first {args.parity_conversations} conversations"
             if args.parity else "skipped", "quick": args.quick,
             "prompts": "warm is the subject: the run's first request is cold, every later one warm (its cached "
                        "tokens from the API's usage); probes and the cache-off home are cold, and a cold one that "
                        "reused any position fails the run (check_cold)"}
    log(f"setup: 2 devices, each a meshd daemon pinned to its own core, 1 torch thread; "
        f"{'embedded model' if resolve(None) == model else 'model'} {model.name} (tools {prompting.mode}); "
        f"weights {args.weights or 'auto'}; memory budget {budget} MB each; {len(convs)} conversations x 2 "
        f"requests, greedy, max_tokens {args.max_tokens}; machine {setup['cores']} cores ({setup['cpu']}), "
        f"load {setup['load_avg_1m']:.2f}")
    log(f"system prompt + tools: {sys_tokens} tokens after {model.name}'s chat template "
        f"({'>= 2000: ok' if sys_tokens >= 2000 else 'UNDER 2000'})")
    if len(cores) < 2:
        log("note: fewer than 2 cores available: both daemons share one")

    extras = {"on": [], **({"off": ["--prefix-cache-share", "0"]} if args.parity else {})}
    log("starting the home (prefix cache on)" + (" and, beside it, the parity home (--prefix-cache-share 0; "
                                                 "idle until its turn)" if args.parity else "") + " ...")
    daemon_args = ["--model", str(model), "--memory-budget-mb", str(budget), "--self-profile", "off",
                   *(["--weights", args.weights] if args.weights else [])]
    homes = start_homes(root, extras, daemon_args, cores, spawned, args.start_timeout)
    home = homes[0]
    setup["plan_on"] = home.layout()
    setup["daemon_affinity"] = {d.name: d.affinity() for h in homes for d in h.daemons}
    log(f"up in {home.up_s:.1f} s: plan v{home.plan.get('version')} {home.layout()} "
        f"({home.plan.get('reason')}); affinity {setup['daemon_affinity']}")
    v0 = home.plan.get("version")
    on = replay(home, convs, prompting, args.max_tokens)
    probes = probe_new_tokens(home, on, tok, args.probes)
    v1 = home.plan_version()
    setup["prefix_cache_status_on"] = home.cache_status()
    log(f"prefix cache status after the run: {json.dumps(setup['prefix_cache_status_on'])}")
    if v1 != v0:
        log(f"WARNING: the plan changed during the run (v{v0} -> v{v1}): a re-plan drops the prefix cache")
    stop_all(home.daemons)

    off = None
    if args.parity:
        home_off = homes[1]
        st = wait_for("the parity home's plan (2 stages, loaded, stable)", PlanWatch(home_off.daemons),
                      args.start_timeout, home_off.daemons)
        home_off.plan = st["plan"]
        setup["plan_off"] = home_off.layout()
        log(f"parity home (--prefix-cache-share 0): plan v{home_off.plan.get('version')} {home_off.layout()}")
        off = replay(home_off, convs[:args.parity_conversations], prompting, args.max_tokens)
        setup["prefix_cache_status_off"] = home_off.cache_status()
        stop_all(home_off.daemons)

    warm_rows = [r for r in on[1:] if not r["error"] and r["prefilled"]]
    log(f"in-context prefill: each stage's forward of every warm request's new tokens after its cached "
        f"positions ({len(warm_rows)} requests; plan {home.layout()}, {mode}) ...")
    for r, t in zip(warm_rows, in_context_prefill(model, mode, home.plan, setup["daemon_cores"], warm_rows)):
        r["in_context_prefill_s"] = t
    summary = summarize(on, probes, off)
    if args.llama_cpp:
        log("llama.cpp anchor: the same conversations through llama-server on one core ...")
        summary.update(llama_cpp_anchor(model, convs, prompting, args.max_tokens, setup["daemon_cores"][0]))
    result = {"bench": "home_assistant", "model": model.name, "system_prompt_tokens": sys_tokens,
              "requests": len(on), **summary, "setup": setup, "rows": on, "probes": probes,
              "rows_off": off, "plan_changed_during_run": v1 != v0,
              "seconds": round(time.monotonic() - t_begin, 1)}
    report(result, on)
    return result


def report(res: dict, on: list[dict]) -> None:
    log("")
    log("per request, prefix cache on (TTFT: the coordinator's; client: to the first streamed chunk; "
        "fresh: a prompt of the same number of new tokens with no cached prefix):")
    print_table(on)
    log("")
    log(f"system prompt tokens {res['system_prompt_tokens']}; cached tokens total {res['cached_tokens_total']}; "
        f"warm median: cached {res['warm_cached_median']}, prefilled {res['warm_prefilled_median']}")
    log(f"cold TTFT {_f(res['cold_ttft_s'])} s; warm median TTFT {_f(res['warm_ttft_median_s'])} s; new-token "
        f"prefill {_f(res['new_tokens_prefill_s'])} s; cache off: cold {_f(res.get('off_cold_ttft_s'))} s, "
        f"median {_f(res['off_ttft_median_s'])} s")
    for name, ok in res["targets"].items():
        value = res["warm_vs_cold"] if "cold" in name else res["warm_vs_new_tokens"]
        log(f"target {name}: {_f(value, '{:.3f}')}x {'PASS' if ok else 'FAIL'}")
    log(f"warm TTFT / in-context prefill of its new tokens, request by request, median: "
        f"{_f(res['warm_vs_new_tokens_paired_median'], '{:.3f}')}x; fresh prompt of as many tokens (no context): "
        f"{_f(res['fresh_prompt_prefill_s'])} s, warm / fresh paired median "
        f"{_f(res['warm_vs_fresh_prompt_paired_median'], '{:.3f}')}x")
    log(f"parity with the cache off: {res['parity']} ({res['parity_count']})")
    if res.get("llama_cpp_cold_ttft_s") is not None:
        log(f"llama.cpp, one core: cold TTFT {_f(res['llama_cpp_cold_ttft_s'])} s, warm median "
            f"{_f(res['llama_cpp_warm_ttft_median_s'])} s (meshd 2 devices: {_f(res['cold_ttft_s'])} s, "
            f"{_f(res['warm_ttft_median_s'])} s)")
    for d in res.get("parity_diffs") or []:
        log(f"  differs {d}")
    log(f"total {res['seconds']:.0f} s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="10 conversations (<= 5 min on 2 cores, embedded model)")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--out", default=None, help="also write the result (indented) to this file")
    ap.add_argument("--model", default=None, help=f"catalog name or GGUF path (default: the embedded {EMBEDDED})")
    ap.add_argument("--conversations", type=int, default=None, help="conversations to replay (default 16; --quick 10)")
    ap.add_argument("--max-tokens", type=int, default=None, help="tokens per answer (default 48; --quick 32)")
    ap.add_argument("--probes", type=int, default=None,
                    help="new-token prefill probes, spread over the warm requests' sizes (default: all; --quick 8)")
    ap.add_argument("--weights", default=None,
                    help="the daemons' --weights (default: theirs, auto; --quick: float32, whose prefill is ~4x "
                         "packed's on CPUs without AVX-512/AMX)")
    ap.add_argument("--no-parity", dest="parity", action="store_false", help="skip the cache-off home")
    ap.add_argument("--llama-cpp", action="store_true", help="also replay the conversations through llama.cpp's "
                    "server on one core (the anchor; needs bench/build_llama_cpp.sh's cached build)")
    ap.add_argument("--parity-conversations", type=int, default=None,
                    help="conversations the cache-off home replays, the first ones (default: all; --quick 3: its "
                         "6 full prefills of ~3,300 tokens take ~1.5 min on a 2-core AVX2 VM)")
    ap.add_argument("--memory-budget-mb", type=int, default=0,
                    help="each daemon's budget (default: one that makes the planner split the model in two)")
    ap.add_argument("--start-timeout", type=float, default=300.0, help="seconds for a home to be up and planned")
    ap.add_argument("--keep", action="store_true", help="keep the state dirs and daemon logs")
    args = ap.parse_args()
    args.conversations = args.conversations or (10 if args.quick else 16)
    args.max_tokens = args.max_tokens or (32 if args.quick else 48)
    args.weights = args.weights or ("float32" if args.quick else None)
    args.parity_conversations = min(args.conversations, args.parity_conversations
                                    or (3 if args.quick else args.conversations))
    args.probes = args.probes if args.probes is not None else (4 if args.quick else 2 * args.conversations)

    t_begin = time.monotonic()
    root = Path(tempfile.mkdtemp(prefix="meshd-ha-prefix-"))
    spawned: list[Daemon] = []
    result, rc, failed = None, 1, False

    def on_term(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        result = run(args, root, spawned, t_begin)
        targets_ok = all(result["targets"].values())
        rc = 0 if result["errors"] == 0 and result["parity"] is not False and targets_ok else 1
    except KeyboardInterrupt:
        log("interrupted")
        rc, failed = 130, True
    except Exception as exc:  # noqa: BLE001 - reported; the daemons are still stopped
        log(f"home_assistant bench failed: {type(exc).__name__}: {exc}")
        for d in spawned:
            log(f"--- {d.name} log tail ---\n{d.tail(20)}")
        rc, failed = 2, True
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        codes = stop_all(spawned)
        if args.keep or failed:
            log(f"state dirs and daemon logs kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if result is not None:
        result["daemon_exit_codes"] = codes
        result["exit_code"] = rc
        finish(result, args.out, args.json)
    return rc


if __name__ == "__main__":
    sys.exit(main())
