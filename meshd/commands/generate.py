"""``meshd generate``: single-device (or in-process multi-stage) generation, no daemon.

The reference every distributed path is checked against; ``--stages K --chunks C``
runs the same model as K stages with the prompt in C sub-sequences and must
print the same tokens as ``--stages 1``. ``--device cuda,cpu --stages 2`` puts
the stages on different devices in this one process (a heterogeneous mesh
without the network).
"""

from __future__ import annotations

import json
import sys

from meshd.commands._common import add_model_args, add_sampling_args, apply_threads, sampling_from_args


def register(sub) -> None:
    p = sub.add_parser("generate", help="generate on this device (reference; no daemon)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--raw", action="store_true", help="no chat template: continue the text as given")
    add_model_args(p)
    add_sampling_args(p)
    p.add_argument("--stages", type=int, default=1, help="run as K in-process pipeline stages")
    p.add_argument("--chunks", type=int, default=1, help="prefill the prompt in C sub-sequences")
    p.add_argument("--speculative", choices=["off", "auto", "lookup", "medusa", "draft_model"], default="off",
                   help="decode in verify rounds drafted this way (output unchanged; off = the reference)")
    p.add_argument("--heads", help="Medusa heads file (default: the heads shipped for the embedded model)")
    p.add_argument("--draft-model", help="draft model (same tokenizer) for --speculative draft_model")
    p.add_argument("--max-candidates", type=int, help="candidates per verify round (default: adaptive)")
    p.add_argument("--typical", action="store_true",
                   help="Medusa typical acceptance at temperature > 0 (LOSSY: changes the output distribution)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.set_defaults(func=run)


def run(args) -> int:
    from decoding.device import dtype_name, resolve_devices, resolve_dtype, resolve_weights
    from decoding.generate import generate
    from decoding.pipeline_local import LocalPipeline
    from meshd.model.store import open_model

    apply_threads(args)
    sampling = sampling_from_args(args)
    devices = resolve_devices(args.device, args.stages)  # before loading anything: a bad --device fails fast
    dtype = None if args.dtype == "auto" else resolve_dtype(args.dtype, devices[0])  # None: each device's own
    packed = ""
    if dtype is None and not (args.weights == "auto" and len(set(devices)) > 1):
        dtype, packed = resolve_weights(args.weights, devices[0])
    source = open_model(args.model)
    tok = source.tokenizer
    ids = tok.encode(args.prompt) if args.raw else tok.apply_chat([{"role": "user", "content": args.prompt}])
    pipe = LocalPipeline.from_source(source, args.stages, dtype, devices, packed)
    stream = not args.json

    def show(delta: str) -> None:
        sys.stdout.write(delta)
        sys.stdout.flush()

    if args.speculative == "off":
        res = generate(pipe, ids, args.max_tokens, sampling, eos_ids=tok.eos_ids, chunks=args.chunks,
                       tokenizer=tok, on_text=show if stream else None)
        spec = None
    else:
        res = _speculative(args, source, pipe, ids, sampling, show if stream else None)
        spec = res.speculative.to_dict()
    if stream:
        print()
        extra = ""
        if spec is not None:
            extra = (f", {args.speculative}: {spec['accepted_per_round']} tokens/round over {spec['rounds']} rounds"
                     + (f" (fell back: {spec['fallback_reason']})" if spec.get("fallback_reason") else ""))
        print(f"[{len(res.token_ids)} tokens, prompt {res.prompt_tokens}, TTFT {res.ttft_s * 1000:.0f} ms, "
              f"{res.tokens_per_s:.1f} tokens/s, stages {res.layer_ranges}, finish {res.finish_reason}{extra}]",
              file=sys.stderr)
    else:
        print(json.dumps({
            "text": res.text, "token_ids": res.token_ids, "prompt_tokens": res.prompt_tokens,
            "ttft_s": res.ttft_s, "tokens_per_s": res.tokens_per_s, "finish_reason": res.finish_reason,
            "stages": [list(r) for r in res.layer_ranges], "chunks": args.chunks,
            "devices": [str(d) for d in pipe.devices], "dtypes": [dtype_name(st.dtype) for st in pipe.stages],
            "model": source.identity, "speculative": spec,
        }))
    return 0


def _speculative(args, source, pipe, ids, sampling, on_text):
    """Speculative generation on this device; a drafter that cannot load falls back with a reason."""
    from decoding.errors import DrafterError
    from decoding.speculative.draft_model import ModelDrafter, check_same_tokenizer
    from decoding.speculative.generate import MedusaSource, speculative_generate
    from decoding.pipeline_local import LocalPipeline
    from meshd.engine.drafting import medusa_heads_for
    from meshd.log import get_logger
    from meshd.model.store import open_model

    drafter, medusa, model_drafter, reason = args.speculative, None, None, None
    if drafter in ("medusa", "auto"):
        try:
            medusa = MedusaSource(medusa_heads_for(source, args.heads), pipe.stages[-1].lm_head)
        except DrafterError as exc:
            if drafter == "medusa":
                raise
            reason = str(exc)
            get_logger("meshd.generate").warning("speculation_fallback", reason=reason)
            drafter = "lookup"
    if drafter == "draft_model":
        if not args.draft_model:
            raise DrafterError("--speculative draft_model needs --draft-model PATH")
        dsrc = open_model(args.draft_model)
        check_same_tokenizer(source.tokenizer, dsrc.tokenizer, draft_name=args.draft_model)
        model_drafter = ModelDrafter(LocalPipeline.from_source(dsrc, 1, device=pipe.devices[0]))
    res = speculative_generate(pipe, ids, args.max_tokens, sampling, eos_ids=source.tokenizer.eos_ids,
                               drafter=drafter, medusa=medusa, model_drafter=model_drafter, typical=args.typical,
                               fixed=args.max_candidates, tokenizer=source.tokenizer, on_text=on_text)
    if reason and res.speculative is not None:
        from dataclasses import replace
        res.speculative = replace(res.speculative, fallback_reason=reason)
    return res
