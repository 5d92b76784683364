"""``meshd generate``: single-device (or in-process multi-stage) generation, no daemon.

The reference every distributed path is checked against; ``--stages K --chunks C``
runs the same model as K stages with the prompt in C sub-sequences and must
print the same tokens as ``--stages 1``.
"""

from __future__ import annotations

import json
import sys

from meshd.commands._common import (DTYPES, add_model_args, add_sampling_args, apply_threads,
                                    sampling_from_args)


def register(sub) -> None:
    p = sub.add_parser("generate", help="generate on this device (reference; no daemon)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--raw", action="store_true", help="no chat template: continue the text as given")
    add_model_args(p)
    add_sampling_args(p)
    p.add_argument("--stages", type=int, default=1, help="run as K in-process pipeline stages")
    p.add_argument("--chunks", type=int, default=1, help="prefill the prompt in C sub-sequences")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.set_defaults(func=run)


def run(args) -> int:
    from decoding.generate import generate
    from decoding.pipeline_local import LocalPipeline
    from meshd.model_store import open_model

    apply_threads(args)
    sampling = sampling_from_args(args)
    source = open_model(args.model)
    tok = source.tokenizer
    ids = tok.encode(args.prompt) if args.raw else tok.apply_chat([{"role": "user", "content": args.prompt}])
    pipe = LocalPipeline.from_source(source, args.stages, DTYPES[args.dtype])
    stream = not args.json

    def show(delta: str) -> None:
        sys.stdout.write(delta)
        sys.stdout.flush()

    res = generate(pipe, ids, args.max_tokens, sampling, eos_ids=tok.eos_ids, chunks=args.chunks,
                   tokenizer=tok, on_text=show if stream else None)
    if stream:
        print()
        print(f"[{len(res.token_ids)} tokens, prompt {res.prompt_tokens}, TTFT {res.ttft_s * 1000:.0f} ms, "
              f"{res.tokens_per_s:.1f} tokens/s, stages {res.layer_ranges}, finish {res.finish_reason}]",
              file=sys.stderr)
    else:
        print(json.dumps({
            "text": res.text, "token_ids": res.token_ids, "prompt_tokens": res.prompt_tokens,
            "ttft_s": res.ttft_s, "tokens_per_s": res.tokens_per_s, "finish_reason": res.finish_reason,
            "stages": [list(r) for r in res.layer_ranges], "chunks": args.chunks,
            "model": source.identity,
        }))
    return 0
