"""What a verify round of N rows costs against one decode step, here and in llama.cpp, on one core.

Speculation pays only where a round's extra rows cost less than the tokens they win: with ``a`` of ``k``
drafted rows accepted on average, a round costs ``1 + r k`` steps for ``1 + a`` tokens, so it pays when
``r < a / k`` (``r``: an extra row's cost in steps). This measures ``r`` for our gguf stage (a chain of
N rows after a ``--context``-token prompt: the rows a prompt-lookup draft sends) and for llama.cpp's own
kernels (``llama-bench -p N -d CONTEXT``: N rows in one pass at that depth), on the same core.

    python bench/verify_rows.py [--model qwen2.5-coder-1.5b-instruct] [--context 3000] [--json] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._common import emit_json, machine_banner, pin  # noqa: E402

ROWS = (1, 2, 3, 4, 8)


def ours(model: str, context: int, reps: int) -> dict[int, float]:
    """Median seconds of a pass of N rows (N = 1: a decode step) at ``context`` positions, gguf mode."""
    import torch

    from meshd.model.store import open_model

    src = open_model(model)
    stage = src.load_stage(0, src.config.num_layers, torch.float32, packed="gguf")
    kv = stage.new_cache(context + 64 * len(ROWS) * (reps + 1))
    kv.create("s", context + 64 * len(ROWS) * (reps + 1))
    ids = torch.randint(100, 20000, (context,), generator=torch.Generator().manual_seed(0))
    for start in range(0, context, 512):
        stage.forward(kv, "s", ids[start:start + 512], all_logits=False)
    out = {}
    for n in ROWS:
        times = []
        for r in range(reps + 1):
            rows = torch.randint(100, 20000, (n,), generator=torch.Generator().manual_seed(n * 100 + r))
            t = time.perf_counter()
            stage.forward(kv, "s", rows, all_logits=False)
            times.append(time.perf_counter() - t)
            kv.truncate("s", kv.length("s") - n)  # the round's rows rejected: the next starts at the same depth
        out[n] = statistics.median(times[1:])
    return out


def llama_cpp(bin_dir: Path, gguf: str, context: int, reps: int) -> dict[int, float] | None:
    bench = bin_dir / "llama-bench"
    if not bench.exists():
        return None
    res = subprocess.run(["taskset", "-c", "0", str(bench), "-m", gguf, "-t", "1", "-n", "0", "-d", str(context),
                          "-p", ",".join(map(str, ROWS)), "-r", str(reps), "-o", "json"], capture_output=True, text=True)
    if res.returncode:
        print(f"llama-bench failed: {res.stderr[-400:]}", file=sys.stderr)
        return None
    return {int(r["n_prompt"]): int(r["n_prompt"]) / float(r["avg_ts"]) for r in json.loads(res.stdout)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--context", type=int, default=3000)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--llama-bin", default=str(Path.home() / ".cache" / "meshd-anchors" / "llama.cpp" / "build" / "bin"))
    ap.add_argument("--quick", action="store_true", help="1,000-token context, 3 reps")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.context, args.reps = 1000, 3
    pin([0], 1)
    from meshd.model.store import open_model

    path = str(open_model(args.model).path)
    setup = {**machine_banner(), "model": Path(path).name, "context": args.context, "threads": 1, "core": 0,
             "mode": "gguf", "llama_bin": args.llama_bin}
    print("setup:", json.dumps(setup), flush=True)
    mine = ours(path, args.context, args.reps)
    theirs = llama_cpp(Path(args.llama_bin), path, args.context, args.reps)
    steps = {n: round(t / mine[1], 3) for n, t in mine.items()}
    lc_steps = None if theirs is None else {n: round(t / theirs[1], 3) for n, t in theirs.items()}
    print("| rows | ours, ms | ours, steps | llama.cpp, ms | llama.cpp, steps |")
    print("|---:|---:|---:|---:|---:|")
    for n in ROWS:
        lc = "–" if theirs is None else f"{1000 * theirs[n]:.1f} | {lc_steps[n]:.2f}"
        print(f"| {n} | {1000 * mine[n]:.1f} | {steps[n]:.2f} | {lc} |")
    row = lambda s: round((s[4] - 1) / 3, 3)  # noqa: E731 - an extra row's cost, from the 4-row round
    out = {"setup": setup, "seconds": {str(n): round(t, 5) for n, t in mine.items()},
           "round_steps": {str(n): s for n, s in steps.items()}, "row_cost": row(steps),
           "llamacpp_seconds": None if theirs is None else {str(n): round(t, 5) for n, t in theirs.items()},
           "llamacpp_round_steps": None if lc_steps is None else {str(n): s for n, s in lc_steps.items()},
           "llamacpp_row_cost": None if lc_steps is None else row(lc_steps)}
    print(f"an extra row costs {out['row_cost']} of a step here, {out['llamacpp_row_cost']} in llama.cpp")
    if args.json:
        emit_json(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
