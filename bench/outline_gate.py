"""What ``outline: auto`` costs a short answer: time to first token, auto against off, side by side.

Setup: the quick start's home (``meshd demo``'s two daemons on loopback, each pinned to its own
core with one torch thread, each lending 120 MiB so the embedded model is split between them),
the OpenAI-compatible API over the first daemon's unix socket, streamed, greedy. Questions: the
one-sentence question the issue measured (6.3-6.9 s to the first token under auto, 0.47 s with
outline off), a "briefly" question, and a list question that auto should still outline (its
cost is the outline's, and it is reported, not judged). Each (question, mode) runs ``--reps``
times, modes alternating; the median is kept. ``usage.outline`` says whether an outline was
written.

    .venv/bin/python bench/outline_gate.py [--quick] [--json] [--reps N]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._common import emit_json, machine_banner  # noqa: E402

QUESTIONS = {
    "one_sentence": ("The living room is at 17°C, the window is open and the heating is off. "
                     "What should I do, in one sentence?"),
    "briefly": "Briefly, why does a heat pump save energy?",
    "list": "What are the main ways to make a house more energy efficient? Give several options.",
}


def run(args) -> dict:
    from meshd.commands.demo import start_home
    from meshd.model.store import resolve_model

    model = str(resolve_model(None))
    root = Path(tempfile.mkdtemp(prefix="meshd-bench-gate-"))
    daemons = []
    rows = []
    try:
        status = start_home(root, model, True, daemons)
        setup = {**machine_banner(), "model": status.get("model"), "devices": 2,
                 "ranges": [s["layers"] for s in status["plan"]["stages"]], "threads_per_daemon": 1,
                 "cores": [[0], [1]], "memory_budget_mb": 120, "api": "OpenAI, unix socket, streamed",
                 "sampling": "greedy", "max_tokens": args.max_tokens, "reps": args.reps,
                 "prompts": "warm, both modes alike: each question asked once untimed first (prefix cache on)"}
        print("# setup", json.dumps(setup), flush=True)
        client = daemons[0].client()
        for name, question in QUESTIONS.items():
            # warm for both modes alike: asked once untimed, every timed request starts on its cached prompt
            for _ in client.chat(question, stream=True, max_tokens=4, temperature=0, outline="off"):
                pass
            for rep in range(args.reps):
                for mode in ("auto", "off") if rep % 2 == 0 else ("off", "auto"):
                    stream = client.chat(question, stream=True, max_tokens=args.max_tokens, temperature=0,
                                         outline=mode)
                    for _ in stream:
                        pass
                    used = ((stream.usage or {}).get("outline") or {}).get("used", False)
                    row = {"question": name, "mode": mode, "rep": rep, "ttft_s": stream.ttft_s,
                           "total_s": stream.elapsed_s, "outline_used": bool(used),
                           "tokens": (stream.usage or {}).get("completion_tokens")}
                    rows.append(row)
                    print(f"{name:>13} {mode:>4} rep {rep}: TTFT {row['ttft_s']:.2f} s, total {row['total_s']:.2f} s, "
                          f"outline {'yes' if used else 'no'}", flush=True)
    finally:
        for d in daemons:
            d.stop()
        shutil.rmtree(root, ignore_errors=True)
    summary = {}
    for name in QUESTIONS:
        per = {}
        for mode in ("auto", "off"):
            mine = [r for r in rows if r["question"] == name and r["mode"] == mode]
            per[mode] = {"ttft_s": statistics.median(r["ttft_s"] for r in mine),
                         "total_s": statistics.median(r["total_s"] for r in mine),
                         "outline_used": sum(r["outline_used"] for r in mine)}
        per["ttft_auto_over_off"] = per["auto"]["ttft_s"] / per["off"]["ttft_s"]
        summary[name] = per
    return {"setup": setup, "questions": summary, "runs": rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 reps each (about 2 minutes)")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "outline_gate.json"))
    args = ap.parse_args()
    args.reps = args.reps or (2 if args.quick else 4)
    out = run(args)
    print("\n| question | TTFT auto | TTFT off | auto/off | outlines written (auto) |")
    print("|---|---|---|---|---|")
    for name, per in out["questions"].items():
        print(f"| {name} | {per['auto']['ttft_s']:.2f} s | {per['off']['ttft_s']:.2f} s | "
              f"{per['ttft_auto_over_off']:.2f} | {per['auto']['outline_used']}/{args.reps} |")
    Path(args.out).write_text(json.dumps(out, indent=1))
    if args.json:
        emit_json({k: v for k, v in out.items() if k != "runs"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
