"""Speculative decoding through the mesh: naive pipeline decode vs each drafter vs auto.

Setup: the embedded SmolLM2-135M-Instruct split over 2 stage *processes* on
this machine, each pinned to its own core with one torch thread, CURVE on,
the coordinator in this process (it drafts: prompt lookup costs nothing; the
Medusa heads run on the last stage). The same prompts run with every method
in one session; greedy; each method's tokens are compared with the naive
answer (parity). Reported per method: decode tokens/s (tokens after the first
over the time after the first), speedup over naive on the same prompt, mean
tokens committed per verify round, and the measured cost of a verify round
of m tokens relative to a 1-token step.

    .venv/bin/python bench/decode.py [--quick] [--json] [--max-tokens N] [--prompts N]
    .venv/bin/python bench/decode.py --outline [--judge] [--quick] [--json]   (bench/outline.py)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._cold import COLD_OFF, CacheGuard  # noqa: E402
from bench._common import emit_json, machine_banner  # noqa: E402
from meshd.pipeline.coordinator.slot import StepsRequest  # noqa: E402

METHODS = ["naive", "lookup", "medusa", "auto"]


def load_prompts(limit: int | None, quick: bool) -> list[dict]:
    rows = [json.loads(x) for x in (ROOT / "bench" / "prompts" / "home.jsonl").read_text().splitlines() if x]
    shared = ROOT.parent / "shared" / "prompts" / "dev.jsonl"
    if shared.is_file() and not quick:
        rows += [json.loads(x) for x in shared.read_text().splitlines() if x.strip()][:6]
    if quick:  # two short questions and two event-log summaries
        rows = [r for r in rows if r["category"] == "short"][:2] + [r for r in rows if r["category"] == "event_log"][:2]
    return rows[:limit] if limit else rows


async def run(args) -> dict:
    import torch

    from decoding.pipeline_local import even_split
    from decoding.sampling import SamplingSpec
    from decoding.speculative.session import SpeculationSession
    from meshd.model.store import open_model
    from tests.support.proc_mesh import ProcessMesh

    torch.set_num_threads(1)
    source = open_model(None)
    tok = source.tokenizer
    prompts = load_prompts(args.prompts, args.quick)
    ranges = even_split(source.config.num_layers, 2)
    setup = {**machine_banner(), "model": source.identity, "devices": 2, "ranges": ranges,
             "threads_per_stage": 1, "cores": [[0], [1]], "curve": True, "sampling": "greedy",
             "max_tokens": args.max_tokens, "prompts": len(prompts), "methods": METHODS,
             "heads": args.heads or "shipped", "device": args.device or "cpu",
             "weights": args.weights or "float32", "prompt_cache": COLD_OFF}
    print("# setup", json.dumps(setup), flush=True)
    rows = []
    # every method runs the same prompt: with the prefix cache on, all but the first would decode from a
    # forked (cached) prompt, so it is off and every method starts from the same cold prefill (bench._cold)
    async with ProcessMesh(ranges, threads=1, cores=[[0], [1]], heads=args.heads, prefix_cache=False,
                           device=args.device, weights=args.weights) as mesh:
        coord = mesh.coord
        guard = CacheGuard(mesh.reused_tokens)
        ids0 = tok.apply_chat([{"role": "user", "content": "Hello"}])
        async for _ in coord.steps(StepsRequest("warm", ids0, 4, SamplingSpec())):
            pass
        for pi, p in enumerate(prompts):
            ids = tok.apply_chat([{"role": "user", "content": p["prompt"]}])
            max_tokens = min(args.max_tokens, p.get("max_new_tokens", args.max_tokens))
            ref = None
            for method in METHODS:
                session = None if method == "naive" else SpeculationSession(method, list(ids), cost=coord.round_cost)
                async with guard.cold(f"{p['id']} {method}"):
                    t0 = time.perf_counter()
                    t_first, toks = None, []
                    async for step in coord.steps(StepsRequest(f"{pi}-{method}", ids, max_tokens, SamplingSpec(),
                                                               tok.eos_ids, speculation=session)):
                        if t_first is None:
                            t_first = time.perf_counter()
                        toks.append(step.token)
                    t_end = time.perf_counter()
                if ref is None:
                    ref = toks
                st = session.stats() if session else None
                decode_s = t_end - t_first
                row = {"prompt": p["id"], "category": p["category"], "method": method, "tokens": len(toks),
                       "ttft_s": round(t_first - t0, 4), "decode_s": round(decode_s, 4),
                       "tok_s": round((len(toks) - 1) / decode_s, 2) if len(toks) > 1 and decode_s > 0 else 0.0,
                       "parity": toks == ref,
                       "rounds": st.rounds if st else 0,
                       "accepted_per_round": round(st.accepted_per_round, 3) if st and st.rounds else None,
                       "fallback": st.fallback_reason if st else None}
                rows.append(row)
                print(f"{p['id']:>12} {method:>7}: {row['tok_s']:6.1f} tok/s  parity={row['parity']}  "
                      f"rounds={row['rounds']} acc/round={row['accepted_per_round']}"
                      + (f"  fallback: {row['fallback']}" if row["fallback"] else ""), flush=True)
        sizes = coord.round_cost.mean_seconds()
    one = sizes.get(1)
    round_cost = {m: round(t / one, 3) for m, t in sizes.items()} if one else {}
    per = {}
    for method in METHODS:
        mine = [r for r in rows if r["method"] == method]
        speed = [r["tok_s"] / n["tok_s"] for r in mine for n in rows
                 if n["method"] == "naive" and n["prompt"] == r["prompt"] and n["tok_s"] > 0]
        acc = [r["accepted_per_round"] for r in mine if r["accepted_per_round"]]
        per[method] = {"tok_s_mean": round(statistics.mean(r["tok_s"] for r in mine), 2),
                       "speedup_vs_naive": round(statistics.mean(speed), 3) if speed else None,
                       "accepted_per_round": round(statistics.mean(acc), 3) if acc else None,
                       "parity": all(r["parity"] for r in mine)}
        for cat in sorted({r["category"] for r in mine}):
            sp = [r["tok_s"] / n["tok_s"] for r in mine if r["category"] == cat for n in rows
                  if n["method"] == "naive" and n["prompt"] == r["prompt"] and n["tok_s"] > 0]
            per[method][f"speedup_{cat}"] = round(statistics.mean(sp), 3) if sp else None
    best = max((m for m in METHODS if m != "naive"), key=lambda m: per[m]["speedup_vs_naive"] or 0)
    out = {"setup": setup, "parity": all(r["parity"] for r in rows),
           "speedup_vs_naive": per[best]["speedup_vs_naive"], "best_drafter": best, "per_drafter": per,
           "accepted_per_round": {m: per[m]["accepted_per_round"] for m in METHODS if m != "naive"},
           "verify_round_cost": round_cost, "runs": rows}
    print("\n| method | decode tok/s (mean) | speedup vs naive | tokens/round | parity |")
    print("|---|---|---|---|---|")
    for m in METHODS:
        r = per[m]
        print(f"| {m} | {r['tok_s_mean']} | {r['speedup_vs_naive']} | {r['accepted_per_round']} | {r['parity']} |")
    print(f"verify round cost (relative to a 1-token step) by tokens per round: {round_cost}")
    return out


def plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = out["runs"]
    prompts = list(dict.fromkeys(r["prompt"] for r in rows))
    methods = [m for m in METHODS if m != "naive"]
    fig, ax = plt.subplots(figsize=(max(6, len(prompts) * 0.8), 4))
    w = 0.8 / len(methods)
    for k, m in enumerate(methods):
        ys = []
        for p in prompts:
            r = next(x for x in rows if x["prompt"] == p and x["method"] == m)
            n = next(x for x in rows if x["prompt"] == p and x["method"] == "naive")
            ys.append(r["tok_s"] / n["tok_s"] if n["tok_s"] else 0)
        ax.bar([i + k * w for i in range(len(prompts))], ys, w, label=m)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([i + w * (len(methods) - 1) / 2 for i in range(len(prompts))], prompts, rotation=45, ha="right")
    ax.set_ylabel("decode speedup vs naive mesh")
    ax.set_title("Speculative decoding, 2 devices (1 core each), SmolLM2-135M, greedy")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="4 prompts, 48 tokens (about 2 minutes)")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--prompts", type=int, default=None)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "decode.json"))
    ap.add_argument("--heads", default=None, help="Medusa heads file (default: the shipped heads)")
    ap.add_argument("--device", default=None, help="where both stages run: cpu (default) or cuda[:N] (one GPU holds both)")
    ap.add_argument("--weights", default=None,
                    help="numeric mode of both stages: float32 (default), bfloat16, float16, packed, auto")
    ap.add_argument("--outline", action="store_true",
                    help="outline-based parallel decoding instead: latency, concurrency, quality (bench/outline.py)")
    ap.add_argument("--judge", action="store_true", help="with --outline: judge quality with the local 1.5B model")
    args = ap.parse_args()
    if args.outline:
        return outline_main(args)
    if args.max_tokens is None:
        args.max_tokens = 48 if args.quick else 128
    out = asyncio.run(run(args))
    Path(args.out).write_text(json.dumps(out, indent=1))
    try:
        plot(out, Path(args.out).with_suffix(".png"))
    except ImportError:
        print("matplotlib not installed: no plot (pip install -e .[bench])")
    if args.json:
        emit_json({k: v for k, v in out.items() if k != "runs"} | {"runs": len(out["runs"])})
    return 0 if out["parity"] else 1


def outline_main(args) -> int:
    from bench import outline

    out = asyncio.run(outline.run(args))
    outline.report(out)
    path = Path(args.out if args.out != str(ROOT / "bench" / "results" / "decode.json")
                else ROOT / "bench" / "results" / ("outline_quick.json" if args.quick else "outline.json"))
    path.write_text(json.dumps(out, indent=1))
    try:
        outline_plot(out, path.with_suffix(".png"))
    except ImportError:
        print("matplotlib not installed: no plot (pip install -e .[bench])")
    if args.json:
        emit_json({k: v for k, v in out.items() if k != "runs"} | {"runs": len(out["runs"])})
    return 0 if out["parity"] else 1


def outline_plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    names = ["naive", "outline", "outline + SD"]
    vals = [1.0, out["outline_speedup"] or 0, out["outline_sd_speedup"] or 0]
    a1.bar(names, vals, color=["#999", "#2a7", "#27a"])
    a1.set_ylabel("answer latency speedup over naive")
    a1.set_title("Outline-suited prompts, 2 devices")
    rows = out["concurrency"]
    x = [r["requests"] for r in rows]
    a2.plot(x, [r["single_tok_s"] for r in rows], "o-", label="1 device, unbatched")
    a2.plot(x, [r["single_batched_tok_s"] for r in rows], "o-", label="1 device, batched")
    a2.plot(x, [r["mesh_tok_s"] for r in rows], "o-", label="2 devices, batched")
    a2.set_xlabel("concurrent requests")
    a2.set_ylabel("aggregate decode tokens/s")
    a2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
