"""Intra-sequence pipelined prefill across processes vs the baselines it must beat.

Methods, all measured the same way (coordinator → stage processes over the
CURVE transport, TTFT = first chunk sent → first token back):
  single   one stage process with the whole model (one core, one thread)
  naive    2+ stages, the whole prompt as one chunk (EdgeShard-style)
  equal    same stages, the prompt in k equal chunks (k = the planner's k)
  planned  same stages, the planner's cut points (Jupiter's sequence DP)
  sweep    (``--chunk-sweep K1,K2,..``) equal splits into each K chunks, on the
           single device and on the mesh: measured vs predicted per chunk count,
           which is where per-chunk fixed costs the model misses show up
Every pipelined row prints the ideal speedup of k chunks over N equal stages,
k·N/(k+N−1), beside the measured speedup over the single device.
Each stage process is pinned to its own core with one torch thread, so every
method gets the same per-device hardware. Layer ranges come from the layer
planner (the same for naive/equal/planned).

    python bench/pipeline.py [--quick] [--json] [--devices 2] [--lens 128,512,1024,2048]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._cold import COLD_UNSEEN, CacheGuard, unseen  # noqa: E402
from bench._common import emit_json, machine_banner  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PROFILE = ROOT / "profiles" / "x86_64-2core-1thread.json"
VOCAB = 49152  # SmolLM2's: every timed prompt's first token is a new one below it (bench._cold.unseen)
_serials = itertools.count()


def load_prompt_sets(include_shared: bool = True) -> list[dict]:
    sets = [ROOT / "bench" / "prompts" / "home.jsonl"]
    shared = ROOT.parent / "shared" / "prompts"
    if include_shared and shared.is_dir():
        sets += sorted(shared.glob("*.jsonl"))
    out = []
    for f in sets:
        for line in f.read_text().splitlines():
            if line.strip():
                o = json.loads(line)
                o["source"] = f.name
                out.append(o)
    return out


def synthetic_prompt(tok, n: int) -> list[int]:
    """Exactly n tokens of home-event-log text (deterministic)."""
    text = "\n".join(p["prompt"] for p in load_prompt_sets(False) if p["category"] == "event_log")
    ids = tok.encode(text)
    while len(ids) < n:
        ids = ids + ids
    return ids[:n]


def planner(n_devices: int, link_spec: str, max_seq: int, profile_path: Path = PROFILE):
    from partition import profile as prof
    from partition.link import parse_link
    from partition.planner import make_plan
    from partition.scaling import scale

    base = prof.load(profile_path)
    profiles = [scale(base, 1.0, device_id=f"dev{i}") for i in range(n_devices)]
    link = parse_link(link_spec) if link_spec not in ("none", "unshaped") else parse_link("10gbit,0.1ms")
    return make_plan(profiles, link, max_seq), profiles, link


def fresh_profile() -> Path:
    """Profile this machine now (one core, one thread, like every stage here) into bench/results/."""
    out = ROOT / "bench" / "results" / "pipeline_profile_fresh.json"
    print("measuring a fresh device profile (core 0, 1 thread) ...", file=sys.stderr, flush=True)
    subprocess.run(["taskset", "-c", "0", sys.executable, "-m", "meshd", "profile", "-o", str(out),
                    "--force", "--no-progress", "--threads", "1"], check=True, stdout=sys.stderr)
    return out


def equal_cuts(n: int, k: int) -> tuple[int, ...]:
    return tuple(round(n * i / k) for i in range(1, k))


def pipeline_bound(chunks: int, stages: int) -> float:
    """Best speedup of ``chunks`` equal chunks over ``stages`` equal stages (fill + drain)."""
    return chunks * stages / (chunks + stages - 1)


def overhead_fit(rows: list[dict]) -> dict | None:
    """Per-chunk cost the model misses: slope of (measured − predicted) over the chunk count.

    Least squares over the sweep rows of one method and prompt length; the
    intercept is the per-request cost (first chunk out → token back).
    """
    pts = [(r["chunks"], r["ttft_s"] - r["predicted_ttft_s"]) for r in rows]
    if len(pts) < 2 or len({k for k, _ in pts}) < 2:
        return None
    import numpy as np

    k = np.array([p[0] for p in pts], dtype=float)
    e = np.array([p[1] for p in pts], dtype=float)
    slope, icpt = np.polyfit(k, e, 1)
    return {"per_chunk_s": float(slope), "per_request_s": float(icpt), "points": len(pts)}


async def measure(mesh, guard: CacheGuard, what: str, ids, cuts, decode_tokens: int, reps: int,
                  vocab_size: int = VOCAB) -> dict:
    """Cold TTFT: every rep's prompt is one no stage has seen (same length, same cuts), and the stages'
    counters must show nothing reused while it ran."""
    from decoding.sampling import SamplingSpec
    from tests.support.coordinator import generate_on

    ttfts, decode_rates = [], []
    for r in range(reps):
        fresh = unseen(ids, next(_serials), vocab_size)
        async with guard.cold(f"{what} rep {r}"):
            t0 = time.perf_counter()
            t_first = None
            n = 0
            async for _ in generate_on(mesh.coord, f"m{time.monotonic_ns()}", fresh, 1 + decode_tokens,
                                       SamplingSpec(), (), cuts=list(cuts)):
                n += 1
                if t_first is None:
                    t_first = time.perf_counter()
            t_end = time.perf_counter()
        ttfts.append(t_first - t0)
        if n > 1:
            decode_rates.append((n - 1) / (t_end - t_first))
    return {"ttft_s": statistics.median(ttfts), "ttft_all_s": ttfts,
            "decode_tokens_per_s": statistics.median(decode_rates) if decode_rates else None}


async def concurrent_decode(mesh, guard: CacheGuard, ids, n_requests: int, tokens: int) -> float:
    """Aggregate decode tokens/s with ``n_requests`` generating at once (each its own unseen prompt
    the length of ``ids``: none shares another's prefill)."""
    from decoding.sampling import SamplingSpec
    from tests.support.coordinator import generate_on

    stamps: list[float] = []

    async def one(i, prompt):
        async for _ in generate_on(mesh.coord, f"c{i}-{time.monotonic_ns()}", prompt, tokens, SamplingSpec(), ()):
            stamps.append(time.perf_counter())

    prompts = [unseen(ids, next(_serials), VOCAB) for _ in range(n_requests)]
    async with guard.cold(f"{n_requests} concurrent requests"):
        await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    stamps.sort()
    # from the first token anywhere to the last: decode throughput of the whole mesh
    return (len(stamps) - n_requests) / (stamps[-1] - stamps[0])


async def parity(mesh, tok, prompts, max_tokens: int, cuts_for) -> dict:
    from decoding.generate import generate
    from decoding.pipeline_local import LocalPipeline
    from decoding.sampling import SamplingSpec
    from meshd.model.store import open_model
    from tests.support.coordinator import generate_on

    src = open_model(None)
    ref = LocalPipeline.from_source(src, 1)
    bad = []
    for p in prompts:
        ids = tok.apply_chat([{"role": "user", "content": p["prompt"]}])
        want = generate(ref, ids, max_tokens, eos_ids=tok.eos_ids).token_ids
        got = [t async for t in generate_on(mesh.coord, f"p-{p['id']}", ids, max_tokens, SamplingSpec(),
                                            tok.eos_ids, cuts=list(cuts_for(len(ids))))]
        got = [t for t in got if t not in tok.eos_ids]
        if got != want:
            bad.append(p.get("id"))
    return {"checked": len(prompts), "mismatches": bad, "ok": not bad}


class InNetns:
    """Move this process's network namespace (so sockets created afterwards live there)."""

    CLONE_NEWNET = 0x40000000

    def __init__(self, ns_name: str):
        self.target = f"/var/run/netns/{ns_name}"

    def _setns(self, path: str) -> None:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        fd = os.open(path, os.O_RDONLY)
        try:
            if libc.setns(fd, self.CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), f"setns({path}) failed")
        finally:
            os.close(fd)

    def __enter__(self):
        self.home = os.open("/proc/self/ns/net", os.O_RDONLY)
        self._setns(self.target)
        return self

    def __exit__(self, *exc):
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.setns(self.home, self.CLONE_NEWNET)
        os.close(self.home)


async def parity_by_stage_count(args, tok, counts: list[int]) -> dict:
    """Mesh greedy output vs the reference on our own prompt set, for K evenly split stages."""
    from decoding.pipeline_local import even_split
    from meshd.pipeline.coordinator.cuts import default_cuts
    from tests.support.proc_mesh import ProcessMesh

    ncpu = os.cpu_count() or 1
    out = {}
    for k in counts:
        print(f"parity with {k} stages ...", file=sys.stderr, flush=True)
        async with ProcessMesh(even_split(30, k), cores=[[i % ncpu] for i in range(k)], threads=1) as mesh:
            res = await parity(mesh, tok, load_prompt_sets(False), args.parity_tokens,
                               lambda n, k=k: default_cuts(n, k))
        out[str(k)] = res
        print(f"parity with {k} stages: {res['checked'] - len(res['mismatches'])}/{res['checked']} identical",
              flush=True)
    return out


async def run_link(args, link_spec: str, tok, lens, prompts, runs: list, tb=None) -> dict:
    """All methods over one link setting; ``tb`` is a testbed when the link is shaped."""
    from tests.support.proc_mesh import ProcessMesh
    from partition.planner import predict_prefill_s

    plan, profiles, _ = planner(args.devices, link_spec, max(lens), args.profile_path)
    ranges = plan.layer_ranges  # half-open [first, end)
    sweep = [int(x) for x in args.chunk_sweep.split(",") if x.strip()] if args.chunk_sweep else []
    single_plan, single_prof, _ = planner(1, link_spec, max(lens), args.profile_path)
    ncpu = os.cpu_count() or 1
    cores = [[i % ncpu] for i in range(len(ranges))]
    mesh_kw: dict = {}
    if tb is not None:
        mesh_kw = dict(
            hosts=[tb.host(i).ip for i in range(len(ranges))], coordinator_host=tb.host(0).ip,
            launcher=lambda i, argv: tb.host(i).popen(argv, cores=cores[i], env=dict(os.environ),
                                                      stdout=subprocess.PIPE, text=True),
            # the coordinator shares host 0 with stage 0; every other hop crosses the link
            reach=lambda i, host, port: (host, port) if i == 0 else tb.delayed_address(max(i, 0), port))

    single_ttft: dict[int, float] = {}

    def row(method, n, cuts, res, pred):
        stages = 1 if method.startswith("single") else len(ranges)
        r = {"method": method, "prompt_len": n, "chunks": len(cuts) + 1, "cuts": list(cuts),
             "ttft_s": res["ttft_s"], "prefill_tokens_per_s": n / res["ttft_s"],
             "decode_tokens_per_s": res["decode_tokens_per_s"], "predicted_ttft_s": pred,
             "stages": stages, "link": link_spec,
             "layer_ranges": ranges if stages > 1 else [(0, plan.num_layers)]}
        if method == "single":
            single_ttft[n] = res["ttft_s"]
        extra = ""
        if stages > 1 and n in single_ttft:
            r["speedup_vs_single"] = single_ttft[n] / res["ttft_s"]
            r["bound"] = pipeline_bound(r["chunks"], stages)
            extra = f" speedup {r['speedup_vs_single']:.2f}x (bound {r['bound']:.2f}x)"
        runs.append(r)
        print(f"[{link_spec}] {method:>8} n={n:>5} chunks={r['chunks']:>2} TTFT {r['ttft_s']:.3f}s "
              f"(pred {pred:.3f}s, {(pred - res['ttft_s']) / res['ttft_s'] * 100:+.0f}%){extra} "
              f"prefill {r['prefill_tokens_per_s']:.0f} tok/s "
              f"decode {r['decode_tokens_per_s'] or 0:.1f} tok/s", flush=True)

    print(f"[{link_spec}] single device ...", file=sys.stderr, flush=True)
    # one stage: the coordinator and the only stage share host 0, so no hop crosses the link
    single_kw = dict(mesh_kw, hosts=mesh_kw["hosts"][:1], reach=None) if tb is not None else {}
    conc: dict = {"single": {}, "pipeline": {}}
    levels = [int(x) for x in args.concurrency.split(",")] if args.concurrency and tb is None else []
    async with ProcessMesh([(0, plan.num_layers)], cores=[[0]], threads=1, **single_kw) as mesh:
        guard = CacheGuard(mesh.reused_tokens)
        # untimed: a process's first forwards of each shape are several times slower (both meshes alike)
        await measure(mesh, guard, f"[{link_spec}] single warm-up", prompts[lens[0]], (), 2, 1)
        for n in lens:
            res = await measure(mesh, guard, f"[{link_spec}] single n={n}", prompts[n], (), args.decode_tokens,
                                args.reps)
            row("single", n, (), res, predict_prefill_s(single_plan, single_prof, n, ()))
            for k in sweep:
                cuts = equal_cuts(n, k)
                res = await measure(mesh, guard, f"[{link_spec}] single n={n} k={k}", prompts[n], cuts, 0, args.reps)
                row("single-sweep", n, cuts, res, predict_prefill_s(single_plan, single_prof, n, cuts))
        for c in levels:
            conc["single"][c] = await concurrent_decode(mesh, guard, prompts[lens[0]], c, 32)
        checked = guard.summary()
    par = None
    bytes_out = 0
    if len(ranges) > 1:
        print(f"[{link_spec}] {len(ranges)}-stage mesh {ranges} ...", file=sys.stderr, flush=True)
        async with ProcessMesh(ranges, cores=cores, threads=1, activation_dtype=args.activation_dtype,
                               **mesh_kw) as mesh:
            guard = CacheGuard(mesh.reused_tokens)
            await measure(mesh, guard, f"[{link_spec}] mesh warm-up", prompts[lens[0]],
                          plan.cut_table.lookup(lens[0]), 2, 1)  # untimed, as for the single device
            for n in lens:
                planned = plan.cut_table.lookup(n)
                k = len(planned) + 1
                for method, cuts in (("naive", ()), ("equal", equal_cuts(n, k)), ("planned", planned)):
                    res = await measure(mesh, guard, f"[{link_spec}] {method} n={n}", prompts[n], cuts,
                                        args.decode_tokens, args.reps)
                    row(method, n, cuts, res, predict_prefill_s(plan, profiles, n, cuts))
                for kk in sweep:
                    cuts = equal_cuts(n, kk)
                    res = await measure(mesh, guard, f"[{link_spec}] sweep n={n} k={kk}", prompts[n], cuts, 0,
                                        args.reps)
                    row("sweep", n, cuts, res, predict_prefill_s(plan, profiles, n, cuts))
            for c in levels:
                conc["pipeline"][c] = await concurrent_decode(mesh, guard, prompts[lens[0]], c, 32)
            if levels:
                print(f"[{link_spec}] aggregate decode tokens/s by concurrent requests "
                      f"(prompt {lens[0]}, 32 tokens each): single {conc['single']}, "
                      f"{len(ranges)}-stage pipeline {conc['pipeline']}", flush=True)
            if args.parity and tb is None:
                par = await parity(mesh, tok, load_prompt_sets(not args.no_shared)[: args.parity_prompts or None],
                                   args.parity_tokens, lambda n: plan.cut_table.lookup(min(n, plan.max_seq)))
            mesh_checked = guard.summary()
            checked = {k: checked[k] + mesh_checked[k] for k in checked}
        bytes_out = sum(s.get("activation_bytes_out", 0) for s in mesh.stats)
    mesh_tokens = sum(r["prompt_len"] for r in runs if r["method"] != "single" and r["link"] == link_spec)
    fits = {}
    for method in ("single-sweep", "sweep"):
        for n in lens:
            fit = overhead_fit([r for r in runs if r["method"] == method and r["prompt_len"] == n
                                and r["link"] == link_spec])
            if fit:
                fits[f"{method}/{n}"] = fit
                print(f"[{link_spec}] {method} n={n}: the model misses {fit['per_chunk_s'] * 1e3:+.2f} ms per "
                      f"chunk and {fit['per_request_s'] * 1e3:+.1f} ms per request", flush=True)
    return {"link": link_spec, "layer_ranges": ranges, "parity": par, "concurrent_decode_tokens_per_s": conc,
            "prefix_cache_check": checked,
            "unmodelled_cost": fits,
            "activation_bytes_per_prompt_token": bytes_out / max(mesh_tokens * args.reps, 1),
            "planner_bottleneck": plan.bottleneck_reason}


async def run(args) -> dict:
    import torch

    from meshd.model.store import open_model

    torch.set_num_threads(1)
    tok = open_model(None).tokenizer
    lens = [int(x) for x in args.lens.split(",")]
    links = [x.strip() for x in args.links.split(";") if x.strip()]
    setup = machine_banner() | {
        "model": "SmolLM2-135M-Instruct Q4_1 GGUF -> float32", "devices": args.devices,
        "threads_per_stage": 1, "stage_cores": "stage i pinned to core i % ncpu",
        "single_device": "1 stage process, core 0, 1 thread (same transport path)",
        "prompt_lengths": lens, "links": links, "reps": args.reps, "decode_tokens": args.decode_tokens,
        "profile": str(args.profile_path.name), "transport": f"CURVE on, {args.activation_dtype or 'float32'} activations",
        "ttft": "median over reps; first chunk sent -> first token back at the coordinator",
        "prompts": COLD_UNSEEN,
    }
    print("setup:", json.dumps(setup), flush=True)
    prompts = {n: synthetic_prompt(tok, n) for n in lens}
    runs: list = []
    per_link = []
    if len(links) > 1:
        # One fresh process per link setting: each gets its own testbed and network
        # namespace, and nothing of one setting's sockets or threads leaks into the next.
        for spec in links:
            argv = [sys.executable, __file__, "--json", "--links", spec, "--lens", args.lens,
                    "--reps", str(args.reps), "--decode-tokens", str(args.decode_tokens),
                    "--devices", str(args.devices), "--parity-tokens", str(args.parity_tokens),
                    "--parity-prompts", str(args.parity_prompts), "--plot", "", "--parity-stages", "",
                    "--concurrency", args.concurrency, "--chunk-sweep", args.chunk_sweep,
                    "--profile", str(args.profile_path)]
            argv += ["--activation-dtype", args.activation_dtype] if args.activation_dtype else []
            argv += (["--no-shared"] if args.no_shared else []) + ([] if args.parity else ["--no-parity"])
            out = subprocess.run(argv, stdout=subprocess.PIPE, text=True)
            lines = [ln for ln in out.stdout.splitlines() if ln.startswith("[")]
            print("\n".join(lines), flush=True)
            if out.returncode != 0:
                print(f"[{spec}] failed (exit {out.returncode}); see its stderr above", file=sys.stderr)
                continue
            sub = json.loads(out.stdout.strip().splitlines()[-1])
            runs += sub["runs"]
            per_link += sub["links"]
    for spec in (links if len(links) == 1 else []):
        if spec in ("none", "unshaped"):
            per_link.append(await run_link(args, "unshaped", tok, lens, prompts, runs))
            continue
        from bench.testbed import LinkSpec, Testbed

        with Testbed(args.devices, LinkSpec.parse(spec), name_prefix="meshd-bp") as tb:
            if tb.mode != "netns":
                print(f"[{spec}] testbed fell back to loopback: link not shaped, skipped", file=sys.stderr)
                continue
            with InNetns(tb.host(0).ns):
                per_link.append(await run_link(args, spec, tok, lens, prompts, runs, tb))
    stage_parity = {}
    if args.parity_stages:
        stage_parity = await parity_by_stage_count(args, tok, [int(x) for x in args.parity_stages.split(",")])
    by = {(r["link"], r["method"], r["prompt_len"]): r for r in runs}
    key_len = 1024 if 1024 in lens else lens[-1]
    base = "unshaped" if "unshaped" in [p["link"] for p in per_link] else per_link[0]["link"]
    single, naive = by[(base, "single", key_len)], by.get((base, "naive", key_len))
    planned, equal = by.get((base, "planned", key_len)), by.get((base, "equal", key_len))
    par = next((p["parity"] for p in per_link if p["parity"] is not None), None)
    summary = {
        "parity": bool(par and par["ok"]), "parity_detail": par,
        "speedup_vs_single": single["ttft_s"] / planned["ttft_s"] if planned else None,
        "speedup_vs_naive": naive["ttft_s"] / planned["ttft_s"] if planned else None,
        "planned_vs_equal": equal["ttft_s"] / planned["ttft_s"] if planned else None,
        "predicted_ttft_s": planned["predicted_ttft_s"] if planned else None,
        "measured_ttft_s": planned["ttft_s"] if planned else None,
        "prediction_rel_error": ((planned["predicted_ttft_s"] - planned["ttft_s"]) / planned["ttft_s"]
                                 if planned else None),
        "key_case": {"link": base, "prompt_len": key_len, "devices": args.devices},
        "parity_by_stage_count": stage_parity,
        "links": per_link, "setup": setup, "runs": runs,
    }
    if planned:
        print(f"\n{args.devices} devices, {base}, {key_len}-token prompt: planned TTFT {planned['ttft_s']:.3f}s "
              f"= {summary['speedup_vs_single']:.2f}x single, {summary['speedup_vs_naive']:.2f}x naive, "
              f"{summary['planned_vs_equal']:.2f}x equal; predicted {planned['predicted_ttft_s']:.3f}s "
              f"({summary['prediction_rel_error'] * 100:+.0f}%); parity "
              f"{'OK' if summary['parity'] else 'FAILED'} ({par['checked'] if par else 0} prompts)")
    if args.plot and runs:
        plot(runs, Path(args.plot))
    return summary


def plot(runs, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    links = list(dict.fromkeys(r["link"] for r in runs))
    fig, axes = plt.subplots(1, len(links), figsize=(5.5 * len(links), 4), squeeze=False)
    for ax, link in zip(axes[0], links):
        for method in ("single", "naive", "equal", "planned"):
            pts = sorted((r["prompt_len"], r["ttft_s"]) for r in runs
                         if r["method"] == method and r["link"] == link)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=method)
        ax.set_xlabel("prompt length (tokens)")
        ax.set_ylabel("TTFT (s)")
        ax.set_title(f"link: {link}")
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle("TTFT vs prompt length — SmolLM2-135M, 1 core + 1 thread per device")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--quick", action="store_true",
                    help="2 devices, unshaped, 1024-token prompt + parity check (< 5 min)")
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--lens", default="128,512,1024,2048")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--decode-tokens", type=int, default=16)
    ap.add_argument("--parity-tokens", type=int, default=32)
    ap.add_argument("--parity-prompts", type=int, default=0, help="limit the parity set (0 = all)")
    ap.add_argument("--no-shared", action="store_true", help="ignore ../shared/prompts")
    ap.add_argument("--links", default="unshaped;1gbit,1ms;100mbit,4ms",
                    help="';'-separated link settings (shaped ones need root for network namespaces)")
    ap.add_argument("--no-parity", dest="parity", action="store_false")
    ap.add_argument("--concurrency", default="1,2,4",
                    help="aggregate decode throughput with this many requests at once (unshaped link)")
    ap.add_argument("--parity-stages", default="3,4",
                    help="also check parity on our prompt set with these stage counts ('' = skip)")
    ap.add_argument("--chunk-sweep", default="",
                    help="also time equal splits into each of these chunk counts, e.g. 1,2,4,8,16,32")
    ap.add_argument("--profile", default=str(PROFILE),
                    help="device profile the predictions use: a file, or 'fresh' to measure this machine "
                         "first (~1 min, core 0, one thread): a profile from another day predicts another "
                         "machine state")
    ap.add_argument("--activation-dtype", default=None, choices=("float16", "bfloat16"),
                    help="send activations between stages in this dtype instead of float32 (halves the bytes; "
                         "the parity check says whether the tokens stay the same)")
    ap.add_argument("--plot", default=str(ROOT / "bench" / "results" / "pipeline_ttft.png"))
    args = ap.parse_args()
    args.profile_path = fresh_profile() if args.profile == "fresh" else Path(args.profile)
    if args.quick:
        args.lens, args.reps, args.plot, args.links, args.parity_stages = "1024", 2, None, "unshaped", ""
        args.parity_prompts = args.parity_prompts or 12  # within 5 minutes; the full run checks every prompt
        args.concurrency = ""
    summary = asyncio.run(run(args))
    if args.json:
        emit_json(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
