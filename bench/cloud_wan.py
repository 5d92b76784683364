"""The cloud peer across a WAN built by the testbed: home and verifier in separate network namespaces.

``bench/cloud.py`` emulates the WAN inside the home's process (a sleep per message,
its bytes at the rate). Here the testbed builds it instead: host 0, the home, sits
behind a tbf-shaped uplink and downlink (a home's asymmetric WAN line), host 1, the
verifier, is unshaped (a data centre), and the home reaches the verifier through the
testbed's delay proxy in the switch namespace (RTT/2 added each way). Everything else
is the real thing: the verifier service, its CURVE endpoint, the home's CloudLink and
offload loop, the kernel's TCP over the shaped veth links.

Per WAN profile, on the same prompts back to back: edge-only (budget 0), budget 0.2 and
1.0 drafting ahead while a verdict is out (stall-free), and the same budgets waiting for
each verdict (stop-and-wait). Reported: time between tokens (after the first) and its
ratio to edge-only, stall-free vs stop-and-wait, payload bytes per verification round
both ways, the link's measured round time, and verdicts given up on (committed locally).

Previews (the early-exit edge–cloud paper): ``previews@1.0`` is stall-free at budget 1.0
with the verifier streaming its exits' early verdicts and the home pre-drafting from them.
``preview_speedup`` = stall-free@1.0 / previews@1.0 time between tokens; ``parity_previews``:
the answers are identical; ``predraft_hit_rate``: rounds whose verdict was a pre-draft's,
of those that pre-drafted; ``rounds``: verification rounds with previews on; and per round,
what explains the figure: the home's drafting step, the round (send to verdict), the
verifier's verify (round minus the WAN's RTT), the preview lead time (first preview to verdict).

    sudo .venv/bin/python bench/cloud_wan.py [--quick] [--json] [--profiles 20mbit-40ms,2mbit-100ms]
        [--modes stall_free@1.0,previews@1.0] [--weights gguf] [--preview-threshold 0.6] [--predrafts 2]

Needs root, ``ip`` and ``tc`` for the namespaces; without them the testbed falls back to
loopback processes (delay proxy only, no rate shaping) and the JSON says so.
On this 2-core machine the verifier's model runs on one CPU core, far slower than a cloud
GPU: read the times as ratios measured side by side, not as a deployment's latency.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._common import finish, machine_banner, pin  # noqa: E402

# name -> testbed link of the home: uplink/downlink rate, RTT to the verifier (the examples)
PROFILES = {"20mbit-40ms": "20mbit/100mbit,40ms", "2mbit-100ms": "2mbit/20mbit,100ms"}
MODES = [("edge_only", 0.0, None), ("stall_free@0.2", 0.2, None), ("stop_and_wait@0.2", 0.2, 0),
         ("stall_free@1.0", 1.0, None), ("stop_and_wait@1.0", 1.0, 0), ("previews@1.0", 1.0, None)]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ------------------------------------------------------------------ host 1: the verifier

def verifier_role(args) -> None:
    from bench.cloud import verifier_main

    verifier_main(args.quick, args.state, args.ready, True, 1, listen="0.0.0.0", packed=_packed(args),
                  preview_layers=[int(x) for x in args.preview_layers.split(",")] if args.preview_layers else None)


def _packed(args) -> str:
    return "" if args.weights == "float32" else args.weights


# ------------------------------------------------------------------ host 0: the home

def home_role(args) -> None:
    pin([0], 1)
    from bench.cloud import WanLink, answer, connect_home, load, load_prompts
    from decoding.offload.loop import PreviewSettings
    from decoding.offload.policy import OffloadPolicy

    src, slm = load("slm", args.quick, _packed(args))
    previews = PreviewSettings(args.preview_threshold, args.predrafts)
    modes = [m for m in MODES if m[0] in args.modes.split(",")] if args.modes else MODES
    tok = src.tokenizer
    eos = tuple(tok.eos_ids)
    _, prompts = load_prompts(tok, args.prompts)

    async def main() -> dict:
        node, link = await connect_home(args.address, args.key, args.verifier_state)
        meter = WanLink(link, 0.0, float("inf"), float("inf"))  # counts payload bytes; the testbed is the WAN
        out, session = {}, 1000
        offered = await link.hello()
        # Warm-up: one answer with every chunk verified (model pages, the link's round-time estimate).
        await answer(slm, meter, prompts[0], 8, 1.0, eos, session)
        for name, budget, ahead in modes:
            meter.rounds, per = [], []
            fallbacks0 = link.stats.timeouts + link.stats.refused
            # One policy per mode, shared by the prompts as a home shares it, and the same seeds in every
            # mode: stall-free and stop-and-wait at one budget then offload the same chunks.
            policy = OffloadPolicy(budget)
            for i, p in enumerate(prompts):
                session += 1
                r = await answer(slm, meter, p, args.max_tokens, budget, eos, session, ahead=ahead, policy=policy,
                                 seed=5000 + i, previews=previews if name.startswith("previews") else None)
                per.append(r)
                log(f"{name}: prompt {i + 1}/{len(prompts)} tbt {r['tbt_s'] * 1000:.0f} ms, "
                    f"offloaded {r['stats']['offloaded']}/{r['stats']['chunks']}, "
                    f"previews {r['stats']['previews']}, pre-draft hits {r['stats']['predraft_hits']}"
                    f"/{r['stats']['predraft_rounds']}")
            tot = {k: sum(r["stats"][k] for r in per) for k in (
                "verified", "wait_s", "draft_steps", "draft_s", "previews", "predrafts", "predraft_rounds",
                "predraft_hits", "predraft_tokens", "predraft_saved_s", "preview_rounds", "preview_lead_s",
                "stall_s", "aligned", "corrected", "accepted", "drafted", "openings", "opening_wait_s")}
            usual = tot["verified"] - tot["openings"]  # (a session's opening round carries its prompt)
            out[name] = {
                "share_offloaded": policy.share,
                "tbt_ms": 1000 * statistics.mean(r["tbt_s"] for r in per),
                "first_token_ms": 1000 * statistics.mean(r["first_s"] for r in per),
                "tokens": sum(len(r["tokens"]) for r in per),
                "offloaded": sum(r["stats"]["offloaded"] for r in per),
                "chunks": sum(r["stats"]["chunks"] for r in per),
                "local_fallbacks": sum(r["stats"]["local_fallbacks"] for r in per),
                "link_failures": link.stats.timeouts + link.stats.refused - fallbacks0,
                "uplink_bytes_per_round": statistics.mean(u for u, _ in meter.rounds) if meter.rounds else 0.0,
                "downlink_bytes_per_round": statistics.mean(d for _, d in meter.rounds) if meter.rounds else 0.0,
                "answers": [r["tokens"] for r in per],
                "rounds": tot["verified"],
                "round_ms": 1000 * (tot["wait_s"] - tot["opening_wait_s"]) / usual if usual > 0 else 0.0,
                "time_per_round_ms": 1000 * sum(r["tbt_s"] * (len(r["tokens"]) - 1) for r in per) / usual
                if usual > 0 else 0.0,
                "draft_step_ms": 1000 * tot["draft_s"] / tot["draft_steps"] if tot["draft_steps"] else 0.0,
                "stall_ms_per_round": 1000 * tot["stall_s"] / usual if usual > 0 else 0.0,
                "accepted_per_round": tot["accepted"] / tot["verified"] if tot["verified"] else 0.0,
                "aligned_rounds": tot["aligned"],
                "previews": tot["previews"], "predrafts": tot["predrafts"], "predraft_rounds": tot["predraft_rounds"],
                "predraft_hits": tot["predraft_hits"], "predraft_tokens": tot["predraft_tokens"],
                "predraft_hit_rate": tot["predraft_hits"] / tot["predraft_rounds"] if tot["predraft_rounds"] else 0.0,
                "predraft_saved_ms_per_round": 1000 * tot["predraft_saved_s"] / tot["verified"]
                if tot["verified"] else 0.0,
                "preview_lead_ms": 1000 * tot["preview_lead_s"] / tot["preview_rounds"] if tot["preview_rounds"] else 0.0,
            }
        status = link.status()
        await node.close()
        return {"modes": out, "link_round_ms": status["rtt_ms"], "previews_at": offered}

    Path(args.out).write_text(json.dumps(asyncio.run(main())))


# ------------------------------------------------------------------ the root namespace: the testbed

def run_profile(name: str, args) -> dict:
    from bench.testbed import LinkSpec, Testbed

    spec = LinkSpec.parse(PROFILES[name])
    home_link = LinkSpec(spec.rate_bps, 0.0, spec.down_bps)  # the delay lives in the proxy, per connection
    tmp = Path(tempfile.mkdtemp(prefix="meshd-cloud-wan-"))
    script = str(Path(__file__).resolve())
    quick = ["--quick"] if args.quick else []
    with Testbed(2, name_prefix=f"meshd-cw{os.getpid()}", host_links={0: home_link}) as tb:
        v = tb.host(1).popen([sys.executable, script, "--role", "verifier", "--state", str(tmp / "state"),
                              "--ready", str(tmp / "ready.json"), "--weights", args.weights,
                              *(["--preview-layers", args.preview_layers] if args.preview_layers else []), *quick],
                             cores=[1])
        t0 = time.monotonic()
        while not (tmp / "ready.json").exists():
            if v.poll() is not None or time.monotonic() - t0 > 900:
                raise SystemExit("the verifier did not start")
            time.sleep(0.2)
        info = json.loads((tmp / "ready.json").read_text())
        port = int(info["address"].rsplit(":", 1)[1])
        ip, proxy_port = tb.delayed_address(1, port, rtt_s=spec.rtt_s)
        log(f"{name}: home {tb.host(0).ip} ({home_link.describe()}) -> proxy {ip}:{proxy_port} "
            f"(+{spec.rtt_s * 1000:g} ms RTT) -> verifier {tb.host(1).ip}:{port}; testbed mode {tb.mode}")
        h = tb.host(0).popen([sys.executable, script, "--role", "home", "--address", f"tcp://{ip}:{proxy_port}",
                              "--key", info["key"], "--verifier-state", str(tmp / "state"),
                              "--out", str(tmp / "home.json"), "--prompts", str(args.prompts),
                              "--max-tokens", str(args.max_tokens), "--weights", args.weights,
                              "--preview-threshold", str(args.preview_threshold), "--predrafts", str(args.predrafts),
                              *(["--modes", args.modes] if args.modes else []), *quick], cores=[0])
        if h.wait(timeout=3600) != 0:
            raise SystemExit(f"the home process failed ({h.returncode})")
        res = json.loads((tmp / "home.json").read_text())
        res["testbed"] = tb.describe()
    res["summary"] = summarize(res, name)
    for x in res["modes"].values():
        del x["answers"]
    return res


def summarize(res: dict, name: str) -> dict:
    """The profile's ratios, from whichever modes ran (a ratio whose modes did not run is left out)."""
    m = res["modes"]
    tbt = {k: v["tbt_ms"] for k, v in m.items()}
    out = {"profile": PROFILES[name], "local_fallbacks": sum(x["local_fallbacks"] for x in m.values())}
    if "edge_only" in tbt:
        for b, key in (("0.2", "tbt_vs_edge_only_at_0_2"), ("1.0", "tbt_vs_edge_only_at_1")):
            if f"stall_free@{b}" in tbt:
                out[key] = tbt[f"stall_free@{b}"] / tbt["edge_only"]
    for b, key in (("0.2", "stall_free_speedup_at_0_2"), ("1.0", "stall_free_speedup")):
        if f"stall_free@{b}" in tbt and f"stop_and_wait@{b}" in tbt:
            out[key] = tbt[f"stop_and_wait@{b}"] / tbt[f"stall_free@{b}"]
            out.setdefault("stall_free_answers_equal_stop_and_wait", True)
            out["stall_free_answers_equal_stop_and_wait"] &= m[f"stall_free@{b}"]["answers"] == \
                m[f"stop_and_wait@{b}"]["answers"]
    if "stall_free@1.0" in m:
        out["uplink_bytes_per_round"] = m["stall_free@1.0"]["uplink_bytes_per_round"]
        out["downlink_bytes_per_round"] = m["stall_free@1.0"]["downlink_bytes_per_round"]
    if "previews@1.0" in m and "stall_free@1.0" in m:
        on, off = m["previews@1.0"], m["stall_free@1.0"]
        rtt_ms = _rtt_ms(name)
        out.update({
            "preview_speedup": off["tbt_ms"] / on["tbt_ms"],
            "parity_previews": on["answers"] == off["answers"],
            "predraft_hit_rate": on["predraft_hit_rate"],
            "rounds": on["rounds"],
            "previews_at": res.get("previews_at"),
            "per_round_ms": {mode: {"draft_step": x["draft_step_ms"], "whole_round": x["time_per_round_ms"],
                                    "round": x["round_ms"],
                                    "verify": max(0.0, x["round_ms"] - rtt_ms), "link_rtt": rtt_ms,
                                    "stall": x["stall_ms_per_round"], "preview_lead": x["preview_lead_ms"],
                                    "predraft_saved": x["predraft_saved_ms_per_round"]}
                             for mode, x in (("previews_off", off), ("previews_on", on))},
        })
    return out


def _rtt_ms(name: str) -> float:
    """The profile's RTT, as the testbed reads it."""
    from bench.testbed import LinkSpec

    return LinkSpec.parse(PROFILES[name]).rtt_s * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the small stand-in pair (bench/cloud.py --quick)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--profiles", default=",".join(PROFILES), help=f"comma-separated: {', '.join(PROFILES)}")
    ap.add_argument("--prompts", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("--modes", default=None, help=f"comma-separated subset of: {', '.join(m[0] for m in MODES)}")
    ap.add_argument("--weights", choices=["gguf", "float32"], default="gguf",
                    help="both models' numeric mode (gguf: the file's own blocks, what a daemon picks on a CPU)")
    ap.add_argument("--preview-threshold", type=float, default=0.6)
    ap.add_argument("--predrafts", type=int, default=2, help="pre-drafts a round may start (previews@1.0)")
    ap.add_argument("--preview-layers", default=None, help="the verifier previews at these exits only (default all)")
    ap.add_argument("--role", choices=["verifier", "home"], default=None, help=argparse.SUPPRESS)
    for hidden in ("--state", "--ready", "--address", "--key", "--verifier-state"):
        ap.add_argument(hidden, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.prompts = args.prompts or (3 if args.quick else 8)
    args.max_tokens = args.max_tokens or (32 if args.quick else 48)
    if args.role == "verifier":
        return verifier_role(args)
    if args.role == "home":
        return home_role(args)
    names = [n.strip() for n in args.profiles.split(",") if n.strip()]
    unknown = [n for n in names if n not in PROFILES]
    if unknown:
        raise SystemExit(f"unknown profile(s) {unknown}; known: {', '.join(PROFILES)}")
    setup = {**machine_banner(), "mode": "quick" if args.quick else "full",
             "slm": "SmolLM2-135M + 3% weight noise (stand-in)" if args.quick else "qwen2.5-coder-0.5b-instruct",
             "llm": "SmolLM2-135M" if args.quick else "qwen2.5-coder-1.5b-instruct",
             "home": {"host": 0, "cores": [0], "threads": 1}, "verifier": {"host": 1, "cores": [1], "threads": 1},
             "prompts": args.prompts, "max_tokens": args.max_tokens, "sampling": "greedy", "gamma": 4,
             "weights": args.weights, "modes": args.modes or ",".join(m[0] for m in MODES),
             "previews": {"threshold": args.preview_threshold, "max_predrafts": args.predrafts,
                          "layers": args.preview_layers or "all the heads' exits"}}
    log(f"setup: {json.dumps(setup)}")
    t = time.perf_counter()
    result = {"setup": setup, "profiles": {}}
    for name in names:
        result["profiles"][name] = run_profile(name, args)
        s = result["profiles"][name]["summary"]
        print(f"{name} ({PROFILES[name]}): " + ", ".join(
            f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in s.items()
            if k not in ("profile", "per_round_ms")), flush=True)
        for mode, r in s.get("per_round_ms", {}).items():
            print(f"  per round, {mode}: " + ", ".join(f"{k} {v:.1f} ms" for k, v in r.items()), flush=True)
        for mode, r in result["profiles"][name]["modes"].items():
            print(f"  {mode:<18} {r['tbt_ms']:7.1f} ms between tokens, offloaded {r['offloaded']}/{r['chunks']}, "
                  f"committed locally {r['local_fallbacks']}", flush=True)
    result["wall_s"] = round(time.perf_counter() - t, 1)
    first = next(iter(result["profiles"].values()), {}).get("summary", {})
    for key in ("preview_speedup", "parity_previews", "predraft_hit_rate", "rounds"):  # the keys, top level
        result[key] = first.get(key)
    finish(result, args.out, args.json)


if __name__ == "__main__":
    main()
