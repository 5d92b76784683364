"""Early exits (Synera) through a 2-device mesh: decode speed, where tokens leave, and what it costs in quality.

    .venv/bin/python bench/early_exit.py [--quick] [--judge] [--json] [--out FILE]

Setup: the embedded SmolLM2-135M-Instruct, two stage processes [0, 15) and [15, 30),
each pinned to its own core with one torch thread, CURVE on, the coordinator in this
process; greedy answers to the home prompts (bench/prompts/home.jsonl). The shipped exit
heads sit after layers 23 and 29, both inside the last stage. Every prompt is answered
with exits off and at thresholds 0.8, 0.7 and 0.6 (the order rotates per prompt), then on
one device (one stage process holding every layer, core 0) off and at 0.7.

Reported per threshold, side by side with off in the same run:

* decode tokens/s (first token excluded) and the speedup over off;
* the share of tokens that left early, and at which exit;
* agreement with off: the share of answers that are identical, the tokens before the
  first difference, and unigram F1 of the text (Synera's Rouge-1);
* with ``--judge``, quality judged by the local Qwen2.5-Coder-1.5B (bench/outline.py's
  pairwise judge, both orders): each side scores P(better) + P(equally good)/2, and the
  ratio is threshold over off (1.0: no worse);
* the cost model that explains the speed: one decode step, the LM head and an exit
  check, timed in the stage's own numeric mode (``--weights``).

``parity_off`` says the mesh with exits off gives one device's tokens exactly.

The early-exit edge–cloud paper's lossless half, previews of a cloud verifier's verdicts,
is measured by ``bench/cloud_wan.py`` (home and verifier in the testbed's namespaces, a
home WAN line): run here as a subprocess with previews off and on (``--previews-wan``,
default the 20 Mbit/s, 40 ms profile; ``--quick``: the embedded stand-in pair, else the
Qwen2.5-Coder 0.5B home / 1.5B verifier), its ``preview_speedup``, ``parity_previews``,
``predraft_hit_rate`` and ``rounds`` are reported here too (null, with the reason, when it
cannot run: no root for the namespaces, or the pair not pulled).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._cold import COLD_OFF  # noqa: E402
from bench._common import finish, machine_banner, pin  # noqa: E402

THRESHOLDS = (0.8, 0.7, 0.6)


def load_prompts(quick: bool) -> list[dict]:
    rows = [json.loads(x) for x in (ROOT / "bench" / "prompts" / "home.jsonl").read_text().splitlines() if x]
    if quick:
        rows = [r for r in rows if r["category"] == "short"][:3] + [r for r in rows if r["category"] == "event_log"][:1]
    return rows


def unigram_f1(a: str, b: str) -> float:
    wa, wb = Counter(a.lower().split()), Counter(b.lower().split())
    common = sum((wa & wb).values())
    if not wa or not wb or not common:
        return float(wa == wb)
    p, r = common / sum(wa.values()), common / sum(wb.values())
    return 2 * p * r / (p + r)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


async def answer(coord, rid, ids, max_tokens, eos, threshold) -> dict:
    from decoding.sampling import SamplingSpec
    from meshd.pipeline.coordinator.slot import StepsRequest

    t0 = time.perf_counter()
    first, toks, layers = None, [], []
    async for step in coord.steps(StepsRequest(rid, ids, max_tokens, SamplingSpec(), eos,
                                               exit_threshold=threshold)):
        if first is None:
            first = time.perf_counter()
        toks.append(step.token)
        layers.append(step.exit_layer)
    end = time.perf_counter()
    decode = end - first
    steps = layers[1:]  # the first token is the prompt's: it never exits
    return {"tokens": toks, "n": len(toks), "ttft_s": round(first - t0, 4), "decode_s": round(decode, 4),
            "tok_s": round((len(toks) - 1) / decode, 2) if len(toks) > 1 and decode > 0 else 0.0,
            "exited": sum(1 for x in steps if x), "steps": len(steps),
            "by_layer": dict(Counter(str(x) for x in steps if x))}


async def measure(prompts, tok, ranges, weights, max_tokens, exit_heads, log, device=None) -> tuple[list[dict], dict]:
    from bench._cold import CacheGuard
    from tests.support.proc_mesh import ProcessMesh

    rows = {p["id"]: {"prompt": p["prompt"], "category": p["category"], "mesh": {}, "one": {}} for p in prompts}
    cores = {"mesh": [[0], [1]], "one": [[0]]}
    layouts = {"mesh": ranges, "one": [(ranges[0][0], ranges[-1][1])]}
    stats = {}
    for name in ("mesh", "one"):
        modes = [0.0, *THRESHOLDS] if name == "mesh" else [0.0, 0.7]
        # every threshold answers the same prompt: with the prefix cache on, all but the first would decode
        # from its cached (forked) prompt, so it is off (bench._cold)
        async with ProcessMesh(layouts[name], threads=1, cores=cores[name], weights=weights, prefix_cache=False,
                               exit_heads=exit_heads, device=device) as mesh:
            coord = mesh.coord
            guard = CacheGuard(mesh.reused_tokens)
            warm = tok.apply_chat([{"role": "user", "content": "Hello there"}])
            for thr in (0.0, 0.7):  # the first forwards of each shape are slow
                await answer(coord, f"warm-{thr}", warm, 16, tok.eos_ids, thr)
            for pi, p in enumerate(prompts):
                ids = tok.apply_chat([{"role": "user", "content": p["prompt"]}])
                n = min(max_tokens, p.get("max_new_tokens", max_tokens) * 2)
                order = modes[pi % len(modes):] + modes[:pi % len(modes)]
                for thr in order:
                    async with guard.cold(f"{name} {p['id']} exit {thr}"):
                        r = await answer(coord, f"{name}-{pi}-{thr}", ids, n, tok.eos_ids, thr)
                    r["text"] = tok.decode([t for t in r["tokens"] if t not in tok.eos_ids])
                    rows[p["id"]][name][str(thr)] = r
                    log(f"{name:>4} {p['id']:>12} exit {thr or 'off':>4}: {r['tok_s']:6.1f} tok/s, "
                        f"{r['exited']:3d}/{r['steps']:3d} left early {r['by_layer']}", flush=True)
        stats[name] = mesh.stats[-1] if mesh.stats else {}
    return list(rows.values()), stats


def step_costs(weights: str, exit_heads: str | None, device: str = "cpu") -> dict:
    """One decode step, the LM head and one exit check, timed in-process (on one pinned core, or the GPU)."""
    import torch

    from decoding.device import resolve_weights
    from decoding.exits.bound import BoundExits
    from decoding.linear import linear
    from decoding.models.llama.layers import rms_norm
    from meshd.engine.drafting import exit_heads_for
    from meshd.model.store import open_model

    source = open_model(None)
    cfg = source.config
    dev = torch.device(device)
    dtype, packed = resolve_weights(weights, dev)
    stage = source.load_stage(0, cfg.num_layers, dtype, dev, packed)
    bound = BoundExits(exit_heads_for(source, exit_heads), stage)
    kv = stage.new_cache(4096)
    kv.create("s", 600)
    ids = torch.tensor(source.tokenizer.encode("The kitchen light is on and the window is open, so")[:24])
    x = torch.tensor([int(ids[-1])])
    h = torch.randn(1, cfg.hidden_size).to(dtype).to(dev)
    j = next(iter(bound.at))
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def timed(fn, n=40):
        for _ in range(5):
            fn()
        sync()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        sync()
        return (time.perf_counter() - t) / n

    with torch.inference_mode():
        stage.forward(kv, "s", ids, all_logits=False)
        step = timed(lambda: stage.forward(kv, "s", x, all_logits=False))
        head = timed(lambda: linear(rms_norm(h, stage.final_norm, cfg.rms_eps), stage.lm_head, dense=False).float())
        check = timed(lambda: bound.check(j, h, [1.1]))
    layer = (step - head) / cfg.num_layers
    return {"weights": weights, "step_ms": round(step * 1e3, 2), "lm_head_ms": round(head * 1e3, 2),
            "exit_check_ms": round(check * 1e3, 3), "layer_ms": round(layer * 1e3, 3),
            "lm_head_in_layers": round(head / layer, 1), "exit_check_in_layers": round(check / layer, 2),
            "shortlist": bound.heads.size}


def summarise(rows: list[dict], judged: dict | None) -> dict:
    out = {}
    for name, modes in (("mesh", [0.0, *THRESHOLDS]), ("one", [0.0, 0.7])):
        for thr in modes:
            key = str(thr)
            mine = [r[name][key] for r in rows]
            off = [r[name]["0.0"] for r in rows]
            speed = [m["tok_s"] / o["tok_s"] for m, o in zip(mine, off) if o["tok_s"] > 0]
            steps = sum(m["steps"] for m in mine)
            layers = Counter()
            for m in mine:
                layers.update(m["by_layer"])
            out[f"{name}/{key}"] = {
                "tok_s_mean": round(statistics.mean(m["tok_s"] for m in mine), 2),
                "speedup_vs_off": round(statistics.mean(speed), 3) if speed else None,
                "exit_rate": round(sum(m["exited"] for m in mine) / steps, 4) if steps else 0.0,
                "exit_share_by_layer": {k: round(v / steps, 4) for k, v in sorted(layers.items())} if steps else {},
                "identical_answers": sum(m["tokens"] == o["tokens"] for m, o in zip(mine, off)),
                "tokens_before_first_difference": round(statistics.mean(
                    common_prefix(m["tokens"], o["tokens"]) for m, o in zip(mine, off)), 1),
                "unigram_f1_vs_off": round(statistics.mean(unigram_f1(m["text"], o["text"])
                                                           for m, o in zip(mine, off)), 4),
                "quality_ratio_vs_off": (judged or {}).get(f"{name}/{key}"),
            }
    return out


def judge(rows: list[dict], log) -> dict:
    """Each threshold's answers against off's, both orders: mean P(better) + P(tie)/2 per side, as a ratio."""
    from bench.outline import Judge

    j = Judge()
    out = {}
    for thr in THRESHOLDS:
        key, mine, theirs = str(thr), [], []
        for r in rows:
            cand, base = r["mesh"][key]["text"], r["mesh"]["0.0"]["text"]
            if cand == base:
                mine.append(0.5), theirs.append(0.5)
                continue
            a1, b1, c1 = j.prefer(r["prompt"], cand, base)
            a2, b2, c2 = j.prefer(r["prompt"], base, cand)
            mine.append((a1 + b2 + (c1 + c2) / 2) / 2)
            theirs.append((b1 + a2 + (c1 + c2) / 2) / 2)
        out[f"mesh/{key}"] = round(statistics.mean(mine) / statistics.mean(theirs), 4)
        log(f"judged quality at {thr}: {out[f'mesh/{key}']} of off's", flush=True)
    out["mesh/0.0"] = 1.0
    return out


PREVIEW_KEYS = ("preview_speedup", "parity_previews", "predraft_hit_rate", "rounds")


def cloud_previews(profile: str, quick: bool) -> dict:
    """bench/cloud_wan.py with previews off and on, in its own processes: its keys, or nulls and why not."""
    import os
    import subprocess

    if profile == "none":
        return {**dict.fromkeys(PREVIEW_KEYS), "previews": "skipped (--previews-wan none)"}
    if os.geteuid() != 0:
        return {**dict.fromkeys(PREVIEW_KEYS), "previews": "not measured: the testbed's namespaces need root"}
    cmd = [sys.executable, str(ROOT / "bench" / "cloud_wan.py"), "--profiles", profile, "--json",
           "--modes", "stall_free@1.0,previews@1.0", *(["--quick"] if quick else [])]
    print(f"# previews: {' '.join(cmd[1:])}", flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        why = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {**dict.fromkeys(PREVIEW_KEYS), "previews": f"bench/cloud_wan.py failed: {why}"}
    res = json.loads(lines[-1])
    summary = res["profiles"][profile]["summary"]
    print(f"# previews over {profile}: " + ", ".join(f"{k} {summary.get(k)}" for k in PREVIEW_KEYS), flush=True)
    return {**{k: summary.get(k) for k in PREVIEW_KEYS}, "previews": {
        "by": "bench/cloud_wan.py", "profile": profile, "pair": res["setup"]["slm"] + " -> " + res["setup"]["llm"],
        "per_round_ms": summary.get("per_round_ms"), "previews_at": summary.get("previews_at")}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="4 prompts, 64 tokens (under 5 minutes)")
    ap.add_argument("--judge", action="store_true", help="judge quality with the local Qwen2.5-Coder-1.5B")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--weights", default=None,
                    help="the stages' numeric mode (default: auto, the daemon's, on a CPU; float32 on a GPU)")
    ap.add_argument("--device", default="cpu", help="where the stages compute: cpu (default) or cuda")
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--exit-heads", default=None, help="exit heads file (default: the shipped heads)")
    ap.add_argument("--out", default=None, help="also write the JSON object here")
    ap.add_argument("--previews-wan", default="20mbit-40ms",
                    help="bench/cloud_wan.py profile for the previews of a cloud verifier ('none': skip)")
    args = ap.parse_args()
    import torch

    from decoding.pipeline_local import even_split
    from meshd.model.store import open_model

    torch.set_num_threads(1)
    pin([0], 1)  # the coordinator lives on device 0's core
    if args.weights is None:
        args.weights = "auto" if args.device == "cpu" else "float32"  # bf16 on the GPU: see RESULTS, GPU list
    max_tokens = args.max_tokens or (64 if args.quick else 96)
    source = open_model(None)
    tok = source.tokenizer
    prompts = load_prompts(args.quick)
    ranges = even_split(source.config.num_layers, 2)
    setup = {**machine_banner(), "model": source.identity, "devices": 2, "ranges": ranges, "threads_per_stage": 1,
             "cores": "mesh: [0], [1]; one device: [0]; coordinator: core 0", "curve": True,
             "sampling": "greedy", "weights": args.weights, "max_tokens": max_tokens, "prompts": len(prompts),
             "thresholds": THRESHOLDS, "exit_heads": args.exit_heads or "shipped", "device": args.device,
             "prompt_cache": COLD_OFF}
    print("# setup", json.dumps(setup), flush=True)
    costs = step_costs(args.weights, args.exit_heads, args.device)
    print("# step costs", json.dumps(costs), flush=True)
    rows, stage_stats = asyncio.run(measure(prompts, tok, ranges, args.weights, max_tokens, args.exit_heads, print,
                                            None if args.device == "cpu" else args.device))
    judged = judge(rows, print) if args.judge else None
    previews = cloud_previews(args.previews_wan, args.quick)
    per = summarise(rows, judged)
    off_mesh, off_one = [r["mesh"]["0.0"]["tokens"] for r in rows], [r["one"]["0.0"]["tokens"] for r in rows]
    at = per["mesh/0.7"]
    result = {
        "setup": setup, "step_costs": costs, "per_mode": per,
        "speedup_threshold_0_7": at["speedup_vs_off"],
        "quality_ratio_threshold_0_7": at["quality_ratio_vs_off"],
        "exit_rate_threshold_0_7": at["exit_rate"],
        "unigram_f1_threshold_0_7": at["unigram_f1_vs_off"],
        "one_device_speedup_threshold_0_7": per["one/0.7"]["speedup_vs_off"],
        "parity_off": off_mesh == off_one,
        **previews,
        "last_stage_exits": stage_stats.get("mesh", {}).get("exits") if isinstance(stage_stats.get("mesh"), dict)
        else None,
        "runs": rows,
    }
    print("\n| mode | decode tok/s | × off | exit rate | by exit | identical | unigram F1 | judged |")
    print("|---|---|---|---|---|---|---|---|")
    for k, v in per.items():
        print(f"| {k} | {v['tok_s_mean']} | {v['speedup_vs_off']} | {v['exit_rate']:.1%} | "
              f"{v['exit_share_by_layer']} | {v['identical_answers']}/{len(rows)} | {v['unigram_f1_vs_off']} | "
              f"{v['quality_ratio_vs_off']} |")
    print(f"parity_off (mesh off == one device off): {result['parity_off']}")
    finish(result, args.out, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
