"""Soak test of a real 3-daemon home mesh: many requests while members are killed and restarted.

Issue #10. Three real ``meshd join`` daemons (separate state dirs, loopback,
``--port 0``, paired with invite tokens, the embedded SmolLM2-135M) each pinned
to one core with one torch thread, the way ``meshd demo`` starts its daemons.
Once the plan the planner decides has settled (every daemon ready, one plan
version made over all three, unchanged for ``--plan-stable-s``; it says how many
members it spans: the planner leaves out members that do not make a prompt
faster), ``--requests N`` requests go to all daemons' unix sockets at a random
concurrency of 1-8 (seeded). Each daemon gets ``--memory-budget-mb`` (default
120, half the model, as the daemon tests give) so the home must split:

* greedy chat / text completions, streamed or not, whose text must equal the
  single-device reference (computed once per prompt up front);
* ~10 % clients that hang up during prefill or mid-stream;
* ~5 % hostile payloads that must get a 4xx JSON error.

About every ``--kill-every`` requests a non-first member is SIGKILLed and
restarted from the same state dir on a new port while requests keep flowing;
before the next kill the home must have settled on a plan made over it again.
Every request is classified (completed, mismatched, failed_clearly, hung_up,
rejected_hostile, coordinator_killed, lost); ``lost`` and ``mismatched`` must be 0, and after the
run every daemon's ``stage.kv_tokens_in_use`` must be back to 0.

    python bench/soak.py [--quick] [--json] [--requests 1000] [--seed 0]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._common import daemon_env, emit_json, machine_banner, pinned_child  # noqa: E402
from decoding.device import served_reference_stage  # noqa: E402
from meshd.commands.demo import FAST  # noqa: E402 - the demo's membership timings

ROOT = Path(__file__).resolve().parent.parent
CHAT, TEXT = "/v1/chat/completions", "/v1/completions"
MAX_TOKENS = (8, 16, 24)
N_PROMPTS = 4  # the first short prompts of bench/prompts/home.jsonl
TEXT_SUFFIX = " The answer is"  # a bare question as a text prompt ends at once (EOS); this one continues
REQUEST_TIMEOUT_S = 180.0
HI = b'[{"role": "user", "content": "hi"}]'

# A hostile payload: (path, raw body). Every one must be answered with a 4xx JSON error.
HOSTILE: dict[str, tuple[str, bytes]] = {
    "int_5000_digits": (CHAT, b'{"messages": ' + HI + b', "seed": ' + b"9" * 5000 + b"}"),
    "nested_json_100k": (CHAT, b'{"messages": ' + HI + b', "user": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
    "lone_surrogate": (CHAT, b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}'),
    "top_k_1e30": (CHAT, json.dumps({"messages": json.loads(HI), "top_k": 10**30}).encode()),
    "seed_2_70": (CHAT, json.dumps({"messages": json.loads(HI), "seed": 2**70}).encode()),
    "token_id_2_63": (TEXT, json.dumps({"prompt": [2**63], "max_tokens": 4}).encode()),
    "malformed_json": (CHAT, b'{"messages": [{"role": "user", "content": "hi"}'),
    "unknown_path": ("/v1/no-such-endpoint", b'{"messages": ' + HI + b"}"),
}

OUTCOMES = ("completed", "mismatched", "failed_clearly", "hung_up", "rejected_hostile",
            "coordinator_killed", "lost", "unfinished")


def log(msg: str) -> None:
    print(msg, flush=True)


# --------------------------------------------------------------------------- daemons


class Daemon:
    """One ``meshd join`` process; restartable from the same state dir (new port each time).

    Spawned like ``meshd demo``'s daemons: the demo's membership timings, MESHD_*
    cleared except MESHD_HOME, OMP_NUM_THREADS=1 (one torch thread), pinned to
    one core with sched_setaffinity between fork and exec.
    """

    def __init__(self, root: Path, index: int, core: int, model: str, memory_budget_mb: int = 0):
        self.index, self.core, self.model = index, core, model
        self.budget = ["--memory-budget-mb", str(memory_budget_mb)] if memory_budget_mb else []
        self.name = f"soak-{index}"
        self.dir = root / self.name
        self.dir.mkdir(parents=True)
        self.state, self.socket, self.log = self.dir / "state", self.dir / "api.sock", self.dir / "daemon.log"
        self.proc: subprocess.Popen | None = None
        self.incarnation = 0
        self.routable = False  # the dispatcher may send it new requests
        self.ports: list[int] = []  # transport port of each incarnation
        self.rss_start_mb: float | None = None  # of the current incarnation, after warm-up / rejoin
        self.replayed: dict[int, int] = {}  # incarnation -> last requests_replayed seen

    def start(self, first: list[str] | None = None) -> None:
        cmd = [sys.executable, "-m", "meshd", "join", "--state-dir", str(self.state), "--socket", str(self.socket),
               "--name", self.name, "--port", "0", "--pairing-port", "0", "--interface", "127.0.0.1",
               "--listen", "127.0.0.1", "--model", self.model, *self.budget, *FAST, *(first or [])]
        env = daemon_env(ROOT)
        preexec = pinned_child(self.core)

        self.incarnation += 1
        with open(self.log, "ab") as f:
            f.write(f'{{"event": "soak_start", "incarnation": {self.incarnation}, '
                    f'"timestamp": "{dt.datetime.now(dt.timezone.utc).isoformat()}"}}\n'.encode())
        self.proc = subprocess.Popen(cmd, stdout=open(self.log, "ab"), stderr=subprocess.STDOUT, env=env,
                                     cwd=ROOT, preexec_fn=preexec, start_new_session=True)
        self.rss_start_mb = None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def node_id(self) -> str:
        return (self.state / "node_id").read_text().strip()

    def rss_mb(self) -> float | None:
        if not self.alive():
            return None
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
        except OSError:
            return None
        return None

    def affinity(self) -> list[int] | None:
        try:
            return sorted(os.sched_getaffinity(self.proc.pid))
        except (OSError, AttributeError):
            return None

    def client(self, timeout: float = 5.0):
        import httpx

        return httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=str(self.socket)),
                                 base_url="http://meshd", timeout=timeout)

    async def status(self) -> dict | None:
        if not self.alive():
            return None
        try:
            async with self.client(5.0) as c:
                r = await c.get("/v1/mesh/status")
            if r.status_code != 200:
                return None
            s = r.json()
        except Exception:  # noqa: BLE001 - not up (yet)
            return None
        stage = s.get("stage") or {}
        if "requests_replayed" in stage:
            self.replayed[self.incarnation] = stage["requests_replayed"]
        return s

    def kill(self) -> None:
        if self.alive():
            self.proc.kill()
            self.proc.wait(10)

    def log_tail(self, n: int = 15) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def stop_all(daemons: list[Daemon], deadline_s: float = 20.0) -> list:
    """SIGTERM every daemon, then SIGKILL what is still running after ``deadline_s``."""
    for d in daemons:
        if d.alive():
            with contextlib.suppress(OSError):
                d.proc.send_signal(signal.SIGTERM)
    end = time.monotonic() + deadline_s
    codes = []
    for d in daemons:
        if d.proc is None:
            codes.append(None)
            continue
        try:
            codes.append(d.proc.wait(max(0.1, end - time.monotonic())))
        except subprocess.TimeoutExpired:
            d.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                d.proc.wait(10)
            codes.append("SIGKILL")
    return codes


def invite(member: Daemon) -> str:
    out = subprocess.run([sys.executable, "-m", "meshd", "invite", "--state-dir", str(member.state), "--json"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    if out.returncode != 0:
        raise RuntimeError(f"meshd invite failed: {out.stderr.strip()[-500:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["token"]


async def wait_for(what: str, cond, timeout: float, interval: float = 0.5):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = await cond()
        if value:
            return value
        await asyncio.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")


class PlanWatch:
    """Waits for the plan the planner decides, not for a layout chosen here.

    The planner leaves out members that would not make a prompt faster (on two
    cores it may well give every layer to one daemon), so "a plan spanning all
    three" can never come. What the soak needs is a settled home: every daemon
    up and ready, all on one plan version that was made over all of them (its
    ``members``; some may get no layers), every stage in it loaded at that
    version, and the version unchanged for ``stable_s``. ``span`` says how many
    members hold layers in it.
    """

    def __init__(self, daemons: list[Daemon], stable_s: float):
        self.daemons = daemons
        self.stable_s = stable_s
        self._seen: tuple | None = None  # (version, stages) last polled
        self._since = 0.0

    async def settled(self) -> dict | None:
        statuses = await asyncio.gather(*(d.status() for d in self.daemons))
        if any(s is None or not s.get("ready") for s in statuses):
            self._seen = None
            return None
        ids = {d.node_id() for d in self.daemons}
        plans = [s.get("plan") or {} for s in statuses]
        key = (plans[0].get("version"), json.dumps(plans[0].get("stages"), sort_keys=True))
        if any((p.get("version"), json.dumps(p.get("stages"), sort_keys=True)) != key for p in plans) \
                or not plans[0].get("stages") or not ids <= set(plans[0].get("members") or ()):
            self._seen = None
            return None
        for s in statuses:
            stage = s.get("stage")
            planned = any(st["node_id"] == s.get("node_id") for st in plans[0]["stages"])
            if planned and (stage is None or stage.get("plan_version") != key[0]):
                return None  # its layers are not loaded at this version yet
        now = time.monotonic()
        if key != self._seen:
            self._seen, self._since = key, now
        if now - self._since < self.stable_s:
            return None
        return statuses[0]


def span_of(status: dict) -> int:
    """How many members hold layers in the plan ``status`` shows."""
    return len((status.get("plan") or {}).get("stages") or [])


# --------------------------------------------------------------------------- references


def load_prompts(n: int) -> list[str]:
    rows = [json.loads(line) for line in (ROOT / "bench" / "prompts" / "home.jsonl").read_text().splitlines()
            if line.strip()]
    return [r["prompt"] for r in rows if r["category"] == "short"][:n]


def references(model: str, prompts: list[str]) -> dict:
    """(api, prompt index, max_tokens) -> greedy text, from one single-device generation per prompt.

    ``generate``'s text is ``tokenizer.decode(tokens)``, so the text for fewer
    tokens is the decode of the first ones of the longest run (greedy).
    """
    import torch

    from decoding.generate import generate
    from decoding.pipeline_local import LocalPipeline
    from meshd.model.store import open_model

    torch.set_num_threads(1)  # as the daemons
    src = open_model(model)
    tok = src.tokenizer
    ref = LocalPipeline([served_reference_stage(src)])  # the daemons' numeric mode (--weights auto)
    out = {}
    for i, p in enumerate(prompts):
        for api, ids in ((CHAT, tok.apply_chat([{"role": "user", "content": p}])), (TEXT, tok.encode(p + TEXT_SUFFIX))):
            res = generate(ref, list(ids), max(MAX_TOKENS), eos_ids=tok.eos_ids, tokenizer=tok)
            for n in MAX_TOKENS:
                out[(api, i, n)] = tok.decode(res.token_ids[:n])
    return out


# --------------------------------------------------------------------------- requests


@dataclass
class Result:
    idx: int
    kind: str  # greedy | hangup | hostile | warmup
    daemon: str
    incarnation: int
    what: str  # e.g. "chat stream 16 p2", "hostile seed_2_70", "hangup prefill"
    outcome: str = "unfinished"
    status: int | None = None
    detail: str = ""
    request_id: str | None = None
    t0: float = 0.0  # wall clock (time.time()) at send
    t1: float = 0.0
    latency_s: float | None = None
    ttft_s: float | None = None
    extra: dict = field(default_factory=dict)


def _error_message(raw: bytes) -> tuple[str | None, str | None]:
    """(message, code) of an OpenAI error body, or (None, None)."""
    try:
        err = json.loads(raw)["error"]
        return (err.get("message") or None), err.get("code")
    except (ValueError, KeyError, TypeError, AttributeError):
        return None, None


def _classify_error(res: Result, status: int, raw: bytes, in_band: bool = False) -> None:
    msg, code = _error_message(raw)
    res.status = status
    res.detail = (f"{'in-band ' if in_band else ''}HTTP {status} {code}: {msg}" if msg
                  else f"HTTP {status} body {raw[:300]!r}")
    # A generic internal error is a bug in the daemon, not a clear failure.
    res.outcome = "failed_clearly" if msg and code != "internal_error" and status != 500 else "lost"


class Soak:
    def __init__(self, args, daemons: list[Daemon], refs: dict, prompts: list[str]):
        self.args, self.daemons, self.refs, self.prompts = args, daemons, refs, prompts
        self.results: list[Result] = []
        self.inflight: dict[int, tuple[Result, Daemon, int]] = {}  # idx -> (result, daemon, incarnation)
        self.killed: set[tuple[str, int]] = set()  # (daemon, incarnation) SIGKILLed by us
        self.events: list[dict] = []  # kills, restarts, rejoins
        self.t_start = time.monotonic()
        self.wall_start = time.time()
        self.done = 0

    def rel(self) -> float:
        return time.monotonic() - self.t_start

    # -- one request -------------------------------------------------------------------
    async def one(self, res: Result, d: Daemon, spec: dict) -> Result:
        res.t0 = time.time()
        t0 = time.monotonic()
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT_S):
                if spec["kind"] == "hostile":
                    await self._hostile(res, d, spec)
                else:
                    await self._generate(res, d, spec)
        except TimeoutError:
            res.outcome, res.detail = "lost", f"no answer within {REQUEST_TIMEOUT_S:.0f}s"
        except Exception as exc:  # noqa: BLE001 - classified below
            import httpx

            if isinstance(exc, httpx.TransportError):
                where = "before any response" if res.status is None else "after the response started"
                res.detail = f"{type(exc).__name__} {where}: {exc}"
                res.outcome = ("coordinator_killed" if (d.name, res.incarnation) in self.killed else "lost")
            else:
                res.outcome, res.detail = "lost", f"client-side {type(exc).__name__}: {exc}"
        finally:
            self.inflight.pop(res.idx, None)
        res.t1 = time.time()
        res.latency_s = time.monotonic() - t0
        return res

    async def _hostile(self, res: Result, d: Daemon, spec: dict) -> None:
        path, raw = HOSTILE[spec["case"]]
        async with d.client(30.0) as c:
            r = await c.post(path, content=raw, headers={"Content-Type": "application/json"})
        msg, code = _error_message(r.content)
        res.status = r.status_code
        res.detail = f"HTTP {r.status_code} {code}: {(msg or r.text[:200])[:200]}"
        ok = 400 <= r.status_code < 500 and r.headers.get("content-type", "").startswith("application/json") and msg
        res.outcome = "rejected_hostile" if ok else "lost"

    async def _generate(self, res: Result, d: Daemon, spec: dict) -> None:
        import httpx

        api, stream, n, pi = spec["api"], spec["stream"], spec["max_tokens"], spec["prompt"]
        body: dict = {"max_tokens": n, "temperature": 0, "stream": stream}
        if api == CHAT:
            body["messages"] = [{"role": "user", "content": self.prompts[pi]}]
        else:
            body["prompt"] = self.prompts[pi] + TEXT_SUFFIX
        if stream:
            body["stream_options"] = {"include_usage": True}
        want = self.refs[(api, pi, n)]
        hang = spec.get("hangup")  # None | ("prefill", delay_s) | ("stream", after_chunks)
        t0 = time.monotonic()
        async with d.client(httpx.Timeout(REQUEST_TIMEOUT_S, connect=10.0)) as c:
            req = c.build_request("POST", api, json=body)
            if hang and hang[0] == "prefill":
                try:
                    r = await asyncio.wait_for(c.send(req, stream=True), hang[1])
                except TimeoutError:
                    res.outcome, res.detail = "hung_up", f"hung up {hang[1]:.2f}s after sending (no answer yet)"
                    return
                # The answer started (or failed) before our deadline: hang up now anyway if it is a stream.
                res.status = r.status_code
                if r.status_code >= 400:
                    _classify_error(res, r.status_code, await r.aread())
                    return
                await r.aclose()
                res.outcome, res.detail = "hung_up", "hung up right after the response headers"
                return
            r = await c.send(req, stream=True)
            try:
                res.status = r.status_code
                res.request_id = r.headers.get("x-request-id")
                if r.status_code >= 400:
                    _classify_error(res, r.status_code, await r.aread())
                    return
                if r.status_code != 200:
                    res.outcome, res.detail = "lost", f"HTTP {r.status_code} {(await r.aread())[:200]!r}"
                    return
                if not stream:
                    raw = await r.aread()
                    try:
                        j = json.loads(raw)
                        choice = j["choices"][0]
                        text = (choice.get("message") or {}).get("content", "") if api == CHAT else choice["text"]
                        finish = choice.get("finish_reason")
                        res.request_id = j.get("id")
                    except (ValueError, KeyError, IndexError, TypeError):
                        res.outcome, res.detail = "lost", f"HTTP 200 with an unreadable body {raw[:200]!r}"
                        return
                else:
                    parts, finish, chunks, data = [], None, 0, []
                    async for line in r.aiter_lines():
                        if line.startswith("data:"):
                            data.append(line[5:].strip())
                            continue
                        if line.strip() or not data:
                            continue
                        payload, data = "\n".join(data), []
                        if payload == "[DONE]":
                            break
                        ev = json.loads(payload)
                        if "error" in ev:
                            _classify_error(res, 200, payload.encode(), in_band=True)
                            return
                        res.request_id = ev.get("id", res.request_id)
                        for ch in ev.get("choices") or []:
                            piece = (ch.get("delta") or {}).get("content") if api == CHAT else ch.get("text")
                            if piece:
                                if res.ttft_s is None:
                                    res.ttft_s = time.monotonic() - t0
                                parts.append(piece)
                                chunks += 1
                            finish = ch.get("finish_reason") or finish
                        if hang and hang[0] == "stream" and chunks >= hang[1] and finish is None:
                            await r.aclose()
                            res.outcome, res.detail = "hung_up", f"hung up after {chunks} streamed chunks"
                            return
                    text = "".join(parts)
            finally:
                await r.aclose()
        if finish not in ("stop", "length"):
            res.outcome, res.detail = "lost", f"ended without a finish_reason after {len(text)} chars: {text[:80]!r}"
            return
        if text == want:
            res.outcome = "completed"
        else:
            res.outcome, res.detail = "mismatched", f"got {text!r} want {want!r}"

    # -- what to send -------------------------------------------------------------------
    def spec(self, rng: random.Random) -> dict:
        x = rng.random()
        if x < self.args.hostile_frac:
            return {"kind": "hostile", "case": rng.choice(sorted(HOSTILE))}
        api = rng.choice((CHAT, TEXT))
        spec = {"kind": "greedy", "api": api, "prompt": rng.randrange(len(self.prompts))}
        if x < self.args.hostile_frac + self.args.hangup_frac:
            mode = rng.choice(("prefill", "stream"))
            spec.update(kind="hangup", stream=True, max_tokens=max(MAX_TOKENS),
                        hangup=(("prefill", rng.uniform(0.02, 0.4)) if mode == "prefill"
                                else ("stream", rng.randint(1, 6))))
            if mode == "prefill" and rng.random() < 0.5:
                spec["stream"] = False  # a plain request whose client goes away before the answer
        else:
            spec.update(stream=rng.random() < 0.5, max_tokens=rng.choice(MAX_TOKENS))
        return spec

    @staticmethod
    def describe(spec: dict) -> str:
        if spec["kind"] == "hostile":
            return f"hostile {spec['case']}"
        api = "chat" if spec["api"] == CHAT else "text"
        s = f"{api} {'stream' if spec['stream'] else 'plain'} {spec['max_tokens']} p{spec['prompt']}"
        if spec.get("hangup"):
            s += f" hangup {spec['hangup'][0]} {spec['hangup'][1]:.2f}"
        return s

    def counts(self) -> dict:
        c = {k: 0 for k in OUTCOMES}
        for r in self.results:
            if r.kind != "warmup":
                c[r.outcome] += 1
        return c

    def progress(self, conc: int) -> None:
        c = self.counts()
        alive = "".join("+" if d.routable else ("." if d.alive() else "x") for d in self.daemons)
        log(f"[{self.done:>5}/{self.args.requests}] {self.rel():7.1f}s  completed {c['completed']}  "
            f"mismatched {c['mismatched']}  failed_clearly {c['failed_clearly']}  hung_up {c['hung_up']}  "
            f"rejected_hostile {c['rejected_hostile']}  coordinator_killed {c['coordinator_killed']}  "
            f"lost {c['lost']}  | concurrency {conc}  daemons {alive}")

    # -- kill / restart -----------------------------------------------------------------
    async def kill_cycle(self, k: int, end: float) -> None:
        victim = self.daemons[1 + (k - 1) % (len(self.daemons) - 1)]  # the non-first members in turn
        inc = victim.incarnation
        victim.routable = False
        t_drain = self.rel()
        drain_end = min(end, time.monotonic() + self.args.drain_s)
        while any(dd is victim for _, dd, _ in self.inflight.values()) and time.monotonic() < drain_end:
            await asyncio.sleep(0.1)
        coordinating = sum(1 for _, dd, _ in self.inflight.values() if dd is victim)
        in_flight = len(self.inflight)
        old_port = (await victim.status() or {}).get("ports", {}).get("transport")
        self.killed.add((victim.name, inc))
        victim.kill()
        ev = {"kill": k, "daemon": victim.name, "incarnation": inc, "at_s": round(self.rel(), 2),
              "drain_s": round(self.rel() - t_drain, 2), "requests_in_flight_at_kill": in_flight,
              "still_coordinating_at_kill": coordinating, "old_port": old_port}
        log(f"  kill #{k}: SIGKILL {victim.name} (incarnation {inc}, port {old_port}) at {ev['at_s']}s with "
            f"{in_flight} requests in flight ({coordinating} coordinated by it)")
        self.events.append(ev)
        await asyncio.sleep(self.args.restart_delay)
        victim.start()
        t_restart = self.rel()
        ev["restarted_at_s"] = round(t_restart, 2)
        try:
            st = await wait_for(f"{victim.name} to serve its API", victim.status,
                                max(1.0, min(90.0, end - time.monotonic())))
            victim.routable = True
            ev["new_port"] = st.get("ports", {}).get("transport")
            ev["api_back_s"] = round(self.rel() - t_restart, 2)
            st = await wait_for("a settled plan made over all daemons again",
                                PlanWatch(self.daemons, self.args.plan_stable_s).settled,
                                max(1.0, min(self.args.rejoin_s, end - time.monotonic())))
            ev["rejoined_s"] = round(self.rel() - t_restart, 2)
            ev["plan_span"] = span_of(st)
            victim.rss_start_mb = victim.rss_mb()
            log(f"  kill #{k}: {victim.name} back on port {ev['new_port']} (was {old_port}); API after "
                f"{ev['api_back_s']}s, in a settled plan again after {ev['rejoined_s']}s "
                f"(it spans {ev['plan_span']} of {len(self.daemons)} members)")
        except TimeoutError as exc:
            ev["rejoin_error"] = str(exc)
            victim.routable = victim.alive()
            log(f"  kill #{k}: {victim.name} did not rejoin: {exc}\n{victim.log_tail(8)}")

    # -- the run ------------------------------------------------------------------------
    async def run(self, end: float) -> None:
        rng = random.Random(self.args.seed)
        tasks: dict[asyncio.Task, Result] = {}
        killer: asyncio.Task | None = None
        k_every = self.args.kill_every
        # no kill in the last quarter-interval: the member must have time to rejoin
        max_kills = max(0, (self.args.requests - 1 - k_every // 4) // k_every) if k_every else 0
        kills_started = 0
        conc, phase_left = 1, 0
        sent = 0
        last_progress = 0

        def reap(task: asyncio.Task) -> None:
            nonlocal last_progress
            tasks.pop(task, None)
            self.done += 1
            if self.done - last_progress >= self.args.progress_every:
                last_progress = self.done
                self.progress(conc)

        self.t_start, self.wall_start = time.monotonic(), time.time()
        while sent < self.args.requests and time.monotonic() < end:
            if phase_left <= 0:
                conc, phase_left = rng.randint(1, self.args.max_concurrency), rng.randint(10, 30)
            kills_due = min(sent // k_every, max_kills) if k_every else 0
            if kills_started < kills_due and (killer is None or killer.done()):
                kills_started += 1
                killer = asyncio.create_task(self.kill_cycle(kills_started, end))
            while len(tasks) >= conc:
                await asyncio.wait(list(tasks), timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
                if time.monotonic() >= end:
                    break
            targets = [d for d in self.daemons if d.routable and d.alive()]
            if not targets:
                await asyncio.sleep(0.2)
                continue
            spec = self.spec(rng)
            d = rng.choice(targets)
            res = Result(sent, spec["kind"], d.name, d.incarnation, self.describe(spec))
            self.results.append(res)
            self.inflight[sent] = (res, d, d.incarnation)
            task = asyncio.create_task(self.one(res, d, spec))
            tasks[task] = res
            task.add_done_callback(reap)
            sent += 1
            phase_left -= 1
        while tasks and time.monotonic() < end:
            await asyncio.wait(list(tasks), timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
        left = dict(tasks)
        for t in left:  # past the global deadline
            t.cancel()
        await asyncio.gather(*left, return_exceptions=True)
        for r in left.values():
            r.outcome, r.detail = "unfinished", "cancelled at the global deadline"
        self.elapsed = self.rel()
        if self.done != last_progress:
            self.progress(conc)
        if killer is not None and not killer.done():
            log("  waiting for the last restarted member to rejoin ...")
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait_for(killer, max(1.0, end - time.monotonic()))


# --------------------------------------------------------------------------- diagnostics


def _ts(line: dict) -> float | None:
    try:
        return dt.datetime.fromisoformat(line["timestamp"].replace("Z", "+00:00")).timestamp()
    except (KeyError, ValueError, AttributeError):
        return None


def _events(d: Daemon) -> list[tuple[float | None, dict, str]]:
    out = []
    try:
        lines = d.log.read_text(errors="replace").splitlines()
    except OSError:
        return out
    for raw in lines:
        try:
            ev = json.loads(raw)
        except ValueError:
            continue
        if isinstance(ev, dict):
            out.append((_ts(ev), ev, raw))
    return out


# info-level events that explain what happened to a request
_TELLING = {"request_cancelled", "request_done", "request_replaying", "free_unreachable", "link_redialled",
            "api_internal_error", "api_request_rejected", "member_state", "replan", "plan_adopted"}


def diagnose(soak: Soak, limit: int = 10) -> list[str]:
    """For each lost / mismatched request: what we saw, and the daemons' log lines about it.

    A request that died before its response headers has no id on our side; the
    daemon's own ``request_done`` / ``request_cancelled`` line that ended within
    0.5 s of the moment we saw it end names it, and all lines with that id follow.
    """
    out = []
    logs = {d.name: _events(d) for d in soak.daemons}
    bad = [r for r in soak.results if r.outcome in ("lost", "mismatched", "unfinished")]
    for r in bad[:limit]:
        out.append(f"request #{r.idx} [{r.outcome}] {r.what} -> {r.daemon} (incarnation {r.incarnation}), "
                   f"status {r.status}, sent at +{r.t0 - soak.wall_start:.2f}s, ended after {r.latency_s or 0:.2f}s, "
                   f"id {r.request_id}: {r.detail[:400]}")
        ids = {r.request_id} if r.request_id else set()
        if not ids:
            for t, ev, _ in logs.get(r.daemon, []):
                if (ev.get("event") in ("request_cancelled", "request_done") and t is not None
                        and abs(t - r.t1) < 0.5 and ev.get("request_id")):
                    ids.add(ev["request_id"])
            if ids:
                out.append(f"    daemon-side id (ended within 0.5 s of our end): {sorted(ids)}")
        for name, evs in logs.items():
            hits = []
            for t, ev, raw in evs:
                mine = ev.get("request_id") in ids
                near = (t is not None and r.t0 - 1 <= t <= (r.t1 or r.t0) + 1
                        and (ev.get("level") in ("warning", "error", "critical") or ev.get("event") in _TELLING)
                        and ev.get("event") not in ("request_done", "api_request_rejected"))
                if mine or near:
                    hits.append(f"+{(t or 0) - soak.wall_start:.2f}s {raw[:360]}")
            for h in hits[-14:]:
                out.append(f"    {name}: {h}")
    return out


# --------------------------------------------------------------------------- main


def pctl(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


async def main_async(args, root: Path, daemons: list[Daemon], t_begin: float) -> dict:
    end = t_begin + args.deadline_s
    model = args.model
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    prompts = load_prompts(N_PROMPTS)
    setup = machine_banner() | {
        "model": Path(model).name, "daemons": 3, "threads_per_daemon": 1,
        "daemon_cores": {f"soak-{i}": cores[i % len(cores)] for i in range(3)},
        "pinning": "sched_setaffinity in the child (as meshd demo), OMP_NUM_THREADS=1",
        "membership_flags": " ".join(FAST), "requests": args.requests, "seed": args.seed,
        "max_concurrency": args.max_concurrency, "kill_every": args.kill_every,
        "kill_order": "soak-1, soak-2, soak-1, ... (SIGKILL; restart from the same state dir with --port 0)",
        "restart_delay_s": args.restart_delay, "hangup_frac": args.hangup_frac, "hostile_frac": args.hostile_frac,
        "max_tokens": list(MAX_TOKENS), "prompts": len(prompts), "request_timeout_s": REQUEST_TIMEOUT_S,
        "prompt_cache": "on, as deployed: prompts repeat over the soak, so its TTFTs mix cold and warm requests "
                        "(a stability figure, not a prefill one)",
        "deadline_s": args.deadline_s, "hostile_cases": sorted(HOSTILE),
        "memory_budget_mb": args.memory_budget_mb or "the daemon's default", "plan_stable_s": args.plan_stable_s,
    }
    log("setup: " + json.dumps(setup))
    t = time.monotonic()
    refs = await asyncio.to_thread(references, model, prompts)
    log(f"references: {len(refs)} greedy texts from {2 * len(prompts)} single-device generations "
        f"in {time.monotonic() - t:.1f}s")

    for i in range(3):
        daemons.append(Daemon(root, i, cores[i % len(cores)], model, args.memory_budget_mb))
    t = time.monotonic()
    daemons[0].start(["--new-home", "soak"])
    await wait_for("soak-0 to serve its API", daemons[0].status, min(120, end - time.monotonic()))
    for d in daemons[1:]:
        token = await asyncio.to_thread(invite, daemons[0])
        d.start(["--token", token])
    for d in daemons[1:]:
        await wait_for(f"{d.name} to pair and serve", d.status, min(120, end - time.monotonic()))
    st = await wait_for("the plan the planner decides, over the 3 daemons, to settle",
                        PlanWatch(daemons, args.plan_stable_s).settled, min(180, end - time.monotonic()))
    names = {m["node_id"]: m["name"] for m in st.get("members", [])}
    layout = [f"{names.get(s['node_id'], s['node_id'])} layers {s['layers'][0]}-{s['layers'][1] - 1}"
              for s in st["plan"]["stages"]]
    setup["plan"] = layout
    setup["plan_span"] = span_of(st)
    setup["plan_reason"] = st["plan"].get("reason")
    setup["daemon_affinity"] = {d.name: d.affinity() for d in daemons}
    log(f"mesh up in {time.monotonic() - t:.1f}s: plan v{st['plan']['version']} spans {setup['plan_span']} of "
        f"{len(daemons)} members: {', '.join(layout)} ({setup['plan_reason']}); affinity {setup['daemon_affinity']}")
    for d in daemons:
        d.ports.append((await d.status() or {}).get("ports", {}).get("transport"))
        d.routable = True

    soak = Soak(args, daemons, refs, prompts)
    # warm-up: one greedy request through each daemon (not counted), then the RSS baseline
    warm = []
    for d in daemons:
        res = Result(-1, "warmup", d.name, d.incarnation, "warm-up chat plain 8 p0")
        await soak.one(res, d, {"kind": "greedy", "api": CHAT, "stream": False, "max_tokens": 8, "prompt": 0})
        warm.append(f"{d.name}: {res.outcome} {res.latency_s:.2f}s" + (f" ({res.detail})" if res.detail else ""))
        soak.results.append(res)
    for d in daemons:
        d.rss_start_mb = d.rss_mb()
    rss_first = {d.name: d.rss_start_mb for d in daemons}
    log("warm-up: " + "; ".join(warm) + f"; RSS MB {json.dumps({k: round(v or 0, 1) for k, v in rss_first.items()})}")

    log(f"sending {args.requests} requests ...")
    await soak.run(end - args.tail_s)

    # -- after the run: KV freed?
    t = time.monotonic()
    kv_end = min(end, time.monotonic() + 30)
    statuses: list = []
    while True:
        statuses = await asyncio.gather(*(d.status() for d in daemons))
        stages = [(s or {}).get("stage") for s in statuses]
        if all(s is not None for s in statuses) and all(st is not None and st.get("kv_tokens_in_use") == 0
                                                        for st in stages):
            break
        if time.monotonic() >= kv_end:
            break
        await asyncio.sleep(0.5)
    kv_wait = time.monotonic() - t
    stages = [(s or {}).get("stage") for s in statuses]
    has_stage = any(st is not None for st in stages)
    kv = sum((st or {}).get("kv_tokens_in_use", 0) for st in stages) if has_stage else None
    seqs = sum((st or {}).get("sequences", 0) for st in stages) if has_stage else None
    per_daemon = []
    growth = []
    for d, s, stg in zip(daemons, statuses, stages):
        rss_end = d.rss_mb()
        g = None if rss_end is None or d.rss_start_mb is None else rss_end - d.rss_start_mb
        if g is not None:
            growth.append(g)
        per_daemon.append({"daemon": d.name, "incarnations": d.incarnation, "core": d.core,
                           "status": "up" if s else "no status",
                           "kv_tokens_in_use": (stg or {}).get("kv_tokens_in_use"),
                           "sequences": (stg or {}).get("sequences"), "rss_start_mb": d.rss_start_mb,
                           "rss_end_mb": rss_end, "rss_growth_mb": g,
                           "requests_replayed": sum(d.replayed.values()) if d.replayed else None})
    replayed = (sum(sum(d.replayed.values()) for d in daemons) if any(d.replayed for d in daemons) else None)

    c = soak.counts()
    runs = [r for r in soak.results if r.kind != "warmup"]
    lat = [r.latency_s for r in runs if r.outcome == "completed"]
    ttft = [r.ttft_s for r in runs if r.outcome == "completed" and r.ttft_s is not None]
    restarts = sum(1 for e in soak.events if "restarted_at_s" in e)
    rejoined = [e["rejoined_s"] for e in soak.events if "rejoined_s" in e]
    failed = {}
    for r in runs:
        if r.outcome == "failed_clearly":
            key = r.detail.split(":")[0]
            failed[key] = failed.get(key, 0) + 1
    by_kind: dict[str, int] = {}
    for r in runs:
        by_kind[r.kind] = by_kind.get(r.kind, 0) + 1
    summary = {
        "requests": len(runs), "sent_by_kind": by_kind, **c, "kv_tokens_in_use": kv, "sequences": seqs,
        "kv_wait_s": round(kv_wait, 2),
        "rss_growth_mb": round(max(growth), 1) if growth else None,
        "rss_growth_rule": "max over daemons of end RSS - RSS of the same process after warm-up "
                           "(restarted members: after they rejoined the plan)",
        "p50_s": pctl(lat, 0.5), "p99_s": pctl(lat, 0.99),
        "ttft_p50_s": pctl(ttft, 0.5), "ttft_p99_s": pctl(ttft, 0.99),
        "requests_per_s": len(runs) / soak.elapsed if soak.elapsed else None,
        "elapsed_s": round(soak.elapsed, 1), "kills": len(soak.events), "restarts": restarts,
        "rejoin_s": rejoined, "requests_replayed": replayed,
        "plan_span": setup.get("plan_span"), "plan": setup.get("plan"),
        "failed_clearly_by_reason": failed, "per_daemon": per_daemon, "kill_events": soak.events,
        "setup": setup,
    }
    summary["diagnosis"] = diagnose(soak)
    summary["lost_detail"] = [vars(r) for r in runs if r.outcome in ("lost", "mismatched", "unfinished")][:20]
    return summary


def print_summary(s: dict) -> None:
    def f(x, fmt="{:.3f}"):
        return "n/a" if x is None else fmt.format(x)

    log("\nsummary")
    rows = [
        ("requests", f"{s['requests']} {json.dumps(s['sent_by_kind'])} (a hang-up whose answer "
                     "ended first is judged as a normal request)"), ("completed (= reference)", s["completed"]),
        ("mismatched", s["mismatched"]), ("failed_clearly", s["failed_clearly"]),
        ("hung_up (ours)", s["hung_up"]), ("rejected_hostile (4xx)", s["rejected_hostile"]),
        ("coordinator_killed", s["coordinator_killed"]), ("lost", s["lost"]), ("unfinished", s["unfinished"]),
        ("kills / restarts", f"{s['kills']} / {s['restarts']} (rejoined after {s['rejoin_s']} s)"),
        ("plan span", f"{s['plan_span']} of 3 members ({'; '.join(s['plan'] or [])})"),
        ("requests_replayed", s["requests_replayed"]),
        ("kv_tokens_in_use after run", f"{s['kv_tokens_in_use']} (sequences {s['sequences']}, "
                                       f"waited {s['kv_wait_s']}s)"),
        ("rss_growth_mb (max)", s["rss_growth_mb"]),
        ("latency p50 / p99", f"{f(s['p50_s'])} s / {f(s['p99_s'])} s"),
        ("TTFT p50 / p99 (streams)", f"{f(s['ttft_p50_s'])} s / {f(s['ttft_p99_s'])} s"),
        ("requests/s", f(s["requests_per_s"], "{:.2f}")), ("elapsed", f"{s['elapsed_s']} s"),
    ]
    w = max(len(k) for k, _ in rows)
    for k, v in rows:
        log(f"  {k:<{w}}  {v}")
    if s["failed_clearly_by_reason"]:
        log("  failed_clearly by reason: " + json.dumps(s["failed_clearly_by_reason"]))
    for d in s["per_daemon"]:
        log(f"  {d['daemon']}: core {d['core']}, {d['incarnations']} incarnation(s), kv {d['kv_tokens_in_use']}, "
            f"sequences {d['sequences']}, RSS {f(d['rss_start_mb'], '{:.1f}')} -> {f(d['rss_end_mb'], '{:.1f}')} MB, "
            f"replayed {d['requests_replayed']}")
    if s["diagnosis"]:
        log("\nlost / mismatched requests:")
        for line in s["diagnosis"]:
            log("  " + line)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--quick", action="store_true", help="100 requests, 2 kills, within 5 minutes")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kill-every", type=int, default=100,
                    help="SIGKILL + restart a member every N requests (0: never)")
    ap.add_argument("--restart-delay", type=float, default=1.0, help="seconds between a kill and the restart")
    ap.add_argument("--drain-s", type=float, default=20.0,
                    help="before a kill, wait up to this long for the victim's own requests to finish")
    ap.add_argument("--rejoin-s", type=float, default=120.0, help="deadline for a restarted member to be in the plan")
    ap.add_argument("--memory-budget-mb", type=int, default=120,
                    help="each daemon's memory budget (default 120, half the model as the daemon tests give it, "
                         "so the home must split and kills hit members holding layers; 0: the daemon's default)")
    ap.add_argument("--plan-stable-s", type=float, default=3.0,
                    help="a plan counts as the planner's decision once unchanged this long (all ready, all loaded)")
    ap.add_argument("--max-concurrency", type=int, default=8)
    ap.add_argument("--hangup-frac", type=float, default=0.10)
    ap.add_argument("--hostile-frac", type=float, default=0.05)
    ap.add_argument("--deadline-min", type=float, default=None, help="global deadline (default 60, --quick 5)")
    ap.add_argument("--progress-every", type=int, default=25)
    ap.add_argument("--model", default=None, help="model path (default: the embedded SmolLM2-135M)")
    ap.add_argument("--keep", action="store_true", help="keep the state dirs and daemon logs")
    args = ap.parse_args()
    if args.quick:
        args.requests = 100 if args.requests == 1000 else args.requests
        args.kill_every = 35 if args.kill_every == 100 else args.kill_every
    args.deadline_s = 60 * (args.deadline_min or (5.0 if args.quick else 60.0))
    args.tail_s = 45.0  # left for the KV check and stopping the daemons
    from meshd.model.store import resolve_model

    args.model = str(resolve_model(args.model))

    t_begin = time.monotonic()
    root = Path(tempfile.mkdtemp(prefix="meshd-soak-"))
    daemons: list[Daemon] = []
    summary = None
    rc = 1

    def on_term(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    # Ctrl-C stops the daemons too, even when started with SIGINT ignored (a background job)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        summary = asyncio.run(main_async(args, root, daemons, t_begin))
        print_summary(summary)
        rc = 0 if (summary["lost"] == 0 and summary["mismatched"] == 0 and summary["unfinished"] == 0
                   and not summary["kv_tokens_in_use"]) else 1
    except KeyboardInterrupt:
        log("interrupted")
        rc = 130
    except Exception as exc:  # noqa: BLE001 - reported, daemons still stopped
        log(f"soak failed: {type(exc).__name__}: {exc}")
        for d in daemons:
            log(f"--- {d.name} log tail ---\n{d.log_tail(15)}")
        rc = 2
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        codes = stop_all(daemons)
        log(f"stopped {len(daemons)} daemons (exit codes {codes})")
        if args.keep:
            log(f"state dirs and logs kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if summary is not None:
        summary["exit_code"] = rc
        summary["daemon_exit_codes"] = codes
        if args.json:
            emit_json(summary)
    return rc


if __name__ == "__main__":
    sys.exit(main())
