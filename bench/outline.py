"""Outline-based parallel decoding on the mesh: answer latency, concurrency, and what it costs in quality.

Run as ``bench/decode.py --outline`` (or this file directly). One session:

1. Answers. The embedded SmolLM2-135M-Instruct over 2 stage *processes*
   (one core, one torch thread each, CURVE on, coordinator in this process).
   Every prompt of ``bench/prompts/outline_quality.jsonl`` (7 categories)
   is answered greedily with the same token budget by
     naive       plain pipelined decoding
     outline     outline mode forced on (title-by-title outline, points expanded concurrently)
     outline_sd  outline mode with speculative decoding in every point (``auto`` drafter)
     auto        what ``outline: "auto"`` does (meshd.pipeline.outline.gate: the budget, brevity cues, the router)
   End-to-end answer latency (request sent -> last token) and answer tokens/s.
   Speedups are over naive on the outline-suited prompts (those the labelled set marks suited).
2. Concurrency. Aggregate decode throughput with 1, 2, 4, 8 ordinary requests
   (``bench/concurrency.py``): one device vs the 2-device mesh, batched and not.
3. Quality (``--judge``). A local pairwise judge — the largest model this
   project installs, Qwen2.5-Coder-1.5B-Instruct (``meshd model pull
   qwen2.5-coder-1.5b-instruct``, sha256-checked) — reads the question and both
   answers in both orders and picks A, B or "equally good" from its next-token
   distribution: P(outline better) - P(naive better), averaged over both
   orders (a first-position bias cancels); above +0.02 a win, below -0.02 a
   loss, a tie in between. Reported per category
   for forced-on and for auto (where auto chose naive, the answers are the
   same text: a tie without asking the judge).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SET = ROOT / "bench" / "prompts" / "outline_quality.jsonl"
JUDGE_MODEL = "qwen2.5-coder-1.5b-instruct"
JUDGE_SYSTEM = ("You compare two answers to the same question and decide which is better: more correct, "
                "more useful and clearer. Reply with a single letter: A if answer A is better, B if answer B "
                "is better, C if they are equally good.")
JUDGE_ASK = "Question:\n{q}\n\n[Answer A]\n{a}\n\n[Answer B]\n{b}\n\nWhich answer is better? Reply with A, B or C."
JUDGE_ANSWER_TOKENS = 320
TIE_MARGIN = 0.02  # |score| below this (probability of "better" minus "worse", both orders averaged): a tie


def load_set(quick: bool) -> list[dict]:
    rows = [json.loads(x) for x in SET.read_text().splitlines() if x.strip()]
    if quick:  # two suited questions, one coding, one maths
        pick = {"generic-1", "counterfactual-1", "coding-1", "math-1"}
        rows = [r for r in rows if r["id"] in pick]
    return rows


async def _timed(agen) -> tuple[list[int], float, float]:
    t0 = time.perf_counter()
    first, out = None, []
    async for t in agen:
        if first is None:
            first = time.perf_counter()
        out.append(t)
    end = time.perf_counter()
    return out, end - t0, (first or end) - t0


async def answers(rows: list[dict], max_tokens: int, log=print) -> list[dict]:
    import torch

    from decoding.pipeline_local import even_split
    from decoding.sampling import SamplingSpec
    from decoding.speculative.session import SpeculationSession
    from meshd.model.store import open_model
    from meshd.pipeline.outline.decoder import OutlineDecoder, OutlineStats
    from meshd.pipeline.outline.gate import decide
    from meshd.pipeline.outline.router import shipped
    from tests.support.coordinator import generate_on
    from tests.support.proc_mesh import ProcessMesh

    torch.set_num_threads(1)
    source = open_model(None)
    tok = source.tokenizer
    eos = tuple(tok.eos_ids)
    router = shipped()
    out = []
    from bench._cold import CacheGuard

    # naive, outline and outline+SD answer the same question: with the prefix cache on, each method after
    # the first would start on the question's cached prompt, so it is off (bench._cold). Outline's points
    # still fork from [question + outline] explicitly, as they do in the product.
    async with ProcessMesh(even_split(source.config.num_layers, 2), threads=1, cores=[[0], [1]],
                           prefix_cache=False) as mesh:
        coord = mesh.coord
        guard = CacheGuard(mesh.reused_tokens)
        await _timed(generate_on(coord, "warm", tok.apply_chat([{"role": "user", "content": "Hi"}]), 4,
                                 SamplingSpec(), eos))

        async def plain(rid, ids):
            return [t async for t in generate_on(coord, rid, ids, max_tokens, SamplingSpec(), eos) if t not in eos]

        async def outlined(rid, msgs, spec: bool):
            stats = OutlineStats()
            factory = (lambda ids: SpeculationSession("auto", list(ids), cost=coord.round_cost)) if spec else None
            dec = OutlineDecoder(coord, tok, eos, speculation=factory)
            t0 = time.perf_counter()
            stream = await dec.run(rid, msgs, max_tokens, SamplingSpec(), stats)
            if stream is None:
                return None, time.perf_counter() - t0, stats
            ids = [t async for t in stream]
            return ids, time.perf_counter() - t0, stats

        for i, r in enumerate(rows):
            msgs = [{"role": "user", "content": r["prompt"]}]
            ids = tok.apply_chat(msgs)
            async with guard.cold(f"{r['id']} naive"):
                t0 = time.perf_counter()
                naive = await plain(f"n{i}", ids)
                naive_s = time.perf_counter() - t0
            async with guard.cold(f"{r['id']} outline"):
                outline, outline_s, st = await outlined(f"o{i}", msgs, spec=False)
            row = {"id": r["id"], "category": r["category"], "suited": r["outline"], "prompt": r["prompt"],
                   "routed_outline": decide("auto", msgs, max_tokens, router).use,  # what auto does
                   "naive": {"text": tok.decode(naive), "tokens": len(naive), "latency_s": round(naive_s, 3)},
                   "outline": {"text": tok.decode(outline) if outline else None,
                               "tokens": len(outline) if outline else 0, "latency_s": round(outline_s, 3),
                               "points": st.points, "outline_tokens": st.outline_tokens, "fallback": st.fallback}}
            if r["outline"]:
                async with guard.cold(f"{r['id']} outline+SD"):
                    sd, sd_s, sd_st = await outlined(f"s{i}", msgs, spec=True)
                row["outline_sd"] = {"tokens": len(sd) if sd else 0, "latency_s": round(sd_s, 3),
                                     "same_as_outline": sd == outline, "fallback": sd_st.fallback}
            out.append(row)
            o = row["outline"]
            log(f"{r['id']:>18}: naive {naive_s:5.2f}s/{len(naive):3d} tok | outline {outline_s:5.2f}s/"
                f"{o['tokens']:3d} tok, {o['points']} points"
                + (f" | +SD {row['outline_sd']['latency_s']:5.2f}s same={row['outline_sd']['same_as_outline']}"
                   if "outline_sd" in row else "")
                + (f" | fallback: {o['fallback']}" if o["fallback"] else ""), flush=True)
    return out


def speed_summary(rows: list[dict]) -> dict:
    """Speedups over naive on the outline-suited prompts.

    A prompt whose outline failed (the engine then answers plainly) counts
    as what the user waits for: the outline attempt plus the plain answer.
    ``*_when_outlined`` is the same over the prompts that got an outline.
    """
    suited = [r for r in rows if r["suited"]]
    outlined = [r for r in suited if r["outline"]["text"] is not None]

    def latency(r, key):
        if r["outline"]["text"] is None:  # fell back: the attempt, then the plain answer
            return r[key]["latency_s"] + r["naive"]["latency_s"]
        return r[key]["latency_s"]

    def ratio(key, pool):
        vals = [r["naive"]["latency_s"] / latency(r, key) for r in pool if key in r]
        return round(statistics.mean(vals), 3) if vals else None

    def rate(key, pool):
        vals = [r[key]["tokens"] / r[key]["latency_s"] for r in pool if key in r and r[key].get("tokens")]
        return round(statistics.mean(vals), 2) if vals else None

    def mean(vals):
        vals = list(vals)
        return round(statistics.mean(vals), 3) if vals else None

    return {"outline_speedup": ratio("outline", suited), "outline_sd_speedup": ratio("outline_sd", suited),
            "outline_speedup_when_outlined": ratio("outline", outlined),
            "outline_sd_speedup_when_outlined": ratio("outline_sd", outlined),
            "naive_tok_s": rate("naive", outlined), "outline_tok_s": rate("outline", outlined),
            "outline_sd_tok_s": rate("outline_sd", outlined),
            "naive_latency_s": mean(r["naive"]["latency_s"] for r in suited),
            "outline_latency_s": mean(latency(r, "outline") for r in suited),
            "answer_tokens": {"naive": mean(r["naive"]["tokens"] for r in outlined),
                              "outline": mean(r["outline"]["tokens"] for r in outlined)},
            "suited_prompts": len(suited), "outlined_prompts": len(outlined),
            "fallbacks": sum(1 for r in suited if r["outline"]["text"] is None),
            "outline_sd_same_tokens": all(r["outline_sd"]["same_as_outline"] for r in suited if "outline_sd" in r)}


class Judge:
    """A pairwise judge reading the next-token distribution over A / B / C (equally good)."""

    def __init__(self, threads: int = 2):
        import torch

        from meshd.model.store import open_model, resolve_model

        torch.set_num_threads(threads)
        self.source = open_model(str(resolve_model(JUDGE_MODEL)))
        self.tok = self.source.tokenizer
        self.stage = self.source.load_stage(0, self.source.config.num_layers)
        self.letters = [self.tok.encode(x, add_bos=False)[0] for x in ("A", "B", "C")]

    def _clip(self, text: str) -> str:
        ids = self.tok.encode(text, add_bos=False)
        return text if len(ids) <= JUDGE_ANSWER_TOKENS else self.tok.decode(ids[:JUDGE_ANSWER_TOKENS]) + " ..."

    def prefer(self, question: str, a: str, b: str) -> tuple[float, float, float]:
        """The judge's probabilities of A better / B better / equally good (renormalised over the three)."""
        import torch

        msgs = [{"role": "system", "content": JUDGE_SYSTEM},
                {"role": "user", "content": JUDGE_ASK.format(q=question, a=self._clip(a), b=self._clip(b))}]
        ids = torch.tensor(self.tok.apply_chat(msgs))
        kv = self.stage.new_cache()
        kv.create("j", len(ids) + 1)
        logits = self.stage.forward(kv, "j", ids, all_logits=False)[-1]
        p = torch.softmax(logits[self.letters].float(), -1)
        return float(p[0]), float(p[1]), float(p[2])

    def compare(self, question: str, candidate: str, baseline: str) -> tuple[str, float]:
        """('win' | 'loss' | 'tie', score) for ``candidate`` against ``baseline``, asked in both orders.

        The score is how much more likely the judge calls the candidate better
        than the baseline, averaged over the two orders — a judge that favours
        whatever comes first adds the same amount to both sides and cancels.
        """
        a1, b1, _ = self.prefer(question, candidate, baseline)   # candidate is A
        a2, b2, _ = self.prefer(question, baseline, candidate)   # candidate is B
        score = ((a1 - b1) + (b2 - a2)) / 2
        verdict = "win" if score > TIE_MARGIN else "loss" if score < -TIE_MARGIN else "tie"
        return verdict, round(score, 4)


def judge_rows(rows: list[dict], log=print) -> dict:
    judge = Judge()
    per: dict[str, dict[str, dict[str, int]]] = {}
    for r in rows:
        cat = r["category"]
        forced, score = ("tie", 0.0) if r["outline"]["text"] is None else judge.compare(
            r["prompt"], r["outline"]["text"], r["naive"]["text"])
        auto = forced if r["routed_outline"] and r["outline"]["text"] is not None else "tie"  # same text: a tie
        r["verdict"] = {"forced": forced, "auto": auto, "score": score}
        for mode, v in (("forced", forced), ("auto", auto)):
            c = per.setdefault(mode, {}).setdefault(cat, {"win": 0, "tie": 0, "loss": 0})
            c[v] += 1
        log(f"{r['id']:>18}: forced {forced:>4}  auto {auto:>4}", flush=True)
    return per


async def run(args, log=print) -> dict:
    from bench._cold import COLD_OFF
    from bench._common import machine_banner
    from bench.concurrency import concurrency_rows, measure_configs

    rows = load_set(args.quick)
    max_tokens = args.max_tokens or (160 if args.quick else 256)
    setup = {**machine_banner(), "model": "SmolLM2-135M-Instruct Q4_1 (embedded)", "devices": 2,
             "cores": [[0], [1]], "threads_per_stage": 1, "curve": True, "sampling": "greedy",
             "max_tokens": max_tokens, "prompts": len(rows), "judge": JUDGE_MODEL if args.judge else None,
             "prompt_cache": COLD_OFF}
    log("# setup", json.dumps(setup), flush=True)
    rows = await answers(rows, max_tokens, log)
    speed = speed_summary(rows)
    levels = [1, 4] if args.quick else [1, 2, 4, 8]
    conc = await measure_configs(levels, 16 if args.quick else 32, 1 if args.quick else 2, log)
    concurrency = concurrency_rows(conc, levels)
    parity = all(v["parity"] for v in conc.values())
    quality = judge_rows(rows, log) if args.judge else "not judged (run with --judge)"
    return {"setup": setup, **speed, "concurrency": concurrency, "quality": quality, "parity": parity,
            "router": {"routed_outline": sum(r["routed_outline"] for r in rows),
                       "agrees_with_labels": round(sum(r["routed_outline"] == r["suited"] for r in rows) / len(rows), 3)},
            "runs": rows}


def report(out: dict, log=print) -> None:
    log("\n| | naive | outline | outline + SD |")
    log("|---|---:|---:|---:|")
    log(f"| answer latency, suited prompts (s) | {out['naive_latency_s']} | {out['outline_latency_s']} | |")
    log(f"| answer tokens/s | {out['naive_tok_s']} | {out['outline_tok_s']} | {out['outline_sd_tok_s']} |")
    log(f"| speedup in answer latency over naive (fallbacks included) | 1 | {out['outline_speedup']} | "
        f"{out['outline_sd_speedup']} |")
    log(f"| same, prompts that got an outline ({out['outlined_prompts']} of {out['suited_prompts']}) | 1 | "
        f"{out['outline_speedup_when_outlined']} | {out['outline_sd_speedup_when_outlined']} |")
    log("\n| requests | single, unbatched | single, batched | mesh, batched | mesh / single unbatched |")
    log("|---:|---:|---:|---:|---:|")
    for r in out["concurrency"]:
        log(f"| {r['requests']} | {r['single_tok_s']} | {r['single_batched_tok_s']} | {r['mesh_tok_s']} | {r['ratio']} |")
    if isinstance(out["quality"], dict):
        for mode, cats in out["quality"].items():
            log(f"\nquality, outline {mode} vs naive (win/tie/loss by category):")
            for cat, c in sorted(cats.items()):
                log(f"  {cat:>16}: {c['win']}/{c['tie']}/{c['loss']}")
    log(f"batched parity: {out['parity']}; router agrees with labels on {out['router']['agrees_with_labels']}")
