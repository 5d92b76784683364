"""Whole Home Assistant turns, as a user waits for them: command, the model's call, HA's tool result, the answer.

``bench/ha_commands.py --turns`` runs this. Each turn is what Home Assistant's Ollama
integration sends (bench/ha_home.py's system prompt, 71 entities, the 16 Assist tools): the
spoken command streamed through ``/api/chat``; the call the model makes; a tool message shaped
like Home Assistant's (``action_done`` with ``success`` targets, ``GetLiveContext`` /
``GetDateTime`` results); the streamed spoken answer (up to three tool rounds, as HA loops while
answers hold calls). Every command is run with speculation under the grammar on (meshd's
default) and off (``"speculative": "off"``), each mode on fresh daemons (a second run of a turn
on the same daemons would find its tool result in the prefix cache), greedy. Reported per
turn and as medians over the warm turns (every turn after the first: Home Assistant's system
prompt cached): first-token time, call done, answer done, model steps per generated token
(from the reply's ``speculative`` usage; 1.0 with speculation off) for the tool-call requests
and the answers; ``parity``: the same calls and words on and off. The same turns go through
``llama-server --jinja`` (same GGUF, one thread on one core, its prompt cache on) when llama.cpp
is built, else skipped with a note; a call llama-server cannot parse (the model's ```json fence,
the doubled braces of the GGUF's template) ends its turn as text, and ``calls_parsed`` says how often.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.ha_home import COMMANDS, TOOLS, Command, system_prompt

ROUNDS = 3  # tool rounds per turn at most (Home Assistant loops while an answer holds calls)
MAX_TOKENS = 96


@dataclass
class Request:
    """One streamed request of a turn, as the client saw it."""

    ttft_s: float
    total_s: float
    content: str
    calls: list[tuple[str, dict]]
    steps: int = 0  # model steps that produced its tokens (0: not reported, i.e. plain decoding)
    tokens: int = 0
    forced: int = 0
    evaluated: int = -1  # prompt tokens computed (the rest came from the prefix cache); -1: not reported

    @property
    def steps_per_token(self) -> float:
        return self.steps / self.tokens if self.steps and self.tokens else 1.0


@dataclass
class Turn:
    command: str
    mode: str  # "on", "off" or "llama.cpp"
    requests: list[Request] = field(default_factory=list)

    @property
    def first_token_s(self) -> float:
        return self.requests[0].ttft_s

    @property
    def call_done_s(self) -> float:
        return self.requests[0].total_s

    @property
    def answer_done_s(self) -> float:
        return sum(r.total_s for r in self.requests)

    def summary(self) -> dict:
        calls = [r for r in self.requests if r.calls]
        answers = [r for r in self.requests if not r.calls]
        return {"command": self.command, "mode": self.mode, "first_token_s": round(self.first_token_s, 3),
                "call_done_s": round(self.call_done_s, 3), "answer_done_s": round(self.answer_done_s, 3),
                "requests": len(self.requests),
                "call_steps_per_token": _ratio(calls), "answer_steps_per_token": _ratio(answers),
                "prompt_evaluated": [r.evaluated for r in self.requests],
                "calls": [c for r in self.requests for c in r.calls],
                "answer": self.requests[-1].content[:200]}


def _ratio(reqs: list[Request]) -> float | None:
    tokens = sum(r.tokens for r in reqs)
    if not reqs or not tokens:
        return None
    return round(sum(r.steps if r.steps else r.tokens for r in reqs) / tokens, 3)


def tool_result(cmd: Command, name: str, args: dict) -> str:
    """What Home Assistant hands back for a call: an intent's response, or a context tool's result."""
    if name == "GetLiveContext":
        return json.dumps({"success": True, "result": "- names: Front Door Lock\n  domain: lock\n  state: locked\n"
                                                      "- names: Bedroom Temperature\n  domain: sensor\n  state: 19.5"})
    if name in ("HassGetCurrentTime", "HassGetCurrentDate", "GetDateTime"):
        return json.dumps({"success": True, "result": {"date": "2026-11-29", "time": "18:04:00",
                                                       "timezone": "Europe/Amsterdam", "weekday": "Sunday"}})
    target = args.get("name") or args.get("area") or cmd.target or ""
    kind = "entity" if args.get("name") else "area"
    return json.dumps({"speech": {}, "response_type": "action_done", "speech_slots": {},
                       "data": {"targets": [], "success": [{"name": target, "type": kind,
                                                            "id": target.lower().replace(" ", "_")}],
                                "failed": []}})


# ----------------------------------------------------------------------------- meshd (Ollama API)

def meshd_request(port: int, model: str, messages: list[dict], speculative: str) -> Request:
    """One ``/api/chat`` request with Home Assistant's body (streamed), meshd's ``speculative`` extension set."""
    body = {"model": f"{model}:latest", "messages": messages, "tools": TOOLS, "stream": True,
            "keep_alive": "300s", "options": {"num_ctx": 8192, "temperature": 0, "num_predict": MAX_TOKENS,
                                              "seed": 0}}
    if speculative == "off":
        body["speculative"] = "off"
    t0 = time.perf_counter()
    ttft, content, calls, final = None, "", [], {}
    with httpx.stream("POST", f"http://127.0.0.1:{port}/api/chat", json=body, timeout=900) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.strip():
                continue
            part = json.loads(line)
            msg = part.get("message") or {}
            if ttft is None and (msg.get("content") or msg.get("tool_calls")):
                ttft = time.perf_counter() - t0
            content += msg.get("content") or ""
            calls += [(c["function"]["name"], dict(c["function"].get("arguments") or {}))
                      for c in msg.get("tool_calls") or []]
            if part.get("done"):
                final = part
    total = time.perf_counter() - t0
    spec = final.get("speculative") or {}
    return Request(ttft if ttft is not None else total, total, content, calls, int(spec.get("steps") or 0),
                   int(spec.get("tokens") or final.get("eval_count") or 0), int(spec.get("forced_accepted") or 0),
                   int(final.get("prompt_eval_count", -1)))


def meshd_turn(port: int, model: str, cmd: Command, speculative: str) -> Turn:
    turn = Turn(cmd.text, speculative)
    messages = [{"role": "system", "content": system_prompt()}, {"role": "user", "content": cmd.text}]
    for _ in range(ROUNDS):
        r = meshd_request(port, model, messages, speculative)
        turn.requests.append(r)
        if not r.calls:
            break
        messages.append({"role": "assistant", "content": r.content,
                         "tool_calls": [{"function": {"name": n, "arguments": a}} for n, a in r.calls]})
        messages += [{"role": "tool", "content": tool_result(cmd, n, a)} for n, a in r.calls]
    return turn


# ----------------------------------------------------------------------------- llama-server (OpenAI API)

def llama_request(port: int, messages: list[dict]) -> Request:
    body = {"messages": messages, "tools": TOOLS, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
            "cache_prompt": True}
    t0 = time.perf_counter()
    ttft, content, parts = None, "", {}
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=900) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:]).get("choices") or []:
                delta = choice.get("delta") or {}
                if ttft is None and (delta.get("content") or delta.get("tool_calls")):
                    ttft = time.perf_counter() - t0
                content += delta.get("content") or ""
                for tc in delta.get("tool_calls") or []:
                    p = parts.setdefault(tc.get("index", 0), {"name": "", "arguments": "", "id": tc.get("id")})
                    fn = tc.get("function") or {}
                    p["name"] += fn.get("name") or ""
                    p["arguments"] += fn.get("arguments") or ""
    total = time.perf_counter() - t0
    calls = []
    for p in parts.values():
        try:
            calls.append((p["name"], json.loads(p["arguments"] or "{}")))
        except ValueError:
            calls.append((p["name"], {}))
    return Request(ttft if ttft is not None else total, total, content, calls)


def llama_turn(port: int, cmd: Command) -> Turn:
    turn = Turn(cmd.text, "llama.cpp")
    messages = [{"role": "system", "content": system_prompt()}, {"role": "user", "content": cmd.text}]
    for _ in range(ROUNDS):
        r = llama_request(port, messages)
        turn.requests.append(r)
        if not r.calls:
            break
        ids = [f"call_{len(messages)}_{i}" for i in range(len(r.calls))]
        messages.append({"role": "assistant", "content": r.content or None, "tool_calls": [
            {"id": i, "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
            for i, (n, a) in zip(ids, r.calls)]})
        messages += [{"role": "tool", "tool_call_id": i, "content": tool_result(cmd, n, a)}
                     for i, (n, a) in zip(ids, r.calls)]
    return turn


# ----------------------------------------------------------------------------- the run

def medians(turns: list[Turn]) -> dict:
    warm = turns[1:] if len(turns) > 1 else turns
    calls = [r for t in warm for r in t.requests if r.calls]
    answers = [r for t in warm for r in t.requests if not r.calls]
    med = lambda xs: round(statistics.median(xs), 3) if xs else None  # noqa: E731
    return {"turns": len(turns), "warm_turns": len(warm),
            "median_first_token_s": med([t.first_token_s for t in warm]),
            "median_call_done_s": med([t.call_done_s for t in warm]),
            "median_turn_s": med([t.answer_done_s for t in warm]),
            "steps_per_token": _ratio(calls), "answer_steps_per_token": _ratio(answers)}


def run_turns(serve, model: str, commands: list[Command], log) -> dict:
    """Every command as a whole turn, all with speculation on, then all off, each mode on fresh daemons
    (``serve()`` starts them: a context manager giving the API port), so every turn of either mode finds
    what a home's would: Home Assistant's system prompt cached after the first turn, nothing of the
    command (a second run of the same turn on the same daemons would find its tool result cached)."""
    by_mode: dict[str, list[Turn]] = {"on": [], "off": []}
    for mode in ("on", "off"):
        with serve() as port:
            for i, cmd in enumerate(commands):
                t = meshd_turn(port, model, cmd, mode)
                by_mode[mode].append(t)
                s = t.summary()
                log(f"[{model}] turn {i + 1:2d}/{len(commands)} speculation {mode:3s}: first token "
                    f"{s['first_token_s']:6.2f} s, call {s['call_done_s']:6.2f} s, answer {s['answer_done_s']:6.2f} s, "
                    f"steps/token call {s['call_steps_per_token']} answer {s['answer_steps_per_token']}: "
                    f"{s['calls']} {s['answer'][:60]!r}")
    on, off = medians(by_mode["on"]), medians(by_mode["off"])
    same = [a.summary()["calls"] == b.summary()["calls"] and a.requests[-1].content == b.requests[-1].content
            for a, b in zip(by_mode["on"], by_mode["off"])]
    return {"on": on, "off": off, "parity": all(same), "parity_turns": f"{sum(same)}/{len(same)}",
            "steps_per_token": on["steps_per_token"],
            "turn_ratio_on_over_off": round(on["median_turn_s"] / off["median_turn_s"], 3)
            if on["median_turn_s"] and off["median_turn_s"] else None,
            "turns": [t.summary() for mode in ("on", "off") for t in by_mode[mode]]}


def llama_turns(path: str, commands: list[Command], core: int, bin_dir: Path | None, log) -> dict:
    from bench.llama_server import LLAMA_BIN, LlamaServer

    bin_dir = bin_dir or LLAMA_BIN
    if not LlamaServer.available(bin_dir):
        return {"skipped": f"llama.cpp is not built at {bin_dir} (bench/build_llama_cpp.sh)"}
    turns = []
    with LlamaServer(Path(path), core=core, bin_dir=bin_dir) as srv:
        for i, cmd in enumerate(commands):
            t = llama_turn(srv.port, cmd)
            turns.append(t)
            s = t.summary()
            log(f"[llama-server] turn {i + 1:2d}/{len(commands)}: first token {s['first_token_s']:6.2f} s, "
                f"call {s['call_done_s']:6.2f} s, answer {s['answer_done_s']:6.2f} s: {s['calls']}")
    parsed = sum(bool(t.requests[0].calls) for t in turns)
    return {**medians(turns), "calls_parsed": f"{parsed}/{len(turns)}",
            "setup": f"llama-server --jinja from {bin_dir}, -t 1 pinned to core {core}, cache_prompt on, the same GGUF",
            "turns": [t.summary() for t in turns]}
