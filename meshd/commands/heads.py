"""``meshd heads``: train and evaluate Medusa self-drafting heads for a model.

``train`` runs the whole Medusa-1 recipe inside a time budget (default 30
minutes on a 2-core CPU); the recipe is ``decoding.training.recipe``, imported
only when a heads command runs, so the daemon never loads training code. This
module resolves the model, shows progress and writes the heads file.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

DEFAULT_PROMPTS = Path(__file__).resolve().parent.parent / "data" / "heads_prompts.jsonl"


def register(sub) -> None:
    p = sub.add_parser("heads", help="train / evaluate Medusa self-drafting heads")
    hs = p.add_subparsers(dest="heads_command", metavar="ACTION")

    t = hs.add_parser("train", help="train heads on the model's own answers (backbone frozen)")
    _common(t)
    t.add_argument("--out", default=None, help="heads file to write (default: ./medusa-heads.pt)")
    t.add_argument("--heads", type=int, default=5, help="number of heads K")
    t.add_argument("--minutes", type=float, default=30.0, help="time budget for the whole run")
    t.add_argument("--epochs", type=float, default=8.0, help="at most this many passes over the positions")
    t.add_argument("--batch-size", type=int, default=128)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--steps", type=int, default=None, help="fixed number of steps (default: fit the budget)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--fp32", action="store_true", help="train the LM-head product in float32, not bfloat16")
    t.add_argument("--answers", default=None,
                   help="JSON file of generated answers: reused if it exists, written otherwise")
    t.set_defaults(func=run_train)

    e = hs.add_parser("eval", help="per-head accuracy on the held-out prompts")
    _common(e)
    e.add_argument("--heads", dest="heads_file", default=None,
                   help="heads file (default: the heads shipped for the embedded model)")
    e.add_argument("--limit", type=int, default=None, help="evaluate on the first N held-out prompts only")
    e.set_defaults(func=run_eval)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def _common(p) -> None:
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: the embedded model)")
    p.add_argument("--prompts", default=None, help="JSONL prompt set (default: the one shipped with meshd)")
    p.add_argument("--max-new-tokens", type=int, default=160, help="answer length cap when generating")
    p.add_argument("--generator", choices=["auto", "transformers", "runtime"], default="auto",
                   help="how answers are generated (auto: transformers' batched greedy on the same weights; "
                        "answers are always checked against, and hidden states taken from, meshd's runtime)")
    p.add_argument("--gen-batch", type=int, default=64, help="prompts per batch with the transformers generator")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")


# -- shared steps ----------------------------------------------------------------------
def _bar(**kw):
    from tqdm import tqdm

    return tqdm(file=sys.stderr, dynamic_ncols=True, mininterval=1.0, **kw)


def _bench(args):
    """The model (``--model``, default: the embedded one) as one stage, on ``--threads`` threads."""
    import torch

    from decoding.training.recipe import Workbench
    from meshd.model_store import open_model, resolve_model

    torch.set_num_threads(max(1, args.threads))
    started = time.monotonic()
    model_path = resolve_model(args.model)
    return Workbench(open_model(args.model), model_path, _bar, started)


def _prompts(args):
    """(held-out, training) prompts, in file order."""
    from decoding.training.medusa_data import load_prompts

    prompts = load_prompts(args.prompts or DEFAULT_PROMPTS)
    return [p for p in prompts if p.heldout], [p for p in prompts if not p.heldout]


def _print_eval(ev: dict) -> None:
    print(f"held-out positions: {ev['positions']}")
    for k, (a1, a5) in enumerate(zip(ev["top1"], ev["top5"])):
        print(f"  head {k} (token t+{k + 2}): top-1 {a1 * 100:5.1f}%  top-5 {a5 * 100:5.1f}%")
    for name in ("chain", "built_tree", "shipped_tree"):
        if name not in ev:
            continue
        s = ev[name]
        print(f"  {name:10s} {s['nodes']:2d} nodes: {s['mean_accepted']:.2f} accepted/round "
              f"({s['tokens_per_round']:.2f} tokens per verify round; independence model predicts "
              f"{s['predicted_accepted']:.2f})")


# -- train -----------------------------------------------------------------------------
def run_train(args) -> int:
    from decoding.training.recipe import TrainOptions, train
    from meshd.log import get_logger

    bench = _bench(args)
    heldout_p, train_p = _prompts(args)
    opts = TrainOptions(
        heads=args.heads, minutes=args.minutes, epochs=args.epochs, batch_size=args.batch_size, lr=args.lr,
        steps=args.steps, seed=args.seed, fp32=args.fp32, answers=Path(args.answers) if args.answers else None,
        prompts_file=str(Path(args.prompts or DEFAULT_PROMPTS).name), generator=args.generator,
        gen_batch=args.gen_batch, max_new_tokens=args.max_new_tokens)
    res = train(bench, heldout_p, train_p, opts)
    out = Path(args.out) if args.out else Path("medusa-heads.pt")
    sha = res.heads.save(out, res.meta)
    get_logger("heads").info("heads_saved", path=str(out), sha256=sha, top1=res.evaluation["top1"])
    if not args.json:
        print(f"wrote {out} (sha256 {sha})")
        print(f"{res.train_prompts} train / {res.heldout_prompts} held-out prompts, {res.train_positions} train "
              f"positions, {res.steps} steps ({res.epochs} epochs), {res.seconds / 60:.1f} min in all")
        _print_eval(res.evaluation)
    else:
        print(json.dumps({"path": str(out), "sha256": sha, **res.meta}))
    return 0


# -- eval ------------------------------------------------------------------------------
def run_eval(args) -> int:
    from decoding.medusa import MedusaHeads
    from decoding.training.medusa_data import RuntimeCheck
    from decoding.training.medusa_eval import evaluate

    if args.heads_file:  # a bad file fails before the model loads
        heads = MedusaHeads.load(args.heads_file)
        path = args.heads_file
        bench = _bench(args)
        heads.check_model(vocab_size=bench.cfg.vocab_size, hidden_size=bench.cfg.hidden_size)
    else:
        from meshd.heads import HEADS_FILE, embedded_heads

        embedded_heads()
        bench = _bench(args)
        heads = embedded_heads(vocab_size=bench.cfg.vocab_size, hidden_size=bench.cfg.hidden_size,
                               model_identity=bench.source.identity)
        path = str(HEADS_FILE)
    held, _ = _prompts(args)
    if args.limit is not None:
        held = held[:args.limit]
    examples = bench.answers(held, None, generator=args.generator, gen_batch=args.gen_batch,
                             max_new_tokens=args.max_new_tokens)
    check = RuntimeCheck()
    data = bench.hidden(examples, heads.num_heads, check, "hidden (held-out)")
    ev = evaluate(heads, data, bench.lm_head, shipped_tree=heads.tree)
    result = {"heads": path, "model": bench.source.identity, "heldout_prompts": len(examples),
              "max_new_tokens": args.max_new_tokens, "runtime_check": check.to_dict(),
              "shipped_tree_nodes": len(heads.tree),
              **{k: ev[k] for k in ("positions", "top1", "top5", "topk_accuracy", "chain", "built_tree",
                                    "shipped_tree")},
              "seconds": round(time.monotonic() - bench.t0, 1)}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"heads {path} on {bench.source.identity}: {len(examples)} held-out prompts")
        _print_eval(ev)
    return 0
