"""``meshd heads``: train and evaluate Medusa self-drafting heads for a model.

``train`` runs the whole Medusa-1 recipe inside a time budget (default 30
minutes on a 2-core CPU): the model's own greedy answers to the shipped prompt
set (in a seeded shuffle, so a budget cut keeps every category and the
held-out share), their hidden states from the project's runtime, AdamW on the
heads with the backbone frozen, then held-out accuracy, the candidate tree
built from it, and a replay of greedy verification. The budget is split up
front (answers get at most GEN_SHARE of it); the training schedule follows the
clock as well as the step count, so it ends decayed and on time even when a
shared machine slows down mid-run.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path

DEFAULT_PROMPTS = Path(__file__).resolve().parent.parent / "data" / "heads_prompts.jsonl"
GEN_SHARE = 0.55       # at most this share of the budget generating answers (more prompts beat more epochs)
EVAL_RESERVE_S = 20.0  # kept back for saving, plus the evaluation's own estimate


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
class _Run:
    """What both actions need: the model as one stage, its tokenizer, the prompts, progress bars."""

    def __init__(self, args):
        import torch

        from meshd.model_store import open_model, resolve_model

        torch.set_num_threads(max(1, args.threads))
        self.args = args
        self.t0 = time.monotonic()
        self.model_path = resolve_model(args.model)
        self.source = open_model(args.model)
        self.cfg = self.source.config
        self.tok = self.source.tokenizer
        self.stage = self.source.load_stage(0, self.cfg.num_layers, torch.float32)
        self.lm_head = self.stage.lm_head.float()

    def bar(self, **kw):
        from tqdm import tqdm

        return tqdm(file=sys.stderr, dynamic_ncols=True, mininterval=1.0, **kw)

    def answers(self, prompts, deadline: float | None):
        """Greedy answers, in the order given, until ``deadline`` (held-out prompts come first)."""
        from decoding.medusa_train import Example, TransformersGenerator, chat_prompt_ids, generate_runtime
        from meshd.log import get_logger

        args, eos = self.args, tuple(self.tok.eos_ids)
        ids = [chat_prompt_ids(self.tok, p.text) for p in prompts]
        out: list[Example] = []
        gen = None
        if args.generator in ("auto", "transformers"):
            try:
                gen = TransformersGenerator(self.model_path)
            except Exception as exc:  # noqa: BLE001 - any failure here means "use the runtime"
                if args.generator == "transformers":
                    raise
                get_logger("heads").warning("heads_generator_fallback", reason=str(exc)[:200])
        batch = args.gen_batch if gen is not None else 1
        pad = self.cfg.eos_ids[0] if self.cfg.eos_ids else 0
        with self.bar(total=len(prompts), desc="answers", unit="prompt") as bar:
            for s in range(0, len(prompts), batch):
                if deadline is not None and time.monotonic() > deadline and out:
                    break
                chunk = ids[s:s + batch]
                if gen is not None:
                    res = gen.generate(chunk, args.max_new_tokens, eos, pad)
                else:
                    res = generate_runtime(self.stage, chunk, args.max_new_tokens, eos)
                for p, pid, ans in zip(prompts[s:s + batch], chunk, res):
                    out.append(Example(p.id, p.heldout, pid, ans))
                bar.update(len(chunk))
        return out

    def hidden(self, examples, num_heads, check, desc):
        from decoding.medusa_train import collect_hidden

        with self.bar(total=sum(len(e.prompt_ids) + len(e.answer_ids) for e in examples),
                      desc=desc, unit="tok") as bar:
            return collect_hidden(self.stage, examples, num_heads, check, on_done=bar.update)

    def model_meta(self) -> dict:
        from decoding.loader.files import sha256_of

        p = Path(self.model_path)
        return {"identity": self.source.identity, "name": p.name,
                "file_sha256": sha256_of(p) if p.is_file() else None,
                "vocab_size": self.cfg.vocab_size, "hidden_size": self.cfg.hidden_size,
                "num_layers": self.cfg.num_layers}


def _prompts(args):
    """(held-out, training) prompts, in file order."""
    from decoding.medusa_train import load_prompts

    prompts = load_prompts(args.prompts or DEFAULT_PROMPTS)
    return [p for p in prompts if p.heldout], [p for p in prompts if not p.heldout]


def _answer_order(heldout_p, train_p, seed: int):
    """All prompts in a seeded shuffle: a run cut short by its time budget still covers every
    category and keeps the held-out share, instead of spending its time on held-out prompts."""
    import random

    order = heldout_p + train_p
    random.Random(seed).shuffle(order)
    return order


def _save_answers(path: Path, examples) -> None:
    path.write_text(json.dumps([e.__dict__ for e in examples]))


def _load_answers(path: Path):
    from decoding.medusa_train import Example

    return [Example(**raw) for raw in json.loads(path.read_text())]


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
    import torch

    from decoding.medusa import MedusaHeads
    from decoding.medusa_train import RuntimeCheck, TrainConfig, evaluate, medusa_loss, train_heads
    from meshd.log import get_logger

    log = get_logger("heads")
    run = _Run(args)
    start, budget = run.t0, args.minutes * 60.0
    deadline = start + budget
    heldout_p, train_p = _prompts(args)
    answers_path = Path(args.answers) if args.answers else None
    t_gen = time.monotonic()
    if answers_path is not None and answers_path.is_file():
        examples = _load_answers(answers_path)
    else:
        examples = run.answers(_answer_order(heldout_p, train_p, args.seed), start + GEN_SHARE * budget)
        if answers_path is not None:
            _save_answers(answers_path, examples)
    t_gen = time.monotonic() - t_gen
    held = [e for e in examples if e.heldout]
    train = [e for e in examples if not e.heldout]
    if not train or not held:
        from decoding.errors import DrafterError

        raise DrafterError(f"{len(train)} training and {len(held)} held-out prompts were answered within the "
                           f"time budget; both are needed (give more --minutes)")
    t_hid = time.monotonic()
    check = RuntimeCheck()
    train_set = run.hidden(train, args.heads, check, "hidden (train)")
    held_set = run.hidden(held, args.heads, check, "hidden (held-out)")
    t_hid = time.monotonic() - t_hid
    log.info("heads_data", train_positions=len(train_set), heldout_positions=len(held_set), **check.to_dict())

    cfg = TrainConfig(lr=args.lr, batch_size=args.batch_size, seed=args.seed, bf16=not args.fp32)
    torch.manual_seed(args.seed)
    heads = MedusaHeads(args.heads, run.cfg.hidden_size)
    step_s = _time_one_step(heads, train_set, run.lm_head, cfg, medusa_loss)
    # evaluation runs the heads forward (about a third of a training step per row) on every held-out row
    eval_s = EVAL_RESERVE_S + 0.5 * step_s * len(held_set) / cfg.batch_size
    train_until = deadline - eval_s
    steps = args.steps
    if steps is None:
        by_epochs = int(args.epochs * len(train_set) / cfg.batch_size)
        by_time = int(max(0.0, train_until - time.monotonic()) / step_s)
        steps = max(1, min(by_epochs, by_time))
    with run.bar(total=steps, desc="train", unit="step") as bar:
        def on_step(i, loss):
            bar.update(1)
            if i % 20 == 0:
                bar.set_postfix(loss=f"{loss:.3f}")
        stats = train_heads(heads, train_set, run.lm_head, steps, cfg, deadline=train_until, on_step=on_step)
    t_eval = time.monotonic()
    with torch.no_grad():  # evaluate exactly what the file will hold (fp16 weights)
        for p in heads.parameters():
            p.copy_(p.to(torch.float16).float())
    ev = evaluate(heads, held_set, run.lm_head)
    t_eval = time.monotonic() - t_eval
    heads.tree = [tuple(p) for p in ev["tree"]]
    total_s = time.monotonic() - start
    meta = {
        "model": run.model_meta(),
        "vocab_size": run.cfg.vocab_size, "hidden_size": run.cfg.hidden_size, "num_heads": args.heads,
        "topk_accuracy": ev["topk_accuracy"],
        "heldout": {k: ev[k] for k in ("positions", "top1", "top5", "chain", "built_tree")},
        "training": {
            "recipe": "Medusa-1 (backbone frozen), self-distilled greedy answers",
            "loss": "sum_k 0.8^(k+1) * CE(head_k, x[t+k+2]) over answer positions",
            "prompts_file": str(Path(args.prompts or DEFAULT_PROMPTS).name),
            "prompts_answered": len(examples), "prompts_available": len(heldout_p) + len(train_p),
            "train_prompts": len(train), "heldout_prompts": len(held),
            "train_positions": len(train_set), "max_new_tokens": args.max_new_tokens,
            "generator": args.generator, "runtime_check": check.to_dict(),
            "optimizer": "AdamW", "lr": cfg.lr, "schedule": f"linear warm-up {cfg.warmup_fraction:.0%}, cosine",
            "weight_decay": cfg.weight_decay, "batch_size": cfg.batch_size,
            "lm_head_product": "bfloat16" if cfg.bf16 else "float32", "seed": args.seed,
            **stats, "measured_step_s": round(step_s, 4), "eval_reserve_s": round(eval_s, 1),
            "gen_batch": args.gen_batch, "gen_share": GEN_SHARE,
            "threads": torch.get_num_threads(), "torch": torch.__version__, "machine": platform.machine(),
            "seconds": {"generate": round(t_gen, 1), "hidden": round(t_hid, 1), "train": stats["seconds"],
                        "eval": round(t_eval, 1), "total": round(total_s, 1)},
            "budget_minutes": args.minutes,
        },
    }
    out = Path(args.out) if args.out else Path("medusa-heads.pt")
    sha = heads.save(out, meta)
    log.info("heads_saved", path=str(out), sha256=sha, top1=ev["top1"])
    if not args.json:
        print(f"wrote {out} (sha256 {sha})")
        print(f"{len(train)} train / {len(held)} held-out prompts, {len(train_set)} train positions, "
              f"{stats['steps']} steps ({stats['epochs']} epochs), {total_s / 60:.1f} min in all")
        _print_eval(ev)
    else:
        print(json.dumps({"path": str(out), "sha256": sha, **meta}))
    return 0


def _time_one_step(heads, data, lm_head, cfg, loss_fn) -> float:
    """Seconds per optimisation step, measured on a scratch copy (two steps after a warm-up)."""
    import copy

    import torch

    from decoding.medusa_train import head_weights

    scratch = copy.deepcopy(heads)
    scratch.requires_grad_(True)
    lm = lm_head.to(torch.bfloat16) if cfg.bf16 else lm_head
    w = head_weights(scratch.num_heads, cfg.decay)
    n = min(cfg.batch_size, len(data))
    times = []
    for _ in range(3):
        t = time.monotonic()
        loss, _ = loss_fn(scratch, data.hidden[:n], data.targets[:n], lm, w, cfg.bf16)
        loss.backward()
        times.append(time.monotonic() - t)
    return max(1e-4, min(times[1:]) * 1.1)  # + optimizer step and batching overhead


# -- eval ------------------------------------------------------------------------------
def run_eval(args) -> int:
    from decoding.medusa import MedusaHeads
    from decoding.medusa_train import RuntimeCheck, evaluate

    if args.heads_file:  # a bad file fails before the model loads
        heads = MedusaHeads.load(args.heads_file)
        path = args.heads_file
        run = _Run(args)
        heads.check_model(vocab_size=run.cfg.vocab_size, hidden_size=run.cfg.hidden_size)
    else:
        from meshd.heads import HEADS_FILE, embedded_heads

        embedded_heads()
        run = _Run(args)
        heads = embedded_heads(vocab_size=run.cfg.vocab_size, hidden_size=run.cfg.hidden_size,
                               model_identity=run.source.identity)
        path = str(HEADS_FILE)
    held, _ = _prompts(args)
    if args.limit is not None:
        held = held[:args.limit]
    examples = run.answers(held, None)
    check = RuntimeCheck()
    data = run.hidden(examples, heads.num_heads, check, "hidden (held-out)")
    ev = evaluate(heads, data, run.lm_head, shipped_tree=heads.tree)
    result = {"heads": path, "model": run.source.identity, "heldout_prompts": len(examples),
              "max_new_tokens": args.max_new_tokens, "runtime_check": check.to_dict(),
              "shipped_tree_nodes": len(heads.tree),
              **{k: ev[k] for k in ("positions", "top1", "top5", "topk_accuracy", "chain", "built_tree",
                                    "shipped_tree")},
              "seconds": round(time.monotonic() - run.t0, 1)}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"heads {path} on {run.source.identity}: {len(examples)} held-out prompts")
        _print_eval(ev)
    return 0
