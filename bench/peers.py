"""meshd against llama.cpp on the same GGUF files, one core each (issue #30).

What a user with one good device compares us with: llama.cpp (or Ollama, which is
llama.cpp) on that device. For each model and numeric mode this prints, measured
side by side in one run, each engine pinned to the same core with one thread:

- prefill of 512 tokens and decode of 64 tokens from an empty context (what
  ``llama-bench -t 1 -p 512 -n 64`` measures), tokens/s;
- the decode of a 2-device mesh (two stage processes, one core each, CurveZMQ
  between them) — decode through a pipeline is never faster than one device,
  so this is the figure a home actually gets per answer token;
- resident memory of the stage over the GGUF bytes it holds (anonymous RSS, KV
  excluded), and whether the packed 2-stage mesh gives the single device's tokens;
- fidelity against float32: perplexity on ``tests/data/fidelity.txt`` and the
  share of its positions whose greedy token equals float32's (teacher forced).

llama.cpp comes from ``bench/build_llama_cpp.sh`` (its cache, or ``--llama-cpp DIR``;
``--build-llama-cpp`` builds it, ~10 min). Without it the figures recorded on this
machine class are shown instead, marked so.

    python bench/peers.py --quick          # embedded model + Qwen2.5-Coder-0.5B, packed (<= 5 min)
    python bench/peers.py --json           # every pulled catalog model, packed and packed4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._common import finish, machine_banner  # noqa: E402
from bench._fidelity import FIDELITY_TEXT, fidelity  # noqa: E402
from decoding.memory import freeze_long_lived, release_free_memory  # noqa: E402

LLAMA_PREFIX = Path.home() / ".cache" / "meshd-anchors" / "llama.cpp"
MODELS = ("smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct")
#: llama-bench -t 1 -p 512 -n 64 on this machine class (Intel Xeon VM, AVX-512, 2 vCPUs; llama.cpp
#: built by bench/build_llama_cpp.sh, AMX off), for runs where llama.cpp is not built. tokens/s.
#: (bench/results/peers.json, 2026-11-25: 3 repeats each)
RECORDED_LLAMA_CPP = {
    "smollm2-135m-instruct": {"prefill": 157.2, "decode": 48.52},
    "qwen2.5-coder-0.5b-instruct": {"prefill": 110.31, "decode": 13.78},
    "qwen2.5-coder-1.5b-instruct": {"prefill": 49.09, "decode": 6.87},
}


def model_path(name: str) -> Path | None:
    from meshd.model import store as model_store

    if name == MODELS[0]:
        if not model_store.is_pulled():
            return None
        return Path(model_store.open_model(None).path)
    try:
        return Path(model_store.open_model(name).path)
    except Exception:  # noqa: BLE001 - not pulled here
        return None


# -- llama.cpp ------------------------------------------------------------------------------------

def llama_cpp_dir(arg: str | None, build: bool) -> Path | None:
    if arg:
        return Path(arg)
    bin_dir = LLAMA_PREFIX / "build" / "bin"
    if (bin_dir / "llama-bench").exists():
        return bin_dir
    if build:
        out = subprocess.run(["bash", str(ROOT / "bench" / "build_llama_cpp.sh")], capture_output=True, text=True)
        if out.returncode == 0:
            return Path(out.stdout.strip().splitlines()[-1])
        print(f"llama.cpp build failed:\n{out.stderr[-2000:]}", file=sys.stderr)
    return None


def llama_bench(bin_dir: Path, gguf: Path, core: int, prefill: int, decode: int, reps: int) -> dict:
    cmd = ["taskset", "-c", str(core), str(bin_dir / "llama-bench"), "-m", str(gguf), "-t", "1",
           "-p", str(prefill), "-n", str(decode), "-r", str(reps), "-o", "json"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    rows = json.loads(out.stdout)
    by = {("prefill" if r["n_prompt"] else "decode"): float(r["avg_ts"]) for r in rows}
    return {"prefill": by.get("prefill"), "decode": by.get("decode"), "recorded": False}


def median_rates(runs: list[dict], keys: tuple[str, ...]) -> dict:
    """The last run's figures with each of ``keys`` replaced by its median over ``runs``."""
    out = dict(runs[-1])
    for k in keys:
        vals = [r[k] for r in runs if r.get(k)]
        out[k] = statistics.median(vals) if vals else None
        out[f"{k}_rounds"] = [round(v, 2) for v in vals]
    return out


# -- meshd, one device (a child process: its own RSS, pinned) -------------------------------------

def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def child_measure(args) -> None:
    """One model in one mode on one core: prefill, decode, memory. Prints one JSON line."""
    import torch

    os.sched_setaffinity(0, {args.core})
    torch.set_num_threads(1)
    from decoding.device import resolve_weights
    from decoding.loader import open_model

    def rss_kb() -> int:  # heap and mapped file pages alike: the gguf mode's weights are the file's pages
        return _status_kb("RssAnon") + _status_kb("RssFile")

    anon0 = rss_kb()
    src = open_model(args.model_file)
    cfg = src.config
    release_free_memory()
    anon_open = rss_kb()  # the interpreter, torch and the GGUF reader's metadata: not the stage's
    dtype, packing = resolve_weights(args.mode, torch.device("cpu"))
    t = time.perf_counter()
    stage = src.load_stage(0, cfg.num_layers, dtype, packed=packing)
    load_s = time.perf_counter() - t
    release_free_memory()
    freeze_long_lived()  # as a daemon's stage worker does after a load
    resident = (rss_kb() - anon_open) * 1024  # the stage's weights, as loaded (mapped pages: as touched)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, min(cfg.vocab_size, 30000), (args.prefill,), generator=gen)
    kv = stage.new_cache(args.prefill + args.decode + 8)
    kv.create("s", args.prefill + args.decode + 8)
    prefill_s, decode_s = [], []
    for rep in range(args.reps + 1):
        kv.truncate("s", 0)
        t = time.perf_counter()
        stage.forward(kv, "s", prompt, all_logits=False)
        if rep:
            prefill_s.append(time.perf_counter() - t)
        kv.truncate("s", 0)
        x = prompt[:1]
        stage.forward(kv, "s", x)  # the first token: not timed (llama-bench warms up likewise)
        t = time.perf_counter()
        for _ in range(args.decode):
            x = stage.forward(kv, "s", x)[-1].argmax().view(1)
        if rep:
            decode_s.append(time.perf_counter() - t)
    kv_bytes = kv.bytes_per_token() * (args.prefill + args.decode + 8)
    scratch = stage.scratch.nbytes if stage.scratch is not None else 0
    release_free_memory()
    serving = (rss_kb() - anon_open) * 1024  # after prefill and decode: + KV, scratch, activations
    print(json.dumps({
        "prefill_tok_s": args.prefill / statistics.median(prefill_s),
        "decode_tok_s": args.decode / statistics.median(decode_s),
        "weight_bytes": stage.weight_bytes(), "resident_bytes": resident, "serving_bytes": serving,
        "scratch_bytes": scratch, "reader_bytes": (anon_open - anon0) * 1024, "process_bytes": rss_kb() * 1024,
        "kv_bytes": kv_bytes, "load_s": load_s, "formats": _format_counts(stage.formats),
    }))


def _format_counts(formats: dict) -> dict:
    counts: dict[str, int] = {}
    for v in formats.values():
        counts[v] = counts.get(v, 0) + 1
    return counts


def measure_meshd(path: Path, mode: str, core: int, prefill: int, decode: int, reps: int, env: dict | None = None) -> dict:
    cmd = [sys.executable, __file__, "--_child", "--model-file", str(path), "--mode", mode, "--core", str(core),
           "--prefill", str(prefill), "--decode", str(decode), "--reps", str(reps)]
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})
    if out.returncode != 0:
        raise RuntimeError(f"meshd measurement failed ({mode}, {path.name}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# -- meshd, a 2-device mesh -----------------------------------------------------------------------

async def mesh_two(path: Path, mode: str, decode: int, reps: int, prompts: list[str]) -> dict:
    """Decode tokens/s of two stage processes (cores 0 and 1) and whether they give one device's tokens:
    chat prompts (uncut) and a 300-token text prompt pipelined in sub-sequences cut as a packed home cuts."""
    import torch

    from decoding.device import resolve_weights
    from decoding.generate import generate
    from decoding.loader import open_model
    from decoding.pipeline_local import LocalPipeline, even_split
    from decoding.sampling import SamplingSpec
    from decoding.batch import EXACT_BLOCK
    from decoding.device import PACKINGS
    from meshd.pipeline.coordinator.cuts import aligned_cuts, default_cuts
    from tests.support.coordinator import generate_on
    from tests.support.proc_mesh import ProcessMesh

    src = open_model(path)
    tok = src.tokenizer
    ranges = even_split(src.config.num_layers, 2)
    rates, mismatches = [], []
    from bench._cold import CacheGuard

    async with ProcessMesh(ranges, model=str(path), cores=[[0], [1]], threads=1, weights=mode) as mesh:
        guard = CacheGuard(mesh.reused_tokens)
        ids = tok.encode("Once upon a time")  # shorter than any prefix the cache reuses: every rep is cold
        for r in range(reps + 1):
            stamps = []
            async with guard.cold(f"mesh decode rep {r}"):
                async for _ in generate_on(mesh.coord, f"d{r}", ids, 1 + decode, SamplingSpec(), ()):
                    stamps.append(time.perf_counter())
            if r and len(stamps) > 1:
                rates.append((len(stamps) - 1) / (stamps[-1] - stamps[0]))
        mesh_tokens = {}
        for i, p in enumerate(prompts):
            ids = prompt_ids(tok, p)
            cuts = aligned_cuts(default_cuts(len(ids), 2), len(ids), EXACT_BLOCK) if mode in PACKINGS else None
            got = [t async for t in generate_on(mesh.coord, f"p{i}", ids, 32, SamplingSpec(), tok.eos_ids,
                                                cuts=cuts)]
            mesh_tokens[p] = [t for t in got if t not in tok.eos_ids]
    torch.set_num_threads(1)
    dtype, packing = resolve_weights(mode, torch.device("cpu"))
    one = LocalPipeline([src.load_stage(0, src.config.num_layers, dtype, packed=packing)])
    for p in prompts:
        want = generate(one, prompt_ids(tok, p), 32, eos_ids=tok.eos_ids).token_ids
        if mesh_tokens[p] != want:
            mismatches.append(p[:40])
    return {"decode_tok_s": statistics.median(rates) if rates else None, "parity": not mismatches,
            "mismatches": mismatches, "checked": len(prompts)}


def prompt_ids(tok, prompt: str) -> list[int]:
    """A chat turn for a question; raw text (a long prompt, pipelined in cut sub-sequences) otherwise."""
    if prompt.startswith("TEXT:"):
        return list(tok.encode(prompt[5:]))[:300]
    return tok.apply_chat([{"role": "user", "content": prompt}])


# -- crossover of the two packed regimes ---------------------------------------------------------

def crossover(rows=(1, 4, 8, 16, 24, 32, 48, 64, 128)) -> dict:
    """ms of the int4 kernel vs widening + bfloat16 matmul, by row count (a 1.5B MLP matrix, one core)."""
    import torch

    from decoding.quant.groups import requantize
    from decoding.quant.packed import PackedLinear

    torch.set_num_threads(1)
    layer = PackedLinear(requantize(torch.randn(8960, 1536) * 0.02))
    out = {}
    for m in rows:
        x = torch.randn(m, 1536).bfloat16()
        kernel = lambda: layer(x, dense=False)  # noqa: E731
        widen = lambda: layer(x, dense=True)  # noqa: E731
        out[m] = {name: round(min(_time(fn) for _ in range(3)) * 1e3, 2) for name, fn in
                  (("int4_kernel_ms", kernel), ("widen_dense_ms", widen))}
    return out


def _time(fn) -> float:
    fn()
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


# -- the run ---------------------------------------------------------------------------------------

AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def avx2_pass(args, names, modes, reps, prompts, native_rows) -> dict:
    """The same figures on a home CPU's instruction set: torch and oneDNN capped at AVX2 (meshd's own
    kernels use AVX2 at most anyway) against llama.cpp built for AVX2 without AVX-512. On a CPU that has
    no AVX-512 the native pass already is that run, and is reported as such."""
    from partition.machine import cpu_flags

    if "avx512f" not in cpu_flags():
        return {"same_as_native": True, "why": "this CPU has no AVX-512: the native pass ran at AVX2",
                "env": AVX2_ENV, "models": native_rows}
    bin_dir = None
    prefix = LLAMA_PREFIX.with_name("llama.cpp-avx2")
    if (prefix / "build" / "bin" / "llama-bench").exists():
        bin_dir = prefix / "build" / "bin"
    elif args.build_llama_cpp:
        out = subprocess.run(["bash", str(ROOT / "bench" / "build_llama_cpp.sh")], capture_output=True, text=True,
                             env={**os.environ, "LLAMA_CPP_ISA": "avx2"})
        bin_dir = Path(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else None
    if bin_dir is None:
        print("AVX2 pass: llama.cpp's AVX2 build is absent (LLAMA_CPP_ISA=avx2 bench/build_llama_cpp.sh); "
              "its figures are the native build's", flush=True)
        bin_dir = llama_cpp_dir(args.llama_cpp, False)
    print(f"AVX2 pass (meshd under {AVX2_ENV}, llama.cpp {bin_dir}):", flush=True)
    # no mesh here: its reference would be computed in this process, whose torch already runs uncapped
    rows, _, _ = models_pass(args, names, modes, reps, bin_dir, prompts, env=AVX2_ENV, with_fidelity=False,
                             with_mesh=False)
    return {"same_as_native": False, "env": AVX2_ENV, "llama_cpp": str(bin_dir), "models": rows}


def models_pass(args, names, modes, reps, bin_dir, prompts, env: dict, with_fidelity: bool = True,
                with_mesh: bool = True):
    """Every model in every mode against llama.cpp (``bin_dir``), meshd's children run with ``env`` (an
    ISA cap); returns (rows, whether every mesh gave one device's tokens, fidelity by model)."""
    rows, parity_all, fid = [], True, {}
    for name in names:
        path = model_path(name)
        if path is None:
            print(f"{name}: not pulled here (meshd model pull {name}); skipped", flush=True)
            continue
        gguf_bytes = path.stat().st_size
        # llama.cpp and meshd take turns, round after round, and each rate is the median of its rounds:
        # a VM's speed drifts by tens of percent over minutes, which measuring one after the other
        # would put into the ratio
        refs, runs = [], {mode: [] for mode in modes}
        for _ in range(args.rounds):
            if bin_dir is not None:
                refs.append(llama_bench(bin_dir, path, 0, args.prefill, args.decode, reps))
            for mode in modes:
                runs[mode].append(measure_meshd(path, mode, 0, args.prefill, args.decode, reps, env))
        ref = median_rates(refs, ("prefill", "decode")) if refs else \
            {**RECORDED_LLAMA_CPP.get(name, {}), "recorded": True}
        print(f"{name}: llama.cpp prefill {ref['prefill']} decode {ref['decode']} tok/s"
              f"{' (recorded)' if ref['recorded'] else f' (median of {args.rounds} rounds)'}", flush=True)
        for mode in modes:
            m = median_rates(runs[mode], ("prefill_tok_s", "decode_tok_s"))
            mesh = None if args.no_mesh or not with_mesh else asyncio.run(mesh_two(path, mode, args.decode, reps * args.rounds, prompts))
            if mesh is not None:
                parity_all &= mesh["parity"]
            row = {"model": name, "mode": mode, "meshd_prefill_tok_s": round(m["prefill_tok_s"], 2),
                   "meshd_decode_tok_s": round(m["decode_tok_s"], 2),
                   "mesh2_decode_tok_s": None if mesh is None or mesh["decode_tok_s"] is None
                   else round(mesh["decode_tok_s"], 2),
                   "llamacpp_prefill_tok_s": ref["prefill"], "llamacpp_decode_tok_s": ref["decode"],
                   "llamacpp_recorded": ref["recorded"],
                   "rounds": {"meshd_decode": m.get("decode_tok_s_rounds"), "llamacpp_decode": ref.get("decode_rounds"),
                              "meshd_prefill": m.get("prefill_tok_s_rounds"),
                              "llamacpp_prefill": ref.get("prefill_rounds")},
                   # what the stage holds once it has served (mapped weights count once touched), KV excluded
                   "rss_over_gguf": round(max(m["resident_bytes"], m["serving_bytes"] - m["kv_bytes"]) / gguf_bytes, 3),
                   "load_rss_over_gguf": round(m["resident_bytes"] / gguf_bytes, 3), "load_s": round(m["load_s"], 2),
                   "serving_rss_over_gguf_plus_kv": round(m["serving_bytes"] / (gguf_bytes + m["kv_bytes"]), 3),
                   "weights_over_gguf": round(m["weight_bytes"] / gguf_bytes, 3),
                   "gguf_mb": round(gguf_bytes / 1e6, 1), "scratch_mb": round(m["scratch_bytes"] / 1e6, 1),
                   "gguf_reader_mb": round(m["reader_bytes"] / 1e6, 1),
                   "formats": m["formats"], "mesh2_parity": None if mesh is None else mesh["parity"]}
            for key in ("prefill", "decode"):
                if ref[key]:
                    row[f"{key}_vs_llamacpp"] = round(row[f"meshd_{key}_tok_s"] / ref[key], 3)
            if ref["decode"] and row["mesh2_decode_tok_s"]:
                row["mesh2_decode_vs_llamacpp"] = round(row["mesh2_decode_tok_s"] / ref["decode"], 3)
            rows.append(row)
            print(f"  {mode}: prefill {row['meshd_prefill_tok_s']} ({row.get('prefill_vs_llamacpp')}x), decode "
                  f"{row['meshd_decode_tok_s']} ({row.get('decode_vs_llamacpp')}x), 2-device mesh decode "
                  f"{row['mesh2_decode_tok_s']} ({row.get('mesh2_decode_vs_llamacpp')}x), resident "
                  f"{row['rss_over_gguf']}x the GGUF, mesh parity {row['mesh2_parity']}", flush=True)
        if with_fidelity:
            fid[name] = fidelity(path, modes)
            for mode, r in fid[name]["modes"].items():
                print(f"  fidelity {mode}: perplexity {r['perplexity']:.3f} ({r['perplexity_gap']:+.2%} vs float32), "
                      f"top-1 agreement {r['top1_agreement']:.3f}", flush=True)
    return rows, parity_all, fid


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="embedded + 0.5B models, packed only, 1 rep (<= 5 min)")
    ap.add_argument("--json", action="store_true", help="print one JSON object last")
    ap.add_argument("--out", default=None, help="also write the JSON here (indented)")
    ap.add_argument("--models", default=None, help=f"comma list of {', '.join(MODELS)} (default: the pulled ones)")
    ap.add_argument("--modes", default=None, help="comma list of numeric modes (default: this CPU's default mode and "
                    "packed; quick: the default mode)")
    ap.add_argument("--no-avx2", action="store_true", help="skip the second pass under AVX2 emulation")
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--reps", type=int, default=None, help="repetitions per round (default 1)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds in which llama.cpp and meshd take turns "
                    "(default 3; quick: 1)")
    ap.add_argument("--llama-cpp", default=None, help="directory holding llama-bench (default: the build cache)")
    ap.add_argument("--build-llama-cpp", action="store_true", help="build llama.cpp first if absent (~10 min)")
    ap.add_argument("--no-mesh", action="store_true", help="skip the 2-device mesh")
    ap.add_argument("--no-fidelity", action="store_true", help="skip perplexity and agreement")
    ap.add_argument("--_child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model-file", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="packed", help=argparse.SUPPRESS)
    ap.add_argument("--core", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._child:
        args.reps = args.reps or 1
        child_measure(args)
        return 0
    reps = args.reps or 1
    args.rounds = args.rounds or (1 if args.quick else 3)
    if args.rounds < 1 or reps < 1:
        ap.error("--rounds and --reps must be at least 1")
    names = args.models.split(",") if args.models else (list(MODELS[:2]) if args.quick else list(MODELS))
    from decoding.device import default_cpu_mode

    default = default_cpu_mode()
    modes = args.modes.split(",") if args.modes else ([default] if args.quick else list(dict.fromkeys([default, "packed"])))
    bin_dir = llama_cpp_dir(args.llama_cpp, args.build_llama_cpp)
    setup = {**machine_banner(), "threads_per_device": 1, "cores": "meshd and llama.cpp on core 0 in turn; "
             "the 2-device mesh on cores 0 and 1", "prefill_tokens": args.prefill, "decode_tokens": args.decode,
             "reps": reps, "rounds": args.rounds, "default_mode": default, "llama_cpp": str(bin_dir) if bin_dir else "absent: recorded figures"}
    print("setup:", json.dumps(setup), flush=True)
    if bin_dir is None:
        print("llama.cpp is not built here (bench/build_llama_cpp.sh, or --build-llama-cpp): comparing with the "
              "figures recorded on this machine class", flush=True)
    prompts = ["What is the capital of France?", "Name three primary colours.",
               "Turn off the kitchen lights, please.", "TEXT:" + FIDELITY_TEXT.read_text()]
    rows, parity_all, fid = models_pass(args, names, modes, reps, bin_dir, prompts, env={},
                                        with_fidelity=not args.no_fidelity)
    avx2 = None if args.no_avx2 else avx2_pass(args, names, modes, reps, prompts, rows)
    cross = crossover() if not args.quick else None
    if cross:
        print("packed regimes by row count (ms):", json.dumps(cross), flush=True)
    result = {"setup": setup, "cpu": setup["cpu"], "flags": setup["flags"], "models": rows,
              "parity": parity_all if not args.no_mesh else None, "fidelity": fid, "crossover": cross, "avx2": avx2}
    finish(result, args.out, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
