"""Constrained decoding: llguidance vs xgrammar, per-token mask cost on our real vocabularies.

Structured output (``response_format``, Ollama ``format``) computes a token
mask before every sampled token, so its cost adds to each decode step. This
walks both libraries through the same valid JSON answers (tokenised by the
model's own tokenizer) and times, per token, "compute the mask" + "advance
by the token", plus the one-off grammar compile per request. The models'
own decode step (``LocalEngine``, float32) is timed alongside, so the
overhead is reported as a fraction of a decode step, side by side.

    .venv/bin/python bench/constrained.py [--quick] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench._common import emit_json, machine_banner  # noqa: E402

SCHEMA = {  # the shape of a Home Assistant-style structured answer
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "area": {"enum": ["kitchen", "living room", "bedroom", "garage"]},
        "brightness": {"type": "integer", "minimum": 0, "maximum": 100},
        "on": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "area", "brightness", "on"],
    "additionalProperties": False,
}
ANSWERS = [
    {"name": "ceiling light", "area": "kitchen", "brightness": 80, "on": True, "tags": ["main", "dimmable"]},
    {"name": "reading lamp next to the sofa", "area": "living room", "brightness": 35, "on": False,
     "tags": []},
    {"name": "workbench strip", "area": "garage", "brightness": 100, "on": True,
     "tags": ["led", "outdoor", "motion sensor"]},
]
def _available() -> list[str]:
    import importlib.util

    libs = ["llguidance"]
    if importlib.util.find_spec("xgrammar") is not None:
        libs.append("xgrammar")
    else:
        print("xgrammar is not installed (pip install '.[grammar-compare]'): measuring llguidance only")
    return libs


LIBS = _available()
MODELS = ["embedded", "qwen2.5-coder-0.5b-instruct"]  # "embedded": SmolLM2-135M-Instruct


def hf_tokenizer(source):
    """A transformers fast tokenizer over the model's own tokenizer.json (both libraries take one)."""
    from transformers import PreTrainedTokenizerFast

    tok = source.tokenizer
    return PreTrainedTokenizerFast(tokenizer_object=tok.backend,
                                   eos_token=tok.decode(list(tok.eos_ids), skip_special=False))


def llg_runner(hf, vocab_size: int):
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt

    lltok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab_size)

    def compile_(spec):
        grammar = (llguidance.LLMatcher.grammar_from_json_schema(spec) if spec is not None
                   else llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}))
        return llguidance.LLMatcher(lltok, grammar)

    def walk(m, ids):
        mask = lt.allocate_token_bitmask(1, vocab_size)
        times = []
        for t in ids:
            t0 = time.perf_counter()
            lt.fill_next_token_bitmask(m, mask, 0)
            ok = m.consume_token(t)
            times.append(time.perf_counter() - t0)
            assert ok, m.get_error()
        return times

    return compile_, walk


def xgr_runner(hf, vocab_size: int):
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size)
    compiler = xgr.GrammarCompiler(info, max_threads=1)

    def compile_(spec):
        cg = (compiler.compile_json_schema(json.dumps(spec)) if spec is not None
              else compiler.compile_builtin_json_grammar())
        return xgr.GrammarMatcher(cg)

    def walk(m, ids):
        mask = xgr.allocate_token_bitmask(1, vocab_size)
        times = []
        for t in ids:
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(mask)
            ok = m.accept_token(t)
            times.append(time.perf_counter() - t0)
            assert ok
        return times

    return compile_, walk


def decode_step_s(source, reps: int) -> float:
    """Median time of one decode step of the whole model on this device (float32)."""
    from decoding.pipeline_local import LocalPipeline

    pipe = LocalPipeline.from_source(source, 1, torch.float32)
    pipe.create("b", 64 + reps + 2)
    with torch.inference_mode():
        pipe.prefill("b", list(range(10, 74)))
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            pipe.forward("b", torch.tensor([100], dtype=torch.long))
            times.append(time.perf_counter() - t)
    pipe.free("b")
    return statistics.median(times)


def run_model(name: str, quick: bool) -> dict:
    from meshd.model.store import open_model

    source = open_model(None if name == "embedded" else name)
    vocab = source.config.vocab_size
    hf = hf_tokenizer(source)
    answers = ANSWERS[:1] if quick else ANSWERS
    token_lists = [source.tokenizer.encode(json.dumps(a)) for a in answers]
    out = {"model": name, "vocab_size": vocab, "answer_tokens": sum(map(len, token_lists))}
    for lib, make in (("llguidance", llg_runner), ("xgrammar", xgr_runner)):
        if lib not in LIBS:
            continue
        t = time.perf_counter()
        compile_, walk = make(hf, vocab)
        setup_s = time.perf_counter() - t
        row = {"tokenizer_setup_s": round(setup_s, 3)}
        for kind, spec in (("json_schema", SCHEMA), ("json_object", None)):
            compiles, per_token = [], []
            for ids in token_lists:
                t = time.perf_counter()
                m = compile_(spec)
                compiles.append(time.perf_counter() - t)
                per_token += walk(m, ids)[1:]  # the first mask is part of the request's set-up
            row[kind] = {
                "compile_ms_first": round(compiles[0] * 1e3, 2),
                "compile_ms_median": round(statistics.median(compiles) * 1e3, 2),
                "mask_ms_per_token_median": round(statistics.median(per_token) * 1e3, 4),
                "mask_ms_per_token_p95": round(sorted(per_token)[int(0.95 * (len(per_token) - 1))] * 1e3, 4),
                "tokens": len(per_token),
            }
        out[lib] = row
    step = decode_step_s(source, 8 if quick else 24)
    out["decode_step_ms"] = round(step * 1e3, 2)
    for lib in LIBS:
        for kind in ("json_schema", "json_object"):
            r = out[lib][kind]
            r["overhead_vs_decode_step"] = round(r["mask_ms_per_token_median"] / (step * 1e3), 4)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one answer per model, fewer decode steps")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--models", nargs="*", default=MODELS)
    ap.add_argument("--threads", type=int, default=2, help="torch threads for the decode step")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    banner = machine_banner() | {"threads": args.threads}
    print(f"setup: {banner}")
    import llguidance
    import xgrammar

    from importlib.metadata import version

    versions = {lib: version(lib) for lib in LIBS}
    print(f"libraries: {versions}")
    runs = []
    for name in args.models:
        r = run_model(name, args.quick)
        runs.append(r)
        print(f"\n{name} (vocab {r['vocab_size']}, decode step {r['decode_step_ms']} ms, "
              f"{r['answer_tokens']} answer tokens)")
        print(f"  {'library':<11} {'spec':<12} {'compile ms':>11} {'mask+advance ms/token':>22} "
              f"{'p95':>8} {'of a step':>10}")
        for lib in LIBS:
            for kind in ("json_schema", "json_object"):
                x = r[lib][kind]
                print(f"  {lib:<11} {kind:<12} {x['compile_ms_first']:>11.2f} "
                      f"{x['mask_ms_per_token_median']:>22.4f} {x['mask_ms_per_token_p95']:>8.3f} "
                      f"{x['overhead_vs_decode_step']:>9.1%}")
            print(f"  {lib:<11} tokenizer set-up {r[lib]['tokenizer_setup_s']:.2f} s (once per model)")
    result = {"setup": banner, "libraries": versions, "runs": runs}
    if args.json:
        emit_json(result)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
