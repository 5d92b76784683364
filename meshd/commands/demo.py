"""``meshd demo``: the quick-start main job — answer a home question with the embedded model."""

from __future__ import annotations

import json
import socket
import sys

from meshd.commands._common import add_sampling_args

DEMO_PROMPT = ("The living room is at 17°C, the window is open and the heating is off. "
               "In two short sentences: what should I do to warm the room up quickly?")


def register(sub) -> None:
    p = sub.add_parser("demo", help="answer a prompt with the embedded model (quick start)")
    p.add_argument("--prompt", default=DEMO_PROMPT)
    add_sampling_args(p)
    p.set_defaults(max_tokens=96)
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.set_defaults(func=run)


def run(args) -> int:
    from decoding.generate import generate
    from decoding.loader import open_model
    from decoding.pipeline_local import LocalPipeline
    from meshd.commands._common import sampling_from_args

    source = open_model(None)
    tok = source.tokenizer
    ids = tok.apply_chat([{"role": "user", "content": args.prompt}])
    pipe = LocalPipeline.from_source(source, 1)
    if not args.json:
        print(f"> {args.prompt}\n")
    res = generate(pipe, ids, args.max_tokens, sampling_from_args(args), eos_ids=tok.eos_ids,
                   tokenizer=tok, on_text=None if args.json else _stream)
    host = socket.gethostname()
    devices = [{"device": host, "layers": [a, b]} for a, b in res.layer_ranges]
    if args.json:
        print(json.dumps({"text": res.text, "devices": devices, "ttft_s": res.ttft_s,
                          "tokens_per_s": res.tokens_per_s, "tokens": len(res.token_ids),
                          "model": source.identity}))
    else:
        where = ", ".join(f"{d['device']} layers {d['layers'][0]}-{d['layers'][1] - 1}" for d in devices)
        print(f"\n\n[{len(res.token_ids)} tokens | TTFT {res.ttft_s * 1000:.0f} ms | "
              f"{res.tokens_per_s:.1f} tokens/s | {where}]")
    return 0


def _stream(delta: str) -> None:
    sys.stdout.write(delta)
    sys.stdout.flush()
