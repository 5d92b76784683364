"""Aggregate decode throughput with 1, 2, 4, 8 requests at once: batched stages vs one message per forward.

Setup: the embedded SmolLM2-135M-Instruct as stage *processes* on this
machine, each pinned to its own core with one torch thread, CURVE on, the
coordinator in this process. Four configurations run in one session:

  single/unbatched  one device, the whole model, one message per forward (how stages ran before batching)
  single/batched    one device, the whole model, queued work run in one forward
  mesh/unbatched    2 devices (one core each), layers split evenly, one message per forward
  mesh/batched      2 devices, batched

Every request gets a different chat prompt and decodes ``--tokens`` tokens
greedily; throughput is all tokens after each request's first, over the time
from the first token anywhere to the last. Parity: every request's tokens in
every configuration equal that prompt's answer decoded alone on one device.
Also measured: attention alone for B sequences, ragged (one call per
sequence over its own cache, what the stage does) vs padded (copy every cache
into one padded batch, one call).

    .venv/bin/python bench/concurrency.py [--quick] [--json] [--levels 1,2,4,8] [--tokens 32]
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

CONFIGS = [("single", False), ("single", True), ("mesh", False), ("mesh", True)]


def chat_prompts(tok, n: int) -> list[list[int]]:
    rows = [json.loads(x) for x in (ROOT / "bench" / "prompts" / "home.jsonl").read_text().splitlines() if x]
    texts = [r["prompt"] for r in rows]
    while len(texts) < n:
        texts += texts
    return [tok.apply_chat([{"role": "user", "content": t}]) for t in texts[:n]]


async def run_level(coord, prompts: list[list[int]], tokens: int) -> tuple[float, list[list[int]]]:
    from decoding.sampling import SamplingSpec
    from tests.support.coordinator import generate_on

    stamps: list[float] = []
    outs: list[list[int]] = [[] for _ in prompts]

    async def one(i, ids):
        async for t in generate_on(coord, f"c{i}-{time.monotonic_ns()}", ids, tokens, SamplingSpec(), ()):
            stamps.append(time.perf_counter())
            outs[i].append(t)

    await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    stamps.sort()
    return (len(stamps) - len(prompts)) / (stamps[-1] - stamps[0]), outs


async def measure_configs(levels: list[int], tokens: int, reps: int, log=print) -> dict:
    """Rows per (config, level) with tokens/s (median of ``reps``) and parity against lone decoding."""
    import torch

    from decoding.generate import generate
    from decoding.pipeline_local import LocalPipeline, even_split
    from meshd.model.store import open_model
    from tests.support.proc_mesh import ProcessMesh

    torch.set_num_threads(1)
    source = open_model(None)
    prompts = chat_prompts(source.tokenizer, max(levels))
    ref_pipe = LocalPipeline.from_source(source, 1)
    refs = [generate(ref_pipe, p, tokens).token_ids for p in prompts]
    n_layers = source.config.num_layers
    results: dict = {}
    for where, batched in CONFIGS:
        ranges = [(0, n_layers)] if where == "single" else even_split(n_layers, 2)
        cores = [[0]] if where == "single" else [[0], [1]]
        name = f"{where}/{'batched' if batched else 'unbatched'}"
        # the same prompts run at every level and rep: with the prefix cache on, all but the first would
        # start on their cached prompt and flatter the later levels, so it is off (bench._cold)
        async with ProcessMesh(ranges, threads=1, cores=cores, heads="none", prefix_cache=False,
                               max_batch_tokens=None if batched else 0) as mesh:
            guard = CacheGuard(mesh.reused_tokens)
            await run_level(mesh.coord, prompts[:1], 4)  # warm-up
            for n in levels:
                rates, ok = [], True
                for rep in range(reps):
                    async with guard.cold(f"{name} x{n} rep {rep}"):
                        rate, outs = await run_level(mesh.coord, prompts[:n], tokens)
                    rates.append(rate)
                    ok &= outs == refs[:n]
                results[(name, n)] = {"tok_s": round(statistics.median(rates), 2), "all": [round(r, 2) for r in rates],
                                      "parity": ok}
                log(f"{name:>17} x{n}: {results[(name, n)]['tok_s']:6.1f} tok/s  parity={ok}", flush=True)
    return results


def concurrency_rows(res: dict, levels: list[int]) -> list[dict]:
    """One row per level: every configuration's tokens/s and the ratios the issue asks for."""
    rows = []
    for n in levels:
        g = lambda name: res[(name, n)]["tok_s"]  # noqa: E731
        rows.append({"requests": n, "single_tok_s": g("single/unbatched"), "single_batched_tok_s": g("single/batched"),
                     "mesh_unbatched_tok_s": g("mesh/unbatched"), "mesh_tok_s": g("mesh/batched"),
                     "ratio": round(g("mesh/batched") / g("single/unbatched"), 3),
                     "ratio_vs_single_batched": round(g("mesh/batched") / g("single/batched"), 3),
                     "batching_gain_mesh": round(g("mesh/batched") / g("mesh/unbatched"), 3)})
    return rows


def attention_microbench(batch_sizes=(2, 4, 8), context: int = 256, reps: int = 200) -> list[dict]:
    """One layer's attention for B single-token steps: ragged calls vs padding the caches into one call."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    nh, nkv, hd = 9, 3, 64  # the embedded model's attention shape
    rows = []
    for b in batch_sizes:
        lens = [context // 2 + (context * i) // (2 * b) for i in range(b)]  # ragged lengths
        caches = [(torch.randn(nkv, L, hd), torch.randn(nkv, L, hd)) for L in lens]
        q = torch.randn(b, nh, 1, hd)

        def ragged():
            return [F.scaled_dot_product_attention(q[i:i + 1], k.unsqueeze(0), v.unsqueeze(0), enable_gqa=True)
                    for i, (k, v) in enumerate(caches)]

        def padded():
            lmax = max(lens)
            k = torch.zeros(b, nkv, lmax, hd)
            v = torch.zeros(b, nkv, lmax, hd)
            mask = torch.zeros(b, 1, 1, lmax, dtype=torch.bool)
            for i, (ck, cv) in enumerate(caches):
                k[i, :, :lens[i]] = ck
                v[i, :, :lens[i]] = cv
                mask[i, ..., :lens[i]] = True
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

        def timed(fn):
            for _ in range(10):
                fn()
            t = time.perf_counter()
            for _ in range(reps):
                fn()
            return (time.perf_counter() - t) / reps * 1e6

        r, p = timed(ragged), timed(padded)
        rows.append({"batch": b, "context": context, "ragged_us": round(r, 1), "padded_us": round(p, 1),
                     "padded_over_ragged": round(p / r, 2)})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="levels 1,4; 16 tokens; one rep (about 2 minutes)")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--levels", default="1,2,4,8")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "concurrency.json"))
    args = ap.parse_args()
    if args.quick:
        args.levels, args.tokens, args.reps = "1,4", 16, 1
    levels = [int(x) for x in args.levels.split(",")]
    setup = {**machine_banner(), "model": "SmolLM2-135M-Instruct Q4_1 (embedded)", "threads_per_stage": 1,
             "single_cores": [[0]], "mesh_cores": [[0], [1]], "curve": True, "sampling": "greedy",
             "tokens_per_request": args.tokens, "levels": levels, "reps": args.reps,
             "max_batch_tokens": "stage default (512)", "prompt_cache": COLD_OFF}
    print("# setup", json.dumps(setup), flush=True)
    res = asyncio.run(measure_configs(levels, args.tokens, args.reps))
    rows = concurrency_rows(res, levels)
    parity = all(v["parity"] for v in res.values())
    attn = attention_microbench()
    print("\n| requests | single, unbatched | single, batched | mesh, unbatched | mesh, batched | "
          "mesh batched / single unbatched | / single batched |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['requests']} | {r['single_tok_s']} | {r['single_batched_tok_s']} | {r['mesh_unbatched_tok_s']} | "
              f"{r['mesh_tok_s']} | {r['ratio']} | {r['ratio_vs_single_batched']} |")
    print(f"parity (every request equals its lone answer): {parity}")
    print("attention only, one layer, single-token steps:", json.dumps(attn))
    out = {"setup": setup, "concurrency": rows, "parity": parity, "attention_ragged_vs_padded": attn,
           "runs": {f"{k[0]}@{k[1]}": v for k, v in res.items()}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    if not args.quick:
        Path(args.out).write_text(json.dumps(out, indent=1))
    if args.json:
        emit_json(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
