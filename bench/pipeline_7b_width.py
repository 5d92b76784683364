"""The pipeline with a random-weight Llama of Llama-2-7B's layer width.

SmolLM2-135M is so narrow (hidden 576) that compute per byte sent is small;
the research setting (Jupiter: Llama-2-7B on edge devices) has hidden 4096,
32 heads, FFN 11008. This runs single / naive / equal-chunk pipelines on a
random-weight model of that width with as many layers as this machine's
memory and time allow, to show the compute/communication ratio effect.
Correctness: the mesh's greedy tokens must equal the single device's.

    python bench/pipeline_7b_width.py [--layers 4] [--lens 256,512] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._cold import COLD_UNSEEN, CacheGuard  # noqa: E402
from bench._common import emit_json, machine_banner  # noqa: E402
from bench.pipeline import equal_cuts, measure  # noqa: E402


def build_model(layers: int) -> Path:
    """A random Llama-2-7B-width checkpoint (float32 safetensors), cached under $MESHD_HOME."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from meshd.model.store import meshd_home

    path = meshd_home() / "bench-models" / f"llama2-7b-width-{layers}L"
    if (path / "config.json").is_file():
        return path
    print(f"building {path} (random weights, {layers} layers) ...", file=sys.stderr, flush=True)
    cfg = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_attention_heads=32,
                      num_key_value_heads=32, num_hidden_layers=layers, vocab_size=32000,
                      max_position_embeddings=4096, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
        for n, p in model.named_parameters():
            if "norm" in n:
                p.fill_(1.0)
    tmp = path.with_suffix(".partial")
    model.save_pretrained(tmp, safe_serialization=True)
    tmp.rename(path)
    return path


async def run(args) -> dict:
    import torch

    from decoding.loader import open_model
    from decoding.pipeline_local import even_split
    from decoding.sampling import SamplingSpec
    from tests.support.coordinator import generate_on
    from tests.support.proc_mesh import ProcessMesh

    torch.set_num_threads(1)
    path = build_model(args.layers)
    src = open_model(path)
    lens = [int(x) for x in args.lens.split(",")]
    g = torch.Generator().manual_seed(1)
    prompts = {n: torch.randint(0, src.config.vocab_size, (n,), generator=g).tolist() for n in lens}
    ranges = even_split(src.config.num_layers, args.devices)
    setup = machine_banner() | {
        "model": f"random Llama, hidden 4096, 32 heads, FFN 11008, {args.layers} layers, vocab 32000, float32",
        "devices": args.devices, "layer_ranges": ranges, "threads_per_stage": 1,
        "stage_cores": "stage i pinned to core i % ncpu", "link": "unshaped loopback (CURVE on)",
        "prompt_lengths": lens, "reps": args.reps, "decode_tokens": args.decode_tokens,
        "chunks": f"equal: {args.chunks} chunks (no device profile of this model: no planned cuts)",
        "activation_bytes_per_token": 4096 * 4, "prompts": COLD_UNSEEN,
    }
    print("setup:", json.dumps(setup), flush=True)
    runs = []

    def row(method, n, cuts, res):
        runs.append({"method": method, "prompt_len": n, "chunks": len(cuts) + 1, "ttft_s": res["ttft_s"],
                     "prefill_tokens_per_s": n / res["ttft_s"], "decode_tokens_per_s": res["decode_tokens_per_s"]})
        r = runs[-1]
        print(f"{method:>7} n={n:>5} chunks={r['chunks']:>2} TTFT {r['ttft_s']:.2f}s "
              f"decode {r['decode_tokens_per_s'] or 0:.2f} tok/s", flush=True)

    single_tokens = {}
    vocab = src.config.vocab_size
    async with ProcessMesh([(0, src.config.num_layers)], model=str(path), cores=[[0]], threads=1) as mesh:
        guard = CacheGuard(mesh.reused_tokens)
        for n in lens:
            row("single", n, (), await measure(mesh, guard, f"single n={n}", prompts[n], (), args.decode_tokens,
                                               args.reps, vocab))
            single_tokens[n] = [t async for t in generate_on(mesh.coord, f"s{n}", prompts[n], 8, SamplingSpec(), ())]
    parity = True
    async with ProcessMesh(ranges, model=str(path), cores=[[i % (os.cpu_count() or 1)] for i in range(len(ranges))],
                           threads=1) as mesh:
        guard = CacheGuard(mesh.reused_tokens)
        for n in lens:
            for method, cuts in (("naive", ()), ("equal", equal_cuts(n, args.chunks))):
                row(method, n, cuts, await measure(mesh, guard, f"{method} n={n}", prompts[n], cuts,
                                                   args.decode_tokens, args.reps, vocab))
            got = [t async for t in generate_on(mesh.coord, f"p{n}", prompts[n], 8, SamplingSpec(), (),
                                                cuts=list(equal_cuts(n, args.chunks)))]
            parity = parity and got == single_tokens[n]
    by = {(r["method"], r["prompt_len"]): r for r in runs}
    n = lens[-1]
    summary = {"parity": parity,
               "speedup_vs_single": by[("single", n)]["ttft_s"] / by[("equal", n)]["ttft_s"],
               "speedup_vs_naive": by[("naive", n)]["ttft_s"] / by[("equal", n)]["ttft_s"],
               "key_prompt_len": n, "setup": setup, "runs": runs}
    print(f"\n{args.devices} devices, {n}-token prompt, 7B-width layers: equal-chunk pipeline "
          f"{summary['speedup_vs_single']:.2f}x single, {summary['speedup_vs_naive']:.2f}x naive; "
          f"parity {'OK' if parity else 'FAILED'}")
    return summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--lens", default="256,512")
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--decode-tokens", type=int, default=4)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    summary = asyncio.run(run(args))
    if args.json:
        emit_json(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
