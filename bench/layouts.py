"""Layouts side by side: one device, one pipeline over two, two replicas, a tensor group — and the planner's pick.

Setup: a model (``--model``; the embedded SmolLM2-135M-Instruct by default) as stage *processes* on this
machine, each pinned to its own core with one torch thread, CURVE on, the coordinator (the one daemons
run, routing per request) in this process. Every configuration in one numeric mode (``--weights``: float32
for the embedded model by default, gguf for a pulled one). Configurations, each in one session of this run:

  single/unbatched  one device, the whole model, one message per forward
  single/batched    one device, the whole model, queued work run in one forward (a lone member today)
  pipeline          two devices (one core each), layers split evenly, batched
  replicas          two devices, each the whole model, batched; the coordinator routes each request
  tensor:split      (gguf) two devices as one tensor-parallel group: every layer split, attention by heads
  tensor:whole      (gguf) the same group holding the attention whole on both (one exchange a layer)

Cases: bursts of 1, 4 and 8 requests arriving together (home prompts, ``--tokens`` answer
tokens each) and one long prompt (Home Assistant's system prompt and a command, 32 answer
tokens). Every prompt is unique (no prefix-cache hits flatter a layout), and every answer is
compared with that prompt decoded alone in the same mode: on one device, or for a tensor group in the
in-process group of the same split (its partial sums add in another order than one device's). Per case:
mean request latency (arrival to last token) and throughput (answer tokens / burst wall time).

The planner's choice is ``partition.layout.choose_layout`` over two copies of a profile, ``--link`` (the
daemon's default price, 100 Mbit/s and 2 ms; "loopback" prices these processes' own link) and the case's
workload, with tensor groups among the layouts in gguf mode. The profile: the shipped one of this machine
for the embedded model in float32; else this model's shipped profile scaled to the decode step one device
measured in this run. Its measured figure is the forced layout it picks, from the same run.

    .venv/bin/python bench/layouts.py [--quick] [--json] [--tokens 64] [--reps 2]
    .venv/bin/python bench/layouts.py --model qwen2.5-coder-1.5b-instruct --link loopback --json

``--json`` keys: speedup_4_vs_unbatched and speedup_4_vs_batched (throughput of the choice at 4
in flight over one device's), single_vs_best_member (one short request: the best member alone's
latency over the choice's; >= 1 means no slower), choice_vs_best_forced (worst case over cases of
the choice's latency over the best forced layout's; <= 1.10 is the target), parity.
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

from bench._cold import CacheGuard  # noqa: E402
from bench._common import finish, machine_banner, pin  # noqa: E402

PLAIN = ("pipeline", "replicas")
TENSOR = ("tensor:split", "tensor:whole")  # a two-member group, holding the attention each way
PROFILE = ROOT / "profiles" / "x86_64-2core-1thread.json"
LONG_TOKENS = 32


def home_texts() -> list[str]:
    """The home's short requests (a voice command, a question): the bursts' prompts."""
    rows = [json.loads(x) for x in (ROOT / "bench" / "prompts" / "home.jsonl").read_text().splitlines() if x]
    return [r["prompt"] for r in rows if r.get("category") == "short"]


def prompts_for(tok, cases: list[tuple[str, int]], reps: int) -> dict[tuple[str, int, int], list[list[int]]]:
    """Unique prompts per (case, rep): a numbered system line makes every prompt differ from its start."""
    from bench.ha_home import system_prompt

    texts, out, k = home_texts(), {}, 0
    for name, n in [*cases, ("warm", max(n for _, n in cases))]:
        for rep in range(1 if name == "warm" else reps):
            batch = []
            for i in range(n):
                if name == "long":
                    msgs = [{"role": "system", "content": f"Session {rep}.{i}. {system_prompt()}"},
                            {"role": "user", "content": "Turn on the kitchen lights and tell me the temperature."}]
                else:
                    word = "Warm-up" if name == "warm" else "Request"
                    msgs = [{"role": "system", "content": f"{word} {k}: answer briefly."},
                            {"role": "user", "content": texts[k % len(texts)]}]
                k += 1
                batch.append(tok.apply_chat(msgs))
            out[(name, n, rep)] = batch
    return out


async def burst(coord, prompts: list[list[int]], tokens: int, cuts=None) -> dict:
    from decoding.sampling import SamplingSpec
    from tests.support.coordinator import generate_on

    t0 = time.perf_counter()
    outs: list[list[int]] = [[] for _ in prompts]
    ends: list[float] = [0.0] * len(prompts)
    firsts: list[float] = [0.0] * len(prompts)
    spread: dict = {}

    async def one(i, ids):
        async for t in generate_on(coord, f"l{i}-{time.monotonic_ns()}", ids, tokens, SamplingSpec(), (), cuts=cuts):
            if not outs[i]:
                firsts[i] = time.perf_counter() - t0
                if not spread:  # requests per route when the first token arrives
                    spread.update(coord.route_counts.to_dict())
            outs[i].append(t)
        ends[i] = time.perf_counter() - t0

    await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    wall = max(ends)
    return {"latency_s": statistics.mean(ends), "ttft_s": statistics.mean(firsts), "wall_s": wall,
            "tok_s": sum(len(o) for o in outs) / wall, "outs": outs, "spread": spread}


def mesh_for(config: str, n_layers: int, model: str | None, weights: str):
    from decoding.pipeline_local import even_split
    from tests.support.proc_mesh import ProcessMesh

    whole = [(0, n_layers)]
    # the shipped early-exit heads are the embedded model's; another model's stages run without them
    kw = dict(model=model, weights=weights, threads=1, heads="none", **({"exit_heads": "none"} if model else {}))
    if config == "single/unbatched":
        return ProcessMesh(whole, cores=[[0]], max_batch_tokens=0, **kw)
    if config == "single/batched":
        return ProcessMesh(whole, cores=[[0]], **kw)
    if config == "pipeline":
        return ProcessMesh(even_split(n_layers, 2), cores=[[0], [1]], **kw)
    if config in TENSOR:
        return ProcessMesh(whole * 2, cores=[[0], [1]], tensor=config.split(":")[1], **kw)
    return ProcessMesh(whole * 2, cores=[[0], [1]], groups=[1, 1], **kw)


async def measure(cases, configs, prompts, tokens_for, reps, refs, n_layers: int, model, weights, profile,
                  skip=frozenset(), log=print) -> dict:
    """Per (config, case, n): the medians over ``reps`` bursts, and parity with ``refs[config][prompt]``."""
    results: dict = {}
    for config in configs:
        async with mesh_for(config, n_layers, model, weights) as mesh:
            guard = CacheGuard(mesh.reused_tokens)
            cuts = cuts_for(mesh, n_layers, profile)
            # Warm-up (a process's first forwards of each shape are several times slower): a burst as
            # wide as the widest case, then one request per route, on prompts no case uses.
            widest = max(n for _, n in cases)
            await burst(mesh.coord, prompts[("warm", widest, 0)], 16, cuts)
            await burst(mesh.coord, prompts[("warm", widest, 0)][:len(mesh.routes)], 16, cuts)
            for name, n in cases:
                if (config == "single/unbatched" and name == "long") or (config, name, n) in skip:
                    continue  # (one request: batching has nothing to batch)
                runs, ok = [], True
                for rep in range(reps):
                    ps = prompts[(name, n, rep)]
                    async with guard.cold(f"{config} {name}x{n} rep {rep}"):
                        r = await burst(mesh.coord, ps, tokens_for(name), cuts)
                    ok &= all(o == refs[reference_of(config)][tuple(p)] for o, p in zip(r.pop("outs"), ps))
                    spread = r.pop("spread")
                    runs.append(r)
                row = {k: round(statistics.median(r[k] for r in runs), 3) for k in ("latency_s", "ttft_s", "tok_s")}
                row["parity"] = ok
                results[(config, name, n)] = row
                row["requests_per_route"] = list(spread.values())
                log(f"{config:>17} {name}x{n}: per route {list(spread.values())}; latency {row['latency_s']:7.2f} s  "
                    f"ttft {row['ttft_s']:6.2f} s  {row['tok_s']:6.1f} tok/s  parity={ok}", flush=True)
        log(f"{config:>17}: tokens computed per stage process {[s.get('tokens') for s in mesh.stats]}", flush=True)
    return results


def reference_of(config: str) -> str:
    """Whose answers a configuration must equal: one device's, or a tensor group's own split in one process."""
    return config if config in TENSOR else "one"


def references(source, weights: str, prompts, tokens_for, configs, log=print) -> dict:
    """Every timed prompt decoded alone (greedy) in this mode: by one device, and by the in-process group of
    each tensor configuration."""
    import torch

    from decoding.generate import generate
    from decoding.pipeline_local import LocalPipeline

    timed = {k: v for k, v in prompts.items() if k[0] != "warm"}
    t0 = time.perf_counter()
    if weights == "gguf":
        stage = source.load_stage(0, source.config.num_layers, torch.float32, packed="gguf")
        one = LocalPipeline([stage])
    else:
        stage, one = None, LocalPipeline.from_source(source, 1)
    refs: dict = {"one": {}}
    for (name, _, _), batch in timed.items():
        for p in batch:
            refs["one"][tuple(p)] = generate(one, p, tokens_for(name)).token_ids
    del one
    for config in (c for c in configs if c in TENSOR):
        from tests.support.tensor_group import run_group_many

        refs[config] = {}
        for (name, _, _), batch in timed.items():
            first = run_group_many(stage, 2, [torch.tensor(p) for p in batch], tokens_for(name), (1.0, 1.0),
                                   attention=config.split(":")[1])[0]
            for p, (_, tokens) in zip(batch, first):
                refs[config][tuple(p)] = tokens
    n = sum(len(b) for b in timed.values())
    log(f"# references: {n} prompts decoded alone in {time.perf_counter() - t0:.0f} s "
        f"({', '.join(refs)})", flush=True)
    return refs


def cuts_for(mesh, n_layers: int, profile: dict):
    """Where the daemon would cut a prompt on each route: the cut table its leader builds from the
    members' profiles (here ``profile`` for both), none on a one-stage route."""
    from meshd.pipeline.coordinator.cuts import prompt_cuts
    from meshd.mesh.home_plan import cut_table_over

    tables = {r.index: cut_table_over(r.stages, {s.node_id: profile for s in r.stages}, n_layers)
              for r in mesh.routes if len(r.stages) > 1}
    return lambda n, route: prompt_cuts(n, len(route.stages), tables.get(route.index), False)


def planner_profiles(model_path: str, shipped: bool, single: dict, tokens: int, prompt_tokens: int):
    """The two devices' profiles the planner prices: this machine's shipped one for the embedded model in
    float32 (as ever); else this model's shipped profile scaled to one device's decode step measured here
    (one request alone, single/batched: (latency - first token) / (tokens - 1))."""
    import dataclasses

    from bench._profiles import measured_profile
    from partition.profile import load

    if shipped:
        base = load(PROFILE)
        return [dataclasses.replace(base, device_id=f"dev{i}") for i in range(2)], PROFILE.name
    step = (single["latency_s"] - single["ttft_s"]) / max(1, tokens - 1)
    devs = measured_profile(model_path, step, prompt_tokens + tokens // 2, ("dev0", "dev1"))
    if devs is None:
        raise SystemExit(f"no shipped profile has this model's layer count ({model_path})")
    return devs, f"{devs[0].model.identity}, scaled to {1000 * step:.1f} ms a decode step (measured)"


def planner_choices(cases, prompts, tokens_for, link, home, tensor: bool) -> dict:
    """The layout the planner picks for each case's workload, with its predicted prices; ``config`` is the
    forced configuration that measures it."""
    import dataclasses

    from partition.layout import Workload, choose_layout
    from partition.plan import PLAN_MAX_SEQ

    out = {}
    for name, n in cases:
        ps = prompts[(name, n, 0)]
        work = Workload(round(statistics.mean(len(p) for p in ps)), tokens_for(name), 0.0, n)
        lay = choose_layout(home, link, work, max(PLAN_MAX_SEQ, work.prompt_tokens + 64), tensor=tensor)
        attention = next((g.tensor_attention for g in lay.groups if g.tensor), None)
        alone = len(lay.groups) == 1 and len(lay.groups[0].members) == 1  # one device serves: measured as such
        config = ("single/batched" if alone else f"tensor:{attention}" if lay.kind == "tensor" else
                  lay.kind if lay.kind in PLAIN else "single/batched")
        out[(name, n)] = {"kind": lay.kind, "config": config, "predicted_s": round(lay.latency_s, 3),
                          "alternatives_s": {k: round(v, 3) for k, v in lay.alternatives.items()},
                          "reason": lay.reason, "workload": dataclasses.asdict(work)}
    return out


def handoff_account(res: dict, prompt_tokens: int, p) -> dict:
    """Would a pipeline prefill then a replica decode pay? The TTFT the pipeline saved on the long
    prompt (measured) against moving its KV to a replica (priced: ``partition.layout.kv_handoff_s``)."""
    from partition.layout import kv_handoff_s
    from partition.link import parse_link

    saved = res[("replicas", "long", 1)]["ttft_s"] - res[("pipeline", "long", 1)]["ttft_s"]
    links = ("100mbit,2ms", "1gbit,1ms")
    cost = {spec: round(kv_handoff_s(p, parse_link(spec), prompt_tokens), 3) for spec in links}
    return {"prompt_tokens": prompt_tokens, "prefill_saved_s": round(saved, 3),
            "kv_mib": round(p.kv_bytes_per_token_per_layer * p.num_layers * prompt_tokens / 2**20, 1),
            "transfer_s": cost, "pays_on": [spec for spec in links if cost[spec] < saved]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="32 answer tokens, one rep (under 5 minutes)")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--tokens", type=int, default=64, help="answer tokens per home request (32-128)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--model", default="embedded", help="embedded, or a pulled model's name or file")
    ap.add_argument("--weights", default=None, help="every stage's numeric mode (default: float32 for the "
                    "embedded model, gguf for another); gguf adds the tensor groups")
    ap.add_argument("--link", default="100mbit,2ms", help="the link the planner prices (default: the daemon's; "
                    "'loopback': these processes' own)")
    ap.add_argument("--out", default=None, help="also write the JSON object here")
    args = ap.parse_args()
    if args.quick:
        args.tokens, args.reps = 32, 1
    import torch

    from bench._profiles import LOOPBACK, priced_link
    from decoding.quant import native
    from meshd.model.store import open_model

    torch.set_num_threads(1)
    source = open_model(None if args.model == "embedded" else args.model)
    model = None if args.model == "embedded" else str(source.path)
    weights = args.weights or ("float32" if model is None else "gguf")
    tensor = weights == "gguf" and native.available()[0]
    forced = PLAIN + (TENSOR if tensor else ())
    cases = [("burst", 1), ("burst", 2), ("burst", 4), ("burst", 8), ("long", 1)]
    if args.quick and model is not None:  # a pulled model's long prompt and widest burst take minutes
        cases = [("burst", 1), ("burst", 2), ("burst", 4)]
    configs = ["single/unbatched", "single/batched", *forced]
    tokens_for = lambda name: LONG_TOKENS if name == "long" else args.tokens  # noqa: E731
    n_layers = source.config.num_layers
    setup = {**machine_banner(), "model": f"{source.path.name} ({args.model}), {weights} stages",
             "threads_per_stage": 1, "cores": "single: [0]; two devices: [0], [1]; coordinator: core 0",
             "curve": True, "cuts": "the cut table a leader builds from the planner's profile",
             "sampling": "greedy", "answer_tokens": args.tokens, "long_answer_tokens": LONG_TOKENS,
             "reps": args.reps, "planner_link": args.link + (f" (priced {LOOPBACK})" if args.link == "loopback" else ""),
             "configs": configs, "coordinator": "in this process (routes per request)",
             "prompts": "cold: prefix cache on, every timed prompt unique from its system line on (shares fewer "
                        "tokens with any other than the cache reuses); stage counters checked per burst"}
    print("# setup", json.dumps(setup), flush=True)
    prompts = prompts_for(source.tokenizer, cases, args.reps)
    setup["prompt_tokens"] = {f"{k[0]}x{k[1]}": round(statistics.mean(len(p) for p in v))
                              for k, v in prompts.items() if k[2] == 0}
    print("# prompt tokens", json.dumps(setup["prompt_tokens"]), flush=True)
    refs = references(source, weights, prompts, tokens_for, configs)
    # The coordinator lives in a daemon on a device: here device 0's core, in every configuration.
    pin([0], 1)
    # --quick: the unbatched device only where a figure needs it (4 in flight)
    skip = {("single/unbatched", "burst", n) for n in (1, 2, 8)} if args.quick else set()
    run = lambda cfgs, profile: asyncio.run(measure(cases, cfgs, prompts, tokens_for, args.reps, refs,  # noqa: E731
                                                    n_layers, model, weights, profile, skip))
    # one device first: a pulled model's planner profile is scaled to its measured decode step
    res = run(configs[:2], None)
    home, profile_name = planner_profiles(str(source.path), model is None and weights == "float32",
                                          res[("single/batched", "burst", 1)], args.tokens,
                                          setup["prompt_tokens"]["burstx1"])
    setup["planner_profile"] = profile_name
    res.update(run(forced, home[0].to_dict()))
    choices = planner_choices(cases, prompts, tokens_for, priced_link(args.link), home, tensor)

    rows, worst = [], 0.0
    print("\n| case | " + " | ".join(c.replace("single/", "single, ") for c in configs)
          + " | planner picks | choice / best forced |")
    print("|---|" + "---:|" * len(configs) + "---|---:|")
    for name, n in cases:
        get = lambda c: res.get((c, name, n))  # noqa: E731
        best = min(forced, key=lambda c: get(c)["latency_s"])
        pick = choices[(name, n)]["config"]
        ratio = get(pick)["latency_s"] / get(best)["latency_s"]
        worst = max(worst, ratio)
        cell = lambda c: "—" if get(c) is None else f"{get(c)['latency_s']:.2f} s, {get(c)['tok_s']:.1f} tok/s"  # noqa: E731
        print(f"| {name} ×{n} | " + " | ".join(cell(c) for c in configs) + f" | {pick} | {ratio:.3f} |")
        rows.append({"case": name, "requests": n, "choice": pick, "best_forced": best,
                     "choice_over_best": round(ratio, 3), **{c: get(c) for c in configs if get(c) is not None},
                     "planner": choices[(name, n)]})
    handoff = None
    if ("pipeline", "long", 1) in res:
        handoff = handoff_account(res, setup["prompt_tokens"]["longx1"], home[0])
        print(f"\nlong prompt: the pipeline's first token came {handoff['prefill_saved_s']:.2f} s before a replica's; "
              f"handing its KV ({handoff['kv_mib']:.0f} MiB) to a replica for decoding would take "
              f"{handoff['transfer_s']['100mbit,2ms']:.2f} s at 100 Mbit/s, {handoff['transfer_s']['1gbit,1ms']:.2f} s "
              f"at 1 Gbit/s; pays on: {', '.join(handoff['pays_on']) or 'neither'}")
    b4 = lambda c: res[(c, "burst", 4)]  # noqa: E731
    pick4 = choices[("burst", 4)]["config"]
    pick1 = choices[("burst", 1)]["config"]
    parity = all(v["parity"] for v in res.values())
    one = lambda n: res[("single/batched", "burst", n)]["tok_s"]  # noqa: E731
    # Two replicas at 4 in flight each batch 2: at best twice one device's rate with 2 requests. Over one
    # device batching all 4, that is 2·T(2)/T(4) — the ceiling batching on this device leaves.
    bound = round(2 * one(2) / one(4), 3)
    out = {
        "setup": setup,
        "speedup_4_vs_unbatched": round(b4(pick4)["tok_s"] / b4("single/unbatched")["tok_s"], 3),
        "speedup_4_vs_batched": round(b4(pick4)["tok_s"] / b4("single/batched")["tok_s"], 3),
        "single_vs_best_member": round(res[("single/batched", "burst", 1)]["latency_s"]
                                       / res[(pick1, "burst", 1)]["latency_s"], 3),
        "choice_vs_best_forced": round(worst, 3),
        "replica_ceiling_4_vs_batched": bound,
        "parity": parity,
        "kv_handoff": handoff,
        "cases": rows,
    }
    if tensor:  # every forced layout at 4 in flight over one batched device
        out["forced_4_vs_batched"] = {c: round(b4(c)["tok_s"] / b4("single/batched")["tok_s"], 3) for c in forced}
    print(f"\n4 in flight, the planner's {pick4}: {out['speedup_4_vs_unbatched']}x one unbatched device, "
          f"{out['speedup_4_vs_batched']}x one batched device; one short request: the best member alone takes "
          f"{out['single_vs_best_member']}x the planner's {pick1}; worst choice / best forced "
          f"{out['choice_vs_best_forced']}; parity {parity}")
    print(f"ceiling for two replicas at 4 in flight over one batched device, from this device's own batching "
          f"(2 x {one(2):.1f} tok/s at 2 / {one(4):.1f} at 4): {bound}x")
    if tensor:
        print(f"every forced layout at 4 in flight over one batched device: {out['forced_4_vs_batched']}")
    finish(out, args.out, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
