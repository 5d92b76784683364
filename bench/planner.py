"""Planner benchmark: planning time vs S_max and |D|, and predicted vs measured prefill.

Part 1 — planning time. For S_max in {512, 1024, 2048} and |D| in {2, 3, 4, 8}
devices (the shipped profile scaled to a mix of speeds and memory sizes, one
``--link`` between them), times ``make_plan``: the layer DP (exact search over
device subsets and orders) plus the whole sequence-partition cut table for
every prompt length <= S_max and k <= 4|D| chunks. Side by side in the same
run: the vectorised sequence DP against a plain-Python loop of the same
recurrence (at a small S_max, the loop is O(k·S²) interpreted steps).

Part 2 — prediction accuracy. Loads the embedded model (``--threads`` torch
threads, default 1 as in the profile) and measures in-process prefill with
the stage runtime for several prompt lengths, one chunk and the equal-chunk
split, comparing with the profile's prediction for the same chunks on one
device. Times are read on the thread's CPU clock when threads == 1 (the
profile's clock; the machine may be shared) and on the wall clock.

Part 3 — the distributed pipeline (later issue). ``measured_vs_predicted``
below is the hook: give it the plan, profiles, prompt length and the TTFT
measured by the pipeline benchmark; it returns the relative error (target
<= 15 %). ``--measured-ttft LEN=SECONDS`` feeds such numbers from the command
line with ``--profile`` files describing the devices that ran them.

    .venv/bin/python bench/planner.py [--json] [--quick] [--skip-measure]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from partition import profile as pf  # noqa: E402
from partition.link import parse_link  # noqa: E402
from partition.plan import Plan  # noqa: E402
from partition.planner import make_plan, predict_prefill_s, prediction_error  # noqa: E402
from partition.scaling import parse_profile_arg, scale  # noqa: E402
from partition.sequence import StageTiming, chunk_cost_matrix, minmax_table  # noqa: E402

SHIPPED = ROOT / "profiles" / "x86_64-2core-1thread.json"
SPEEDS = (1.0, 0.6, 1.5, 0.8, 2.0, 0.5, 1.2, 0.9)
MEMORY_GIB = (8, 4, 16, 3, 8, 2, 6, 4)


def measured_vs_predicted(plan: Plan, profiles, prompt_len: int, measured_ttft_s: float) -> dict:
    """The hook for the pipeline benchmark: prediction error of the planned partition."""
    return prediction_error(plan, profiles, prompt_len, measured_ttft_s)


def home(base: pf.DeviceProfile, n: int) -> list[pf.DeviceProfile]:
    return [scale(base, SPEEDS[i], MEMORY_GIB[i] * 2**30, device_id=f"dev{i}") for i in range(n)]


def naive_minmax(T: np.ndarray, k_max: int, b: int) -> np.ndarray:
    """The sequence DP as plain Python loops (the reference the vectorised one replaces)."""
    n = T.shape[0]
    W = [[float("inf")] * n for _ in range(k_max + 1)]
    for y in range(n):
        W[1][y] = T[y, 0] if y >= b else float("inf")
    rows = T.tolist()
    for k in range(2, k_max + 1):
        prev = W[k - 1]
        for y in range(n):
            row = rows[y]
            best = float("inf")
            for l in range(0, y - b + 1):
                v = prev[l] if prev[l] > row[l] else row[l]
                if v < best:
                    best = v
            W[k][y] = best
    return np.array(W[1:])


def planning_times(base, link, seqs, ds, reps):
    rows = []
    for S in seqs:
        for n in ds:
            profs = home(base, n)
            times, layer_times = [], []
            plan = None
            for _ in range(reps):
                t0 = time.perf_counter()
                make_plan(profs, link, S, with_cut_table=False)
                layer_times.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                plan = make_plan(profs, link, S)
                times.append(time.perf_counter() - t0)
            rows.append({
                "max_seq": S, "devices": n, "stages": len(plan.stages),
                "k_max": plan.cut_table.k_max,
                "layer_dp_s": statistics.median(layer_times),
                "total_s": statistics.median(times),
                "bottleneck_s": plan.predicted_bottleneck_s, "reason": plan.bottleneck_reason,
            })
            r = rows[-1]
            print(f"  S_max={S:5d} |D|={n}  stages={r['stages']} k<={r['k_max']:2d}  "
                  f"layer DP {r['layer_dp_s'] * 1e3:7.1f} ms  total {r['total_s']:6.2f} s  "
                  f"bottleneck {r['bottleneck_s']:.2f} s ({r['reason']})", flush=True)
    return rows


def vectorised_vs_loop(base, S=256):
    profs = home(base, 4)
    plan = make_plan(profs, parse_link("100mbit,2ms"), S, with_cut_table=False)
    by_id = {p.device_id: p for p in profs}
    stages = [StageTiming(by_id[s.node_id], s.num_layers, s.has_embedding, s.has_head_of(plan.num_layers), None)
              for s in plan.stages]
    T = chunk_cost_matrix(stages, S)
    k_max, b = 4 * len(stages), 16
    t0 = time.perf_counter()
    W_vec, _, _ = minmax_table(T, k_max, b)
    t_vec = time.perf_counter() - t0
    t0 = time.perf_counter()
    W_loop = naive_minmax(T, k_max, b)
    t_loop = time.perf_counter() - t0
    same = bool(np.allclose(W_vec[1:], W_loop, equal_nan=True))
    return {"max_seq": S, "k_max": k_max, "vectorised_s": t_vec, "loop_s": t_loop,
            "speedup": t_loop / t_vec, "identical": same}


def measure_prefill(base, lengths, threads, chunks_list):
    import torch

    from meshd.model.store import open_model

    torch.set_num_threads(threads)
    src = open_model(None)
    stage = src.load_stage(0, src.config.num_layers)
    plan = make_plan([base], parse_link("local"), max(lengths))
    out = []
    clock = time.thread_time if threads == 1 else time.perf_counter
    rng = torch.Generator().manual_seed(0)
    # warm-up
    kv = stage.new_cache(1 << 16)
    kv.create("w", 256)
    stage.forward(kv, "w", torch.randint(0, 1000, (128,), generator=rng), all_logits=False)
    for y in lengths:
        ids = torch.randint(0, src.config.vocab_size, (y,), generator=rng)
        for chunks in chunks_list:
            cuts = tuple(int(c) for c in np.linspace(0, y, chunks + 1)[1:-1].round())
            cpu, wall = [], []
            for rep in range(2):
                kv = stage.new_cache(1 << 16)
                kv.create("s", y)
                bounds = (0, *cuts, y)
                c0, w0 = clock(), time.perf_counter()
                for a, b in zip(bounds, bounds[1:]):
                    stage.forward(kv, "s", ids[a:b], all_logits=False)
                cpu.append(clock() - c0)
                wall.append(time.perf_counter() - w0)
            pred = predict_prefill_s(plan, [base], y, cuts)
            row = {"prompt_len": y, "chunks": chunks, "predicted_s": pred,
                   "measured_cpu_s": min(cpu), "measured_wall_s": min(wall),
                   "rel_error_cpu": (pred - min(cpu)) / min(cpu),
                   "rel_error_wall": (pred - min(wall)) / min(wall)}
            out.append(row)
            print(f"  prompt {y:5d} in {chunks} chunk(s): predicted {pred:6.3f} s  measured "
                  f"{min(cpu):6.3f} s cpu / {min(wall):6.3f} s wall  error "
                  f"{row['rel_error_cpu'] * 100:+5.1f}% cpu / {row['rel_error_wall'] * 100:+5.1f}% wall",
                  flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--quick", action="store_true", help="S_max 512 only, one repeat")
    ap.add_argument("--skip-measure", action="store_true", help="skip the model measurement part")
    ap.add_argument("--profile", action="append", default=None,
                    help="base profile (default: profiles/x86_64-2core-1thread.json)")
    ap.add_argument("--link", default="100mbit,2ms")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--measured-ttft", action="append", default=[], metavar="LEN=SECONDS",
                    help="TTFT measured by the pipeline for the plan of --profile devices")
    args = ap.parse_args()

    base_profiles = [parse_profile_arg(p) for p in (args.profile or [str(SHIPPED)])]
    base = base_profiles[0]
    link = parse_link(args.link)
    setup = {
        "cores": os.cpu_count(), "machine": platform.machine(), "threads": args.threads,
        "load_avg_1m": os.getloadavg()[0], "numpy": np.__version__,
        "profile": base.device_id, "model": base.model.identity, "link": link.describe(),
        "devices": "shipped profile scaled by speeds " + ", ".join(f"{s:g}" for s in SPEEDS)
                   + " and memory " + ", ".join(f"{m}" for m in MEMORY_GIB) + " GiB",
    }
    print("planner benchmark")
    for k, v in setup.items():
        print(f"  {k}: {v}")
    result: dict = {"setup": setup}

    seqs = (512,) if args.quick else (512, 1024, 2048)
    print("\nplanning time (median of %d): layer DP alone, then layer DP + full cut table" %
          (1 if args.quick else args.reps))
    result["planning"] = planning_times(base, link, seqs, (2, 3, 4, 8), 1 if args.quick else args.reps)

    print("\nsequence DP, vectorised vs plain-Python loop (same recurrence, same table):")
    vl = vectorised_vs_loop(base, 256 if not args.quick else 128)
    print(f"  S_max={vl['max_seq']} k<={vl['k_max']}: vectorised {vl['vectorised_s'] * 1e3:.1f} ms, "
          f"loop {vl['loop_s'] * 1e3:.0f} ms, speedup x{vl['speedup']:.0f}, identical={vl['identical']}")
    result["vectorised_vs_loop"] = vl

    print("\nplanned vs equal chunks and vs no chunking (predicted TTFT, 4-device home):")
    profs = home(base, 4)
    plan = make_plan(profs, link, 2048)
    cmp_rows = []
    for y in (256, 700, 1500, 2048):
        k = len(plan.cut_table.lookup(y)) + 1
        eq = tuple(int(c) for c in np.linspace(0, y, k + 1)[1:-1].round())
        planned = plan.cut_table.predicted_latency_s(y)
        equal = predict_prefill_s(plan, profs, y, eq)
        single = predict_prefill_s(plan, profs, y, ())
        cmp_rows.append({"prompt_len": y, "chunks": k, "planned_s": planned, "equal_s": equal,
                         "unchunked_s": single})
        print(f"  prompt {y:5d}: planned {k:2d} chunks {planned:6.3f} s | equal {k} chunks "
              f"{equal:6.3f} s (x{equal / planned:.3f}) | one chunk {single:6.3f} s "
              f"(x{single / planned:.2f})")
    result["chunking"] = cmp_rows

    if not args.skip_measure:
        print(f"\npredicted vs measured prefill, one device, in-process, {args.threads} thread(s):")
        lengths = (256, 1024) if args.quick else (256, 1024, 2048)
        result["prediction"] = measure_prefill(base, lengths, args.threads, (1, 4))

    if args.measured_ttft:
        plan = make_plan(base_profiles, link, 2048)
        result["pipeline"] = []
        for item in args.measured_ttft:
            y, _, s = item.partition("=")
            row = measured_vs_predicted(plan, base_profiles, int(y), float(s))
            result["pipeline"].append(row)
            print(f"  pipeline prompt {row['prompt_len']}: predicted {row['predicted_s']:.3f} s, "
                  f"measured {row['measured_s']:.3f} s, error {row['rel_error'] * 100:+.1f}%")

    if args.json:
        from bench._common import emit_json

        emit_json(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
