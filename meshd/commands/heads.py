"""``meshd heads``: train and evaluate Medusa self-drafting heads and early-exit heads for a model.

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
    p = sub.add_parser("heads", help="train / evaluate Medusa self-drafting heads and early-exit heads")
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

    x = hs.add_parser("train-exits", help="train early-exit heads (Synera) on the model's own answers",
                      description="Train early-exit heads: the teacher at every answer position is meshd's own "
                                  "runtime's full next-token distribution (float32), so answers are used whole.")
    _common(x)
    x.add_argument("--out", default=None, help="exit heads file to write (default: ./exit-heads.pt)")
    x.add_argument("--layers", default=None,
                   help="exit layers, comma-separated layer counts (default: three spread over the model's last "
                        "quarter, for a home's early exits; with --previews four from its middle on)")
    x.add_argument("--previews", action="store_true",
                   help="heads for a cloud verifier's previews of its verdicts (exits from the model's middle on)")
    x.add_argument("--shortlist", type=int, default=2048, help="tokens an exit may emit (the most frequent)")
    x.add_argument("--minutes", type=float, default=15.0, help="time budget for the whole run")
    x.add_argument("--steps", type=int, default=1500)
    x.add_argument("--batch-size", type=int, default=256)
    x.add_argument("--lr", type=float, default=2e-3)
    x.add_argument("--seed", type=int, default=0)
    x.add_argument("--answers", default=None,
                   help="JSON file of generated answers: reused if it exists, written otherwise")
    x.set_defaults(func=run_train_exits)
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
    from meshd.model.store import open_model, resolve_model

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
        from meshd.model.heads import HEADS_FILE, embedded_heads

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


# -- train-exits ------------------------------------------------------------------------
def run_train_exits(args) -> int:
    """Answers (or ``--answers``), hidden states at the exit layers, training, held-out evaluation."""
    import torch

    from decoding.exits.heads import ExitHeads, default_exit_layers, preview_exit_layers
    from decoding.training import exits as ex
    from decoding.training.recipe import GEN_SHARE, answer_order, load_answers, save_answers
    from meshd.log import get_logger

    bench = _bench(args)
    cfg = bench.cfg
    layers = [int(v) for v in args.layers.split(",")] if args.layers else (
        preview_exit_layers if args.previews else default_exit_layers)(cfg.num_layers)
    heldout_p, train_p = _prompts(args)
    budget = args.minutes * 60.0
    answers = Path(args.answers) if args.answers else None
    if answers is not None and answers.is_file():
        examples = load_answers(answers)
    else:
        examples = bench.answers(answer_order(heldout_p, train_p, args.seed), bench.t0 + GEN_SHARE * budget,
                                 generator=args.generator, gen_batch=args.gen_batch,
                                 max_new_tokens=args.max_new_tokens)
        if answers is not None:
            save_answers(answers, examples)
    train_ex = [e for e in examples if not e.heldout]
    held = [e for e in examples if e.heldout]
    if not train_ex or not held:
        print(f"meshd heads train-exits: {len(train_ex)} training and {len(held)} held-out prompts answered; "
              f"both are needed (give more --minutes)", file=sys.stderr)
        return 1
    shortlist = ex.choose_shortlist(train_ex, args.shortlist, cfg.eos_ids)
    with _bar(total=sum(len(e.prompt_ids) + len(e.answer_ids) for e in examples), desc="hidden", unit="tok") as bar:
        train_set = ex.collect(bench.source, train_ex, layers, shortlist, on_done=bar.update)
        held_set = ex.collect(bench.source, held, layers, shortlist, on_done=bar.update)
    torch.manual_seed(args.seed)
    heads = ExitHeads(layers, cfg.hidden_size, shortlist, num_layers=cfg.num_layers, vocab_size=cfg.vocab_size)
    rows = heads.head_rows(bench.stage.lm_head, torch.float32)
    norm = bench.stage.final_norm.float()
    with _bar(total=args.steps, desc="train", unit="step") as bar:
        def on_step(i, loss):
            bar.update(1)
            if i % 20 == 0:
                bar.set_postfix(loss=f"{loss:.3f}")
        stats = ex.train_exits(heads, train_set, norm, rows, cfg.rms_eps, args.steps, args.batch_size, args.lr,
                               args.seed, deadline=bench.t0 + budget - 20, on_step=on_step)
    with torch.no_grad():  # evaluate exactly what the file will hold (fp16 weights)
        for name in ("w", "b", "other_w"):
            getattr(heads, name).copy_(getattr(heads, name).to(torch.float16).float())
    ev = ex.evaluate(heads, held_set, norm, rows, cfg.rms_eps)
    meta = {"model": bench.model_meta(), "layers": layers, "heldout": ev,
            "training": {"recipe": "self-distilled greedy answers; exits match the full distribution collapsed "
                                   "onto the shortlist + other (soft cross-entropy), backbone frozen",
                         "train_prompts": len(train_ex), "heldout_prompts": len(held),
                         "train_positions": len(train_set), "max_new_tokens": args.max_new_tokens,
                         "optimizer": "AdamW", "seed": args.seed, **stats, "threads": torch.get_num_threads(),
                         "torch": torch.__version__, "seconds_total": round(time.monotonic() - bench.t0, 1)}}
    out = Path(args.out) if args.out else Path("exit-heads.pt")
    sha = heads.save(out, meta)
    get_logger("heads").info("exit_heads_saved", path=str(out), sha256=sha, layers=layers,
                             exit_rate_0_7=ev["thresholds"]["0.7"]["exit_rate"])
    if args.json:
        print(json.dumps({"path": str(out), "sha256": sha, **meta}))
    else:
        print(f"wrote {out} (sha256 {sha}); exits after layers {layers}, shortlist {heads.size} tokens "
              f"({ev['shortlist_mass'] * 100:.1f}% of the held-out probability mass)")
        for thr, row in ev["thresholds"].items():
            print(f"  threshold {thr}: {row['exit_rate'] * 100:5.1f}% of tokens exit {row['by_layer']}, "
                  f"token agreement with the full model {row['token_agreement'] * 100:5.1f}%")
    return 0
