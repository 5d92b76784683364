"""The key figures of every before/after run in this folder, one table (issue #47's check)."""

import json
import sys
from pathlib import Path

HERE = Path(__file__).parent


def last_json(path: Path) -> dict | None:
    for line in reversed(path.read_text().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                return None
    return None


def figures(bench: str, d: dict) -> dict:
    if bench == "decode":
        p = d["per_drafter"]
        return {"naive tok/s": p["naive"]["tok_s_mean"], "medusa tok/s": p["medusa"]["tok_s_mean"],
                "auto tok/s": p["auto"]["tok_s_mean"], "parity": d["parity"]}
    if bench == "concurrency":
        runs = {k: v["tok_s"] for k, v in d["runs"].items()}
        return {**{k + " tok/s": v for k, v in runs.items() if k.endswith("@4")}, "parity": d["parity"]}
    if bench == "pipeline":
        return {"measured TTFT s": round(d["measured_ttft_s"], 3), "speedup vs single": round(d["speedup_vs_single"], 3),
                "parity": d["parity"]}
    if bench == "soak":
        return {k: (round(d[k], 3) if isinstance(d[k], float) else d[k])
                for k in ("p50_s", "p99_s", "ttft_p50_s", "completed", "lost", "mismatched", "exit_code")}
    if bench == "share":
        return {k: d[k] for k in ("layers_time_to_ready_s", "whole_time_to_ready_s", "local_file_time_to_ready_s",
                                  "parity")}
    if bench == "home_assistant":
        return {k: d.get(k) for k in ("cold_ttft_s", "warm_ttft_median_s", "warm_vs_cold", "warm_vs_new_tokens",
                                      "parity")}
    return {}


def main() -> int:
    rows = []
    for bench in ("decode", "concurrency", "pipeline", "soak", "share", "home_assistant"):
        for f in sorted(HERE.glob(f"{bench}-*-r*.txt")):
            side, rnd = f.stem.split("-")[-2], f.stem.split("-")[-1]
            d = last_json(f)
            rows.append((bench, rnd, side, figures(bench, d) if d else {"no JSON": f.name}))
    for bench, rnd, side, fig in rows:
        print(f"{bench:15s} {rnd} {side:6s} " + "  ".join(f"{k}={v}" for k, v in fig.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
