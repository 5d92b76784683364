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

    sudo .venv/bin/python bench/cloud_wan.py [--quick] [--json] [--profiles 20mbit-40ms,2mbit-100ms]

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
         ("stall_free@1.0", 1.0, None), ("stop_and_wait@1.0", 1.0, 0)]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ------------------------------------------------------------------ host 1: the verifier

def verifier_role(args) -> None:
    from bench.cloud import verifier_main

    verifier_main(args.quick, args.state, args.ready, True, 1, listen="0.0.0.0")


# ------------------------------------------------------------------ host 0: the home

def home_role(args) -> None:
    pin([0], 1)
    from bench.cloud import WanLink, answer, connect_home, load, load_prompts
    from decoding.offload.policy import OffloadPolicy

    src, slm = load("slm", args.quick)
    tok = src.tokenizer
    eos = tuple(tok.eos_ids)
    _, prompts = load_prompts(tok, args.prompts)

    async def main() -> dict:
        node, link = await connect_home(args.address, args.key, args.verifier_state)
        meter = WanLink(link, 0.0, float("inf"), float("inf"))  # counts payload bytes; the testbed is the WAN
        out, session = {}, 1000
        # Warm-up: one answer with every chunk verified (model pages, the link's round-time estimate).
        await answer(slm, meter, prompts[0], 8, 1.0, eos, session)
        for name, budget, ahead in MODES:
            meter.rounds, per = [], []
            fallbacks0 = link.stats.timeouts + link.stats.refused
            # One policy per mode, shared by the prompts as a home shares it, and the same seeds in every
            # mode: stall-free and stop-and-wait at one budget then offload the same chunks.
            policy = OffloadPolicy(budget)
            for i, p in enumerate(prompts):
                session += 1
                r = await answer(slm, meter, p, args.max_tokens, budget, eos, session, ahead=ahead, policy=policy,
                                 seed=5000 + i)
                per.append(r)
                log(f"{name}: prompt {i + 1}/{len(prompts)} tbt {r['tbt_s'] * 1000:.0f} ms, "
                    f"offloaded {r['stats']['offloaded']}/{r['stats']['chunks']}")
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
            }
        status = link.status()
        await node.close()
        return {"modes": out, "link_round_ms": status["rtt_ms"]}

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
                              "--ready", str(tmp / "ready.json"), *quick], cores=[1])
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
                              "--max-tokens", str(args.max_tokens), *quick], cores=[0])
        if h.wait(timeout=3600) != 0:
            raise SystemExit(f"the home process failed ({h.returncode})")
        res = json.loads((tmp / "home.json").read_text())
        res["testbed"] = tb.describe()
    m = res["modes"]
    edge = m["edge_only"]["tbt_ms"]
    same = all(m[f"stall_free@{b}"]["answers"] == m[f"stop_and_wait@{b}"]["answers"] for b in ("0.2", "1.0"))
    res["summary"] = {
        "profile": PROFILES[name],
        "tbt_vs_edge_only_at_0_2": m["stall_free@0.2"]["tbt_ms"] / edge,
        "tbt_vs_edge_only_at_1": m["stall_free@1.0"]["tbt_ms"] / edge,
        "stall_free_speedup_at_0_2": m["stop_and_wait@0.2"]["tbt_ms"] / m["stall_free@0.2"]["tbt_ms"],
        "stall_free_speedup": m["stop_and_wait@1.0"]["tbt_ms"] / m["stall_free@1.0"]["tbt_ms"],
        "uplink_bytes_per_round": m["stall_free@1.0"]["uplink_bytes_per_round"],
        "downlink_bytes_per_round": m["stall_free@1.0"]["downlink_bytes_per_round"],
        "stall_free_answers_equal_stop_and_wait": same,
        "local_fallbacks": sum(x["local_fallbacks"] for x in m.values()),
    }
    for x in m.values():
        del x["answers"]
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the small stand-in pair (bench/cloud.py --quick)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--profiles", default=",".join(PROFILES), help=f"comma-separated: {', '.join(PROFILES)}")
    ap.add_argument("--prompts", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--out", default=None, help="also write the JSON here")
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
             "prompts": args.prompts, "max_tokens": args.max_tokens, "sampling": "greedy", "gamma": 4}
    log(f"setup: {json.dumps(setup)}")
    t = time.perf_counter()
    result = {"setup": setup, "profiles": {}}
    for name in names:
        result["profiles"][name] = run_profile(name, args)
        s = result["profiles"][name]["summary"]
        print(f"{name} ({PROFILES[name]}): tbt vs edge-only {s['tbt_vs_edge_only_at_0_2']:.2f}x at 0.2, "
              f"{s['tbt_vs_edge_only_at_1']:.2f}x at 1.0; stall-free vs stop-and-wait "
              f"{s['stall_free_speedup_at_0_2']:.2f}x at 0.2, {s['stall_free_speedup']:.2f}x at 1.0; "
              f"{s['uplink_bytes_per_round']:.1f} B up / {s['downlink_bytes_per_round']:.1f} B down per round",
              flush=True)
        for mode, r in result["profiles"][name]["modes"].items():
            print(f"  {mode:<18} {r['tbt_ms']:7.1f} ms between tokens, offloaded {r['offloaded']}/{r['chunks']}, "
                  f"committed locally {r['local_fallbacks']}", flush=True)
    result["wall_s"] = round(time.perf_counter() - t, 1)
    finish(result, args.out, args.json)


if __name__ == "__main__":
    main()
