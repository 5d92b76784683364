"""A fast and a slow device: planned as equals vs planned by the speed each measured of itself.

Without a profile of its own, every member is planned from the shipped profile, so
a slow device looks like a fast one, gets half the layers and sets the pace. A
daemon now times one decoder layer at start-up (``meshd.model.self_profile``). This
benchmark shows what that changes, on real stage processes:

  fast alone      one stage process with the whole model (core 0, one thread)
  as equals       fast + slow, planned with the shipped profile for both
  self-profiled   fast + slow, planned with the profiles the one-layer timing gave

The slow device is a stage process on core 1 whose CPU share is capped by a
cgroup (v1 ``cpu`` controller, 10 ms period; needs root), like a NAS or a
container with a CPU quota. Its speed is measured the way the daemon measures
itself: ``meshd.model.profiler.estimate_speed`` on the wall clock, inside the cap.

    python bench/heterogeneous.py [--quick] [--json] [--share 0.3] [--lens 512,1024]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._cold import COLD_UNSEEN, CacheGuard  # noqa: E402
from bench._common import finish, machine_banner  # noqa: E402
from bench.pipeline import PROFILE, measure, synthetic_prompt  # noqa: E402

CGROUP = Path("/sys/fs/cgroup/cpu/meshd-bench-slow")
PERIOD_US = 10_000

SPEED = """
import sys, time, torch
from meshd.model.store import open_model
from meshd.model.profiler import estimate_speed
from partition import profile as pf
torch.set_num_threads(1)
print(estimate_speed(open_model(None), pf.load(sys.argv[1]), threads=1, repeats=5, clock=time.perf_counter))
"""


def make_cgroup(share: float) -> None:
    if not Path("/sys/fs/cgroup/cpu").is_dir() or os.geteuid() != 0:
        sys.exit("needs root and the cgroup v1 cpu controller (/sys/fs/cgroup/cpu) to cap the slow device")
    CGROUP.mkdir(exist_ok=True)
    (CGROUP / "cpu.cfs_period_us").write_text(str(PERIOD_US))
    (CGROUP / "cpu.cfs_quota_us").write_text(str(max(1000, int(share * PERIOD_US))))


def capped(argv: list[str], core: int) -> list[str]:
    """``argv`` on ``core``, inside the slow device's CPU cap."""
    return ["sh", "-c", f'echo $$ > {CGROUP}/tasks && exec taskset -c {core} "$@"', "sh", *argv]


def measure_speed(slow: bool) -> float:
    argv = [sys.executable, "-c", SPEED, str(PROFILE)]
    argv = capped(argv, 1) if slow else ["taskset", "-c", "0", *argv]
    out = subprocess.run(argv, check=True, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(
        Path(__file__).resolve().parent.parent)})
    return float(out.stdout.strip().splitlines()[-1])


async def run_config(name: str, plan, lens, prompts, args) -> dict:
    from tests.support.proc_mesh import ProcessMesh, stage_env

    ranges = [(s.first, s.end) for s in plan.stages]
    who = [str(s.node_id) for s in plan.stages]
    cores = [[1] if w == "slow" else [0] for w in who]

    def launcher(i, argv):
        argv = capped(argv, 1) if who[i] == "slow" else argv
        return subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, start_new_session=True, env=stage_env())

    out = {"config": name, "stages": [{"device": w, "layers": list(r)} for w, r in zip(who, ranges)], "rows": []}
    print(f"{name}: stages {', '.join(f'{w} {a}-{b - 1}' for w, (a, b) in zip(who, ranges))}", flush=True)
    async with ProcessMesh(ranges, cores=cores, threads=1, launcher=launcher) as mesh:
        guard = CacheGuard(mesh.reused_tokens)
        for n in lens:
            cuts = tuple(plan.cut_table.lookup(n)) if plan.cut_table and len(ranges) > 1 else ()
            res = await measure(mesh, guard, f"{name} n={n}", prompts[n], cuts, args.decode_tokens, args.reps)
            row = {"prompt_len": n, "chunks": len(cuts) + 1, "ttft_s": res["ttft_s"],
                   "decode_tokens_per_s": res["decode_tokens_per_s"]}
            out["rows"].append(row)
            print(f"  {n:>5} tokens: TTFT {row['ttft_s']:.3f} s ({row['chunks']} chunks), decode "
                  f"{row['decode_tokens_per_s'] or 0:.1f} tok/s", flush=True)
    return out


async def main_async(args) -> dict:
    from meshd.model.store import open_model
    from partition import profile as pf
    from partition.link import parse_link
    from partition.planner import make_plan
    from partition.scaling import scale

    lens = [int(x) for x in args.lens.split(",")]
    make_cgroup(args.share)
    print(machine_banner(), flush=True)
    print(f"fast device: core 0, 1 torch thread; slow device: core 1, 1 torch thread, capped at "
          f"{args.share:.0%} of the core (cgroup cpu quota, {PERIOD_US // 1000} ms period); CURVE on, loopback; "
          f"{args.reps} repetitions (median), {args.decode_tokens} decode tokens", flush=True)
    speed = {"fast": measure_speed(False), "slow": measure_speed(True)}
    print(f"one-layer timing (wall clock, as the daemon measures itself): fast {speed['fast']:.2f}x, "
          f"slow {speed['slow']:.2f}x the shipped profile", flush=True)
    base = pf.load(PROFILE)
    link = parse_link("10gbit,0.1ms")
    max_seq = max(lens)
    plans = {
        "fast alone": make_plan([scale(base, speed["fast"], device_id="fast")], link, max_seq),
        "as equals": make_plan([scale(base, 1.0, device_id=d) for d in ("fast", "slow")], link, max_seq),
        "self-profiled": make_plan([scale(base, speed[d], device_id=d) for d in ("fast", "slow")], link, max_seq),
    }
    tok = open_model(None).tokenizer
    prompts = {n: synthetic_prompt(tok, n) for n in lens}
    results = [await run_config(name, plan, lens, prompts, args) for name, plan in plans.items()]
    alone = {r["prompt_len"]: r for r in results[0]["rows"]}
    print("\nagainst the fast device alone (>1: faster):")
    for res in results[1:]:
        for r in res["rows"]:
            a = alone[r["prompt_len"]]
            r["ttft_vs_fast_alone"] = a["ttft_s"] / r["ttft_s"]
            if r["decode_tokens_per_s"] and a["decode_tokens_per_s"]:
                r["decode_vs_fast_alone"] = r["decode_tokens_per_s"] / a["decode_tokens_per_s"]
            print(f"  {res['config']:>13} {r['prompt_len']:>5} tokens: TTFT {r['ttft_vs_fast_alone']:.2f}x, "
                  f"decode {r.get('decode_vs_fast_alone', 0):.2f}x", flush=True)
    return {"bench": "heterogeneous", "share": args.share, "speeds": speed, "lens": lens, "reps": args.reps,
            "decode_tokens": args.decode_tokens, "configs": results,
            "setup": {"fast": "core 0, 1 torch thread", "slow": f"core 1, 1 torch thread, {args.share:.0%} CPU quota",
                      "link": "loopback, CURVE on", "profile": str(PROFILE.relative_to(PROFILE.parent.parent)),
                      "prompts": COLD_UNSEEN, **machine_banner()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one prompt length, fewer repetitions (< 5 min)")
    ap.add_argument("--json", action="store_true", help="print one JSON object last")
    ap.add_argument("--share", type=float, default=0.3, help="CPU share of a core the slow device gets")
    ap.add_argument("--lens", default="512,1024")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--decode-tokens", type=int, default=16)
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args()
    if args.quick:
        args.lens, args.reps, args.decode_tokens = "512", 2, 12
    try:
        result = asyncio.run(main_async(args))
    finally:
        if CGROUP.is_dir():
            try:
                CGROUP.rmdir()
            except OSError:
                pass
    finish(result, args.out, args.json)


if __name__ == "__main__":
    main()
