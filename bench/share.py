"""Model sharing over the LAN: how soon a new device serves when it gets its layers from the home.

Per link setting, real daemons (`meshd join`):

  holders  alpha (and, without --quick, gamma) run the model from a local file: a warm home
  joiner   beta: empty MESHD_HOME, the package index unreachable (index URL and proxies point at a
           closed port); fetches over the home's CURVE links, then serves its layers
  runs     layers  beta fetches only its layer range (+ header, embedding/head where its stage needs them)
           whole   a fresh beta fetches the whole file first (what a download-then-serve tool does)
           capped  (not --quick) layers again with --share-rate at 40% of the link
  meanwhile a client streams greedy answers from alpha: per-token gaps and TTFT before beta
  starts (baseline) vs while beta fetches.

Reported per run: time from spawning beta to "ready in a warm plan that gives it layers" (and its
parts from beta's log: header, fetch, load and warm-up), bytes moved / file size vs the share its
layer range occupies, from whom, parity of beta's answers with a single-device reference, and
for shaped links the transfer alone (bytes / measured TCP rate) to compare with.

Links: --quick runs on loopback only (<= 5 min); otherwise 1gbit,1ms and 100mbit,4ms in testbed
namespaces (root; rate by tc tbf). The testbed adds RTT only through its delay proxy, which the
daemons' mDNS-found links do not cross: daemon links get the rate, not the RTT (see RESULTS).

    python bench/share.py [--quick] [--links 1gbit,1ms 100mbit,4ms] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DEAD = "http://127.0.0.1:9"
FAST = ["--heartbeat-interval", "0.3", "--suspect-after", "1.5", "--gone-after", "3.0"]
# Every daemon's memory budget (--memory-budget-mb; default half the model, as the daemon tests give):
# the planner leaves out a member that would not make a prompt faster, which on a busy 2-core machine
# can be the joiner, and then there is no layer range to measure. With the budget a home must split.
BUDGET: list[str] = []
PROMPTS = ["What is the capital of France?", "Name three colours of the rainbow.",
           "How many legs does a spider have?"]
PARITY_TOKENS = 24
LOAD_PROMPT = "Write a short story about a lighthouse keeper and a storm."
LOAD_TOKENS = 48


def log(msg: str) -> None:
    print(msg, flush=True)


def no_index_env(home: Path) -> dict:
    return {"MESHD_HOME": str(home), "PIP_INDEX_URL": DEAD + "/simple", "PIP_EXTRA_INDEX_URL": "",
            "HTTP_PROXY": DEAD, "HTTPS_PROXY": DEAD, "http_proxy": DEAD, "https_proxy": DEAD,
            "ALL_PROXY": DEAD, "NO_PROXY": "", "no_proxy": ""}


def _ts(text: str) -> float:
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


# --------------------------------------------------------------------------- daemons


SPAWNED: list["Daemon"] = []
FAILED: list[str] = []  # runs that never reached a warm plan (their logs are kept)


class Daemon:
    def __init__(self, root: Path, name: str, host: int, core: int, args: list[str], env: dict, tb=None):
        self.name, self.host, self.core, self.args, self.tb = name, host, core, args, tb
        self.dir = root / name
        self.dir.mkdir(parents=True)
        self.state, self.socket, self.log = self.dir / "state", self.dir / "api.sock", self.dir / "daemon.log"
        base = {k: v for k, v in os.environ.items() if not k.startswith("MESHD_") and "proxy" not in k.lower()}
        base.update(OMP_NUM_THREADS="1", MESHD_REPLAN_DEBOUNCE_S="0.5", MESHD_DRAIN_TIMEOUT_S="2")
        base["PYTHONPATH"] = str(ROOT) + os.pathsep + base.get("PYTHONPATH", "")
        base.update(env)
        self.env = base
        self.proc: subprocess.Popen | None = None
        self.started_at = 0.0
        SPAWNED.append(self)

    def start(self, first: list[str] | None = None, id_prefix: str = "") -> "Daemon":
        """``id_prefix``: pre-set the node id's first hex digits (the lowest ready id leads the home)."""
        if id_prefix and not (self.state / "node_id").exists():
            import secrets

            self.state.mkdir(parents=True, exist_ok=True, mode=0o700)
            (self.state / "node_id").write_text(id_prefix + secrets.token_hex(8)[len(id_prefix):] + "\n")
        iface = ["--interface", "eth0"] if self.tb is not None and self.tb.mode == "netns" else [
            "--interface", "127.0.0.1", "--listen", "127.0.0.1"]
        cmd = [sys.executable, "-m", "meshd", "join", "--state-dir", str(self.state), "--socket", str(self.socket),
               "--name", self.name, "--port", "0", "--pairing-port", "0", *iface, *FAST, *BUDGET, *self.args, *(first or [])]
        out = open(self.log, "ab")
        self.started_at = time.time()
        if self.tb is not None and self.tb.mode == "netns":
            self.proc = self.tb.host(self.host).popen(cmd, cores=[self.core], env=self.env, stdout=out,
                                                      stderr=subprocess.STDOUT, cwd=ROOT)
        else:
            core = self.core

            def pin():
                os.sched_setaffinity(0, {core % (os.cpu_count() or 1)})
            self.proc = subprocess.Popen(cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                         preexec_fn=pin, start_new_session=True)
        return self

    def status(self) -> dict | None:
        from meshd.client import MeshdClient

        if self.proc is None or self.proc.poll() is not None:
            return None
        try:
            return MeshdClient(self.socket, timeout=5.0).status()
        except Exception:  # noqa: BLE001 - not up yet
            return None

    def node_id(self) -> str:
        return (self.state / "node_id").read_text().strip()

    def events(self) -> list[dict]:
        out = []
        for line in self.log.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
        return out

    def stop(self, timeout: float = 20.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(OSError):
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)

    def tail(self, n: int = 20) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])


def invite(member: Daemon) -> str:
    out = subprocess.run([sys.executable, "-m", "meshd", "invite", "--state-dir", str(member.state), "--json"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    if out.returncode != 0:
        raise RuntimeError(f"meshd invite failed: {out.stderr.strip()[-500:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["token"]


def wait(what: str, cond, timeout: float, interval: float = 0.1, explain=None):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = cond()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}" + (f"\n{explain()}" if explain else ""))


def warm_plan(daemons: list[Daemon]) -> dict | None:
    """Every daemon ready, on one plan whose stages are exactly these daemons."""
    sts = [d.status() for d in daemons]
    if any(s is None or not s.get("ready") for s in sts):
        return None
    ids = {d.node_id() for d in daemons}
    plans = [s.get("plan") or {} for s in sts]
    if len({p.get("version") for p in plans}) != 1 or {st["node_id"] for st in plans[0].get("stages", [])} != ids:
        return None
    return sts[0]


# --------------------------------------------------------------------------- load on alpha


class Streamer:
    """Streams greedy answers from one daemon in a loop; keeps every token's arrival time."""

    def __init__(self, daemon: Daemon):
        self.daemon = daemon
        self.requests: list[dict] = []
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> "Streamer":
        self.thread.start()
        return self

    def _run(self) -> None:
        from meshd.client import MeshdClient

        while not self._stop.is_set():
            t0 = time.time()
            stamps, err = [], None
            try:
                for _ in MeshdClient(self.daemon.socket, timeout=120).chat(
                        LOAD_PROMPT, stream=True, max_tokens=LOAD_TOKENS, temperature=0):
                    stamps.append(time.time())
            except Exception as exc:  # noqa: BLE001 - recorded
                err = f"{type(exc).__name__}: {exc}"
                time.sleep(0.2)
            self.requests.append({"start": t0, "stamps": stamps, "error": err})

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(180)

    def window(self, t0: float, t1: float) -> dict:
        """Token gaps falling in [t0, t1] and TTFTs of requests started in it."""
        gaps, ttfts, errors = [], [], 0
        for r in self.requests:
            s = r["stamps"]
            if r["error"] and t0 <= r["start"] <= t1:
                errors += 1
            if s and t0 <= r["start"] <= t1:
                ttfts.append(s[0] - r["start"])
            for a, b in zip(s, s[1:]):
                if t0 <= a and b <= t1:
                    gaps.append(b - a)
        return summarise(gaps, ttfts, errors)


def summarise(gaps: list[float], ttfts: list[float], errors: int = 0) -> dict:
    def pct(xs, q):
        return round(sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] * 1000, 1) if xs else None
    return {"token_gaps": len(gaps), "gap_ms_p50": pct(gaps, 0.5), "gap_ms_p90": pct(gaps, 0.9),
            "gap_ms_max": round(max(gaps) * 1000, 1) if gaps else None,
            "requests": len(ttfts), "ttft_ms_p50": pct(ttfts, 0.5), "errors": errors}


# --------------------------------------------------------------------------- one joiner run


def beta_timeline(beta: Daemon, node_id: str) -> dict:
    """Seconds after spawning beta: header in, its fetch started/done, model ready, plan with it warm."""
    out: dict[str, float] = {}
    t0 = beta.started_at
    for e in beta.events():
        ev, ts = e.get("event"), e.get("timestamp")
        if not ts:
            continue
        t = _ts(ts) - t0
        if ev == "share_fetch_done" and "header_s" not in out and e.get("target") == "all" \
                and e.get("fetched_bytes", 0) < 8 << 20:
            out["header_s"] = t
        elif ev == "share_fetch_started" and (e.get("target") != "all" or e.get("wanted_bytes", 0) >= 8 << 20):
            out.setdefault("fetch_start_s", t)
        elif ev == "share_fetch_done" and (e.get("target") != "all" or e.get("fetched_bytes", 0) >= 8 << 20):
            out["fetch_done_s"] = t
        elif ev == "model_ready":
            out.setdefault("model_ready_s", t)
        elif ev == "stage_loaded":
            out["stage_loaded_s"] = t
        elif ev == "pipeline_warm":
            out["warm_s"] = t
    return {k: round(v, 2) for k, v in out.items()}


def expected_fraction(manifest, first: int, end: int) -> float:
    from meshd.share import manifest as mf

    needed = mf.needed_tensors(manifest.tensor_names, manifest.num_layers, first, end)
    return manifest.bytes_of([*manifest.header.piece_range, *manifest.pieces_of(needed)]) / manifest.size


FRACTION_SLACK = 0.001  # the manifest and message framing (0.05 % of the file in every run so far)


def timed_layer(beta: Daemon, manifest, first: int, end: int) -> tuple[int, float] | None:
    """(layer, share of the file) fetched only so beta could time itself, when outside its range.

    A daemon with no profile of its model times one middle decoder layer before it counts as loaded
    (``meshd.model.self_profile``); a joiner fetches that layer for it, before any plan gives it a range.
    """
    if not any(e.get("event") == "self_profile_measured" for e in beta.events()):
        return None
    from meshd.share import manifest as mf

    mid = manifest.num_layers // 2
    if first <= mid < end:
        return None
    ours = set(manifest.pieces_of(mf.needed_tensors(manifest.tensor_names, manifest.num_layers, first, end)))
    timed = set(manifest.pieces_of(mf.needed_tensors(manifest.tensor_names, manifest.num_layers, mid, mid + 1)))
    return mid, manifest.bytes_of(timed - ours) / manifest.size


def join_run(label: str, root: Path, holders: list[Daemon], tb, host: int, core: int, extra: list[str],
             env_extra: dict, manifest, reference: dict, streamer: Streamer | None, link_rate_bps: float | None,
             control_window=None) -> dict:
    """One joiner, from spawn to serving its layers, then stopped. ``label`` "local": a control joiner
    that has the file already (its window for alpha's latency is ``control_window``, the layers run's)."""
    n = sum(1 for d in SPAWNED if d.name.startswith(f"beta-{label}"))
    home = root / f"{label}-{n}-meshd-home"
    beta = Daemon(root, f"beta-{label}-{n}", host, core, ["--model", "", *extra] if label != "local" else extra,
                  {**no_index_env(home), **env_extra}, tb)
    beta.start(["--token", invite(holders[0])], id_prefix="f")  # joins as a follower: alpha keeps leading
    bid = wait("beta's node id", lambda: beta.state.joinpath("node_id").exists() and beta.node_id(), 60)
    log(f"  [{label}] beta {bid} spawned")
    try:
        final = wait(f"[{label}] a warm plan with beta", lambda: warm_plan([*holders, beta]), 240, 0.1)
    except TimeoutError:
        FAILED.append(label)
        log(f"  [{label}] FAILED: no warm plan with beta within 240 s; beta status: "
            f"{json.dumps((beta.status() or {}).get('plan'))}; alpha: {json.dumps((holders[0].status() or {}).get('plan'))}")
        beta.stop()
        wait(f"[{label}] the home back without beta", lambda: warm_plan(holders), 120, 0.2)
        return {"failed": "no warm plan with beta within 240 s", "parity": False, "layers": [0, 0],
                "time_to_ready_s": None, "bytes_moved": 0, "fraction_moved": None, "fraction_expected": None,
                "package_index_used": False}
    t_ready = time.time() - beta.started_at
    sh = final and (beta.status() or {}).get("sharing") or {}
    stages = {s["node_id"]: tuple(s["layers"]) for s in final["plan"]["stages"]}
    first, end = stages[bid]
    tl = beta_timeline(beta, bid)
    fetch = sh.get("fetch") or {}
    moved = fetch.get("bytes_moved", 0)
    local = label == "local"
    res = {
        "layers": [first, end], "stages": {n: list(r) for n, r in stages.items()},
        "time_to_ready_s": round(t_ready, 2), "timeline_s": tl,
        "bytes_moved": moved, "piece_bytes": fetch.get("fetched_bytes_total"),
        "fraction_moved": round(moved / manifest.size, 4),
        "fraction_expected": round(0.0 if local else 1.0 if "whole" in json.dumps(env_extra) else
                                   expected_fraction(manifest, first, end), 4),
        # a layer-range fetch of every layer is the whole file: never silent (logged by beta, counted here)
        "every_layer_fetches": fetch.get("every_layer_fetches", 0),
        "every_layer_events": [{k: e.get(k) for k in ("asked_by", "timestamp")} for e in beta.events()
                               if e.get("event") == "share_fetch_every_layer"],
        "held_fraction": (sh.get("holds") or {}).get("fraction"),
        "by_holder_bytes": fetch.get("by_holder_total"),
        "fetch_rate_mbit": fetch.get("rate_mbit"),
        "corrupt_pieces": fetch.get("corrupt_pieces", 0),
    }
    if "fetch_start_s" in tl and "fetch_done_s" in tl:
        res["fetch_s"] = round(tl["fetch_done_s"] - tl["fetch_start_s"], 2)
    if link_rate_bps and not local:
        res["transfer_alone_s"] = round(moved * 8 / link_rate_bps, 2)
        res["ready_over_transfer"] = round(t_ready / res["transfer_alone_s"], 2)
        if "fetch_s" in res:
            res["fetch_over_transfer"] = round(res["fetch_s"] / res["transfer_alone_s"], 2)
    window = (tl.get("fetch_start_s"), tl.get("fetch_done_s")) if not local else tuple(control_window or ())
    if streamer is not None and len(window) == 2 and None not in window:
        w0, w1 = beta.started_at + window[0], beta.started_at + window[1]
        res["load_during_fetch"] = streamer.window(w0, w1)
        res["load_requests"] = [  # compact raw record: start, tokens, first/last token time (s after beta spawned)
            [round(r["start"] - beta.started_at, 2), len(r["stamps"]),
             round(r["stamps"][0] - beta.started_at, 2) if r["stamps"] else None,
             round(r["stamps"][-1] - beta.started_at, 2) if r["stamps"] else None, r["error"]]
            for r in streamer.requests if r["start"] <= w1 + 5 and (r["stamps"] or [r["start"]])[-1] >= w0 - 5]
    # parity: beta coordinates, every stage runs the layers it got
    from meshd.client import MeshdClient

    got = {q: MeshdClient(beta.socket, timeout=240).chat(q, max_tokens=PARITY_TOKENS, temperature=0).text
           for q in PROMPTS}
    res["parity"] = all(got[q] == reference[q] for q in PROMPTS)
    res["parity_detail"] = {q: got[q] == reference[q] for q in PROMPTS}
    events = [e.get("event") for e in beta.events()]
    res["package_index_used"] = "model_pull_download" in events or (home / "models").exists()
    res["control_window"] = [tl.get("fetch_start_s"), tl.get("fetch_done_s")]
    timed = timed_layer(beta, manifest, first, end) if not local and "whole" not in json.dumps(env_extra) else None
    if timed is not None:  # beta timed itself on a layer outside its range (self-profile): fetched for that
        res["self_profile_layer"] = timed[0]
        res["fraction_expected_with_timed_layer"] = round(res["fraction_expected"] + timed[1], 4)
    want = res.get("fraction_expected_with_timed_layer", res["fraction_expected"])
    res["fraction_ok"] = local or abs(res["fraction_moved"] - want) <= FRACTION_SLACK
    extra = (f" + layer {res['self_profile_layer']} it timed itself on = "
             f"{res['fraction_expected_with_timed_layer']:.3f}" if "self_profile_layer" in res else "")
    log(f"  [{label}] beta layers [{first}, {end}) ready in {t_ready:.1f} s (timeline {tl}); moved "
        f"{moved / 1e6:.1f} MB = {res['fraction_moved']:.3f} of the file (expected {res['fraction_expected']:.3f}"
        f"{extra}; {'ok' if res['fraction_ok'] else 'NOT its share'}); every-layer fetches "
        f"{res['every_layer_fetches']}; by holder {res['by_holder_bytes']}; parity {res['parity']}")
    beta.stop()
    wait(f"[{label}] the home back without beta", lambda: warm_plan(holders), 120, 0.2)
    if streamer is not None:  # and alpha's client streaming normally again (a re-plan pauses its request)
        back = time.time()
        wait("alpha's client back to normal", lambda: any(r["start"] > back and r["stamps"] and not r["error"]
                                                          for r in streamer.requests), 120, 0.2)
    return res


# --------------------------------------------------------------------------- one link setting


def references(model: Path) -> dict:
    import torch

    from decoding.device import served_reference_stage
    from decoding.generate import generate
    from decoding.pipeline_local import LocalPipeline
    from meshd.model.store import open_model

    torch.set_num_threads(1)  # as the daemons
    src = open_model(model)
    stage = served_reference_stage(src)  # the daemons' numeric mode (--weights auto), not float32
    tok = src.tokenizer
    return {q: generate(LocalPipeline([stage]), tok.apply_chat([{"role": "user", "content": q}]), PARITY_TOKENS,
                        eos_ids=tok.eos_ids, tokenizer=tok).text for q in PROMPTS}


def link_rate(tb) -> float | None:
    """Measured TCP bulk rate host 0 -> host 2 (bits/s), the 'transfer alone' yardstick."""
    if tb is None or tb.mode != "netns" or not tb.link.rate_bps:
        return None
    server, port = tb.probe_server(2)
    res = tb.probe(0, "bulk", (tb.host(2).ip, port), bytes=int(tb.link.rate_bps / 8 * 3), max_seconds=4)
    tb._kill(server)
    return res["mbit_s"] * 1e6


def run_link(spec: str, quick: bool, model: Path, manifest, reference: dict, which: list[str], reps: int = 1
             ) -> dict:
    root = Path(tempfile.mkdtemp(prefix="meshd-bshare-"))
    tb = None
    t_link = time.monotonic()
    try:
        if spec != "loopback":
            from bench.testbed import LinkSpec, Testbed

            tb = Testbed(3, LinkSpec.parse(spec), name_prefix="meshd-bs", mode="netns").start()
        rate = link_rate(tb)
        if rate:
            log(f"[{spec}] measured TCP rate host0 -> host2: {rate / 1e6:.1f} Mbit/s")
        alpha = Daemon(root, "alpha", 0, 0, ["--model", str(model)], {}, tb).start(["--new-home", "bench-share"], id_prefix="0a")
        wait("alpha serving", lambda: warm_plan([alpha]), 180, 0.2, explain=alpha.tail)
        holders = [alpha]
        if not quick:
            gamma = Daemon(root, "gamma", 1, 1, ["--model", str(model)], {}, tb).start(["--token", invite(alpha)], id_prefix="0b")
            holders.append(gamma)
            wait("alpha + gamma warm", lambda: warm_plan(holders), 180, 0.2, explain=gamma.tail)
        log(f"[{spec}] home warm: {[h.name for h in holders]}")
        streamer = Streamer(alpha).start()
        time.sleep(6 if quick else 10)
        baseline = streamer.window(0, time.time())
        log(f"[{spec}] baseline at alpha: {baseline}")
        runs = {}
        cap = 0.4 * (rate or 500e6)
        plans = {  # label -> (extra args, extra env); beta shares core 1 with gamma (2-core machine)
            "layers": ([], {}), "whole": ([], {"MESHD_SHARE_FETCH": "whole"}),
            "local": (["--model", str(model)], {}), "capped": (["--share-rate", f"{cap / 1e6:.0f}mbit"], {})}
        reps_of: dict[str, list[dict]] = {}
        for rep in range(reps):
            for label in which:
                extra, env_extra = plans[label]
                lw = (reps_of.get("layers") or [{}])[-1].get("control_window")
                r = join_run(label, root, holders, tb, 2, 1, extra, env_extra, manifest, reference, streamer,
                             rate, control_window=lw if label == "local" else None)
                reps_of.setdefault(label, []).append(r)
        for label, rs in reps_of.items():
            ok = [r for r in rs if not r.get("failed")]
            runs[label] = dict(ok[0] if ok else rs[0])
            runs[label]["parity"] = all(r["parity"] for r in rs)
            runs[label]["fraction_ok"] = all(r.get("fraction_ok", False) for r in rs)
            runs[label]["every_layer_fetches"] = sum(r.get("every_layer_fetches") or 0 for r in rs)
            if ok:
                for key in ("time_to_ready_s", "fetch_s"):
                    vals = [r[key] for r in ok if r.get(key) is not None]
                    if vals:
                        runs[label][key] = round(statistics.median(vals), 2)
                        runs[label][key.replace("_s", "_all_s")] = vals
                if runs[label].get("transfer_alone_s"):
                    runs[label]["ready_over_transfer"] = round(runs[label]["time_to_ready_s"]
                                                               / runs[label]["transfer_alone_s"], 2)
                if runs[label].get("transfer_alone_s") and runs[label].get("fetch_s"):
                    runs[label]["fetch_over_transfer"] = round(runs[label]["fetch_s"] / runs[label]["transfer_alone_s"], 2)
            runs[label]["reps"] = len(rs)
            runs[label]["failed_reps"] = len(rs) - len(ok)
            if label == "capped":
                runs[label]["share_rate_mbit"] = round(cap / 1e6)
        if "local" in runs and runs["local"].get("time_to_ready_s"):
            for name in ("layers", "whole", "capped"):
                if name in runs and runs[name].get("time_to_ready_s"):
                    added = runs[name]["time_to_ready_s"] - runs["local"]["time_to_ready_s"]
                    runs[name]["added_vs_local_file_s"] = round(added, 2)
                    if runs[name].get("transfer_alone_s"):
                        runs[name]["added_over_transfer"] = round(added / runs[name]["transfer_alone_s"], 2)
        served = {h.name: ((h.status() or {}).get("sharing") or {}).get("served") for h in holders}
        streamer.stop()
        for h in holders:
            h.stop()
        return {"link": spec, "mode": tb.mode if tb else "loopback", "holders": [h.name for h in holders],
                "measured_rate_mbit": round(rate / 1e6, 1) if rate else None, "baseline_at_alpha": baseline,
                "runs": runs, "served": served, "seconds": round(time.monotonic() - t_link, 1),
                "load_errors": sum(1 for r in streamer.requests if r["error"])}
    finally:
        for d in SPAWNED:  # by process id, each one we started
            if d.proc is not None and d.proc.poll() is None:
                d.proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    d.proc.wait(10)
        SPAWNED.clear()
        if tb is not None:
            tb.close()
        if os.environ.get("MESHD_BENCH_KEEP") or FAILED:
            log(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


# --------------------------------------------------------------------------- main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="loopback only, alpha as the one holder (<= 5 min)")
    ap.add_argument("--links", nargs="*", default=None, help="link settings (default 1gbit,1ms 100mbit,4ms)")
    ap.add_argument("--runs", nargs="*", default=None, choices=["layers", "whole", "local", "capped"],
                    help="which joiner runs (default: layers whole local, + capped without --quick)")
    ap.add_argument("--reps", type=int, default=1, help="joiners per run kind (medians reported)")
    ap.add_argument("--model", default=None, help="GGUF the holders run (default: the embedded model)")
    ap.add_argument("--memory-budget-mb", type=int, default=120,
                    help="every daemon's memory budget (default 120, half the model: a home with the joiner must "
                         "split, so the joiner gets a layer range to fetch; 0: the daemon's default)")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = ap.parse_args()
    BUDGET[:] = ["--memory-budget-mb", str(args.memory_budget_mb)] if args.memory_budget_mb else []
    links = ["loopback"] if args.quick else (args.links or ["1gbit,1ms", "100mbit,4ms"])
    t0 = time.monotonic()

    from bench._common import emit_json, machine_banner
    from meshd.model.store import default_model_path, is_pulled
    from meshd.share import manifest as mf
    from meshd.share import manifest_build as mb

    if args.model is None and not is_pulled():
        raise SystemExit("the embedded model is not pulled (meshd model pull)")
    model = Path(args.model).resolve() if args.model else default_model_path()
    banner = machine_banner() | {
        "prompts": "warm: the load client repeats one prompt (held by the prefix cache after its first request), "
                   "so its TTFTs measure what a share disturbs, not a prefill"}
    log(f"bench/share.py: {banner['cores']} cores ({banner['cpu']}), torch {banner['torch']}, load "
        f"{banner['load_avg_1m']:.2f}; model {model.name}; daemons: 1 torch thread each, alpha core 0, "
        f"gamma core 1, beta core 1; memory budget {args.memory_budget_mb or 'default'} MB each; links {links}")
    manifest = mb.build(model)
    log(f"manifest: {len(manifest.pieces)} pieces of <= {manifest.piece_size >> 20} MiB, {len(manifest.regions)} "
        f"regions, header {manifest.header.length / 1e6:.2f} MB of {manifest.size / 1e6:.1f} MB")
    reference = references(model)
    which = args.runs or (["layers", "whole", "local"] + ([] if args.quick else ["capped"]))
    results = [run_link(spec, args.quick, model, manifest, reference, which, args.reps) for spec in links]

    first = {k: results[0]["runs"].get(k, {}) for k in ("layers", "whole", "local")}
    summary = {
        "bench": "share", "quick": args.quick, "model": model.name, "size_bytes": manifest.size,
        "setup": {**banner, "threads_per_daemon": 1, "piece_bytes": manifest.piece_size,
                  "memory_budget_mb": args.memory_budget_mb or "the daemon's default"},
        "parity": all(r["parity"] for res in results for r in res["runs"].values()),
        "layer_range_fraction_moved": first["layers"].get("fraction_moved"),
        "layer_range_fraction_expected": first["layers"].get("fraction_expected"),
        "layer_range_fraction_ok": all(r.get("fraction_ok", False) for res in results
                                       for name, r in res["runs"].items() if name in ("layers", "capped")),
        "layer_range_every_layer_fetches": sum(r.get("every_layer_fetches") or 0 for res in results
                                               for name, r in res["runs"].items() if name in ("layers", "capped")),
        "layers_time_to_ready_s": first["layers"].get("time_to_ready_s"),
        "whole_time_to_ready_s": first["whole"].get("time_to_ready_s"),
        "local_file_time_to_ready_s": first["local"].get("time_to_ready_s"),
        "layers_bytes_moved": first["layers"].get("bytes_moved"),
        "whole_bytes_moved": first["whole"].get("bytes_moved"),
        "package_index_used": any(r["package_index_used"] for res in results for r in res["runs"].values()),
        "links": results, "seconds": round(time.monotonic() - t0, 1),
    }
    log("")
    log(f"{'link':<13}{'run':<8}{'layers':<9}{'ready s':>8}{'+vs local':>10}{'fetch s':>8}{'xfer s':>7}"
        f"{'moved MB':>9}{'frac':>7}{'exp':>7}{'gap p50/p90 ms (base)':>24}  parity")
    for res in results:
        base = res["baseline_at_alpha"]
        for name, r in res["runs"].items():
            load = r.get("load_during_fetch") or {}
            gaps = f"{load.get('gap_ms_p50', '-')}/{load.get('gap_ms_p90', '-')} ({base.get('gap_ms_p50')})"
            if r.get("failed"):
                log(f"{res['link']:<13}{name:<8}FAILED: {r['failed']}")
                continue
            log(f"{res['link']:<13}{name:<8}{'[%d,%d)' % tuple(r['layers']):<9}{r['time_to_ready_s']:>8}"
                f"{str(r.get('added_vs_local_file_s', '-')):>10}{str(r.get('fetch_s', '-')):>8}"
                f"{str(r.get('transfer_alone_s', '-')):>7}{r['bytes_moved'] / 1e6:>9.1f}{r['fraction_moved']:>7}"
                f"{r['fraction_expected']:>7}{gaps:>24}  {r['parity']}")
    log(f"layer-range fraction = its share: {summary['layer_range_fraction_ok']}; layer-range fetches of "
        f"every layer (the whole file): {summary['layer_range_every_layer_fetches']}")
    log(f"total {summary['seconds']:.0f} s")
    if args.json:
        emit_json(summary)
    return 0 if summary["parity"] and summary["layer_range_fraction_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
