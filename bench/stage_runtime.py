"""Stage runtime vs transformers' own forward, same weights, same process settings.

For 1 and 2 torch threads (each pinned to as many cores): prefill latency of
64/256/1024-token prompts, decode tokens/s, load time and peak RSS. Each
(implementation, threads) case runs in its own subprocess so RSS and load time
are not polluted by the other. The cases alternate over several rounds in one
invocation and each metric keeps its best round (the least disturbed by other
load on the machine); the table prints ratios (> 1 means meshd is better).

``--device cuda`` runs both implementations on the GPU (float32, like the CPU
runs; timings wait for the GPU with ``torch.cuda.synchronize`` at the end of
each prefill and of the decode loop, never per step). The default is cpu, not
auto: the recorded results are CPU comparisons and must stay comparable.

    python bench/stage_runtime.py [--quick] [--json] [--device cpu|cuda|cuda:N]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._common import emit_json, machine_banner  # noqa: E402

PROMPTS = (64, 256, 1024)


def worker(impl: str, threads: int, decode_tokens: int, reps: int, device: str = "cpu") -> dict:
    from bench._common import median_time, peak_rss_mb, pin

    pin(list(range(threads)), threads)
    import torch

    from decoding.device import resolve_device
    from meshd.model.store import open_model

    dev = resolve_device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    src = open_model(None)
    g = torch.Generator().manual_seed(0)
    prompts = {n: torch.randint(0, src.config.vocab_size, (n,), generator=g).to(dev) for n in PROMPTS}
    t0 = time.perf_counter()
    if impl == "meshd":
        stage = src.load_stage(0, src.config.num_layers, torch.float32, dev)
        load_s = time.perf_counter() - t0

        def prefill(ids):
            kv = stage.new_cache()
            kv.create("s", len(ids) + 1)
            stage.forward(kv, "s", ids, all_logits=False)
            sync()

        def decode(ids, n):
            kv = stage.new_cache()
            kv.create("s", len(ids) + n)
            tok = stage.forward(kv, "s", ids, all_logits=False)[-1].argmax().view(1)
            t = time.perf_counter()
            for _ in range(n):
                tok = stage.forward(kv, "s", tok)[-1].argmax().view(1)
            sync()
            return time.perf_counter() - t
    else:
        import transformers
        from transformers import AutoModelForCausalLM, DynamicCache

        transformers.logging.set_verbosity_error()
        model = AutoModelForCausalLM.from_pretrained(str(src.path.parent), gguf_file=src.path.name,
                                                     dtype=torch.float32).eval().to(dev)
        load_s = time.perf_counter() - t0

        @torch.inference_mode()
        def prefill(ids):
            model(ids.unsqueeze(0), past_key_values=DynamicCache(), use_cache=True, logits_to_keep=1)
            sync()

        @torch.inference_mode()
        def decode(ids, n):
            cache = DynamicCache()
            out = model(ids.unsqueeze(0), past_key_values=cache, use_cache=True, logits_to_keep=1)
            tok = out.logits[0, -1].argmax().view(1, 1)
            t = time.perf_counter()
            for _ in range(n):
                out = model(tok, past_key_values=cache, use_cache=True)
                tok = out.logits[0, -1].argmax().view(1, 1)
            sync()
            return time.perf_counter() - t

    res = {"impl": impl, "threads": threads, "device": str(dev), "load_s": load_s}
    for n, ids in prompts.items():
        res[f"prefill_{n}_s"] = median_time(lambda: prefill(ids), reps if n < 1024 else max(1, reps - 1))
    dt = decode(prompts[64], decode_tokens)
    res["decode_tokens_per_s"] = decode_tokens / dt
    res["peak_rss_mb"] = peak_rss_mb()
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions and decode tokens")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds; best round kept")
    ap.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N: where both implementations run")
    ap.add_argument("--worker", nargs=2, metavar=("IMPL", "THREADS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    decode_tokens, reps = (32, 2) if args.quick else (96, 3)
    if args.worker:
        print(json.dumps(worker(args.worker[0], int(args.worker[1]), decode_tokens, reps, args.device)))
        return 0
    from decoding.device import describe_device, resolve_device
    from decoding.errors import DeviceError

    try:
        device = describe_device(resolve_device(args.device))  # a machine without that device: one line, now
    except DeviceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    threads = [int(t) for t in args.threads.split(",")]
    setup = machine_banner() | {"model": "SmolLM2-135M-Instruct Q4_1 GGUF (dequantised, float32)",
                                "device": device,
                                "threads": threads, "prompt_lengths": list(PROMPTS),
                                "decode_tokens": decode_tokens, "reps": reps,
                                "pinning": "threads=N runs pinned to cores 0..N-1",
                                "rounds": args.rounds, "aggregation": "best of rounds"}
    print("setup:", json.dumps(setup), flush=True)
    rows = []
    for rnd in range(args.rounds):
        for t in threads:
            for impl in ("meshd", "transformers"):
                print(f"round {rnd + 1}/{args.rounds}: {impl} with {t} thread(s)...", file=sys.stderr, flush=True)
                out = subprocess.run([sys.executable, __file__, "--worker", impl, str(t), "--device", args.device]
                                     + (["--quick"] if args.quick else []),
                                     capture_output=True, text=True, check=True)
                rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    by = {}
    for r in rows:
        key = (r["impl"], r["threads"])
        if key not in by:
            by[key] = dict(r)
            continue
        for k, v in r.items():
            if k.endswith("_s"):
                by[key][k] = min(by[key][k], v)
            elif k == "decode_tokens_per_s":
                by[key][k] = max(by[key][k], v)
    comparisons = []
    hdr = f"{'threads':>7} {'metric':<22} {'meshd':>10} {'transformers':>13} {'ratio':>7}"
    print(hdr)
    for t in threads:
        m, h = by[("meshd", t)], by[("transformers", t)]
        for key in [f"prefill_{n}_s" for n in PROMPTS] + ["decode_tokens_per_s", "load_s", "peak_rss_mb"]:
            higher_better = key == "decode_tokens_per_s"
            ratio = (m[key] / h[key]) if higher_better else (h[key] / m[key])
            comparisons.append({"threads": t, "metric": key, "meshd": m[key], "transformers": h[key],
                                "ratio": ratio})
            print(f"{t:>7} {key:<22} {m[key]:>10.3f} {h[key]:>13.3f} {ratio:>7.2f}")
    print("ratio = transformers/meshd for times and memory, meshd/transformers for tokens/s (>1: meshd better)")
    if args.json:
        emit_json({"setup": setup, "results": list(by.values()), "comparisons": comparisons})
    return 0


if __name__ == "__main__":
    sys.exit(main())
