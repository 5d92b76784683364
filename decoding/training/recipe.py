"""The whole Medusa-1 recipe of ``meshd heads train`` inside a time budget.

The model's own greedy answers to the prompt set (in a seeded shuffle, so a
budget cut keeps every category and the held-out share), their hidden states
from the project's runtime, AdamW on the heads with the backbone frozen, then
held-out accuracy, the candidate tree built from it, and a replay of greedy
verification. The budget is split up front (answers get at most GEN_SHARE of
it); the training schedule follows the clock as well as the step count, so it
ends decayed and on time even when a shared machine slows down mid-run.

The command (``meshd.commands.heads``) resolves the model, shows progress and
writes the file; everything here only needs a model source.
"""

from __future__ import annotations

import json
import platform
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from decoding.errors import DrafterError
from decoding.log import get_logger
from decoding.medusa import MedusaHeads
from decoding.training.medusa import TrainConfig, time_one_step, train_heads
from decoding.training.medusa_data import (Example, HiddenSet, Prompt, RuntimeCheck, TransformersGenerator,
                                           chat_prompt_ids, collect_hidden, generate_runtime)
from decoding.training.medusa_eval import evaluate

GEN_SHARE = 0.55       # at most this share of the budget generating answers (more prompts beat more epochs)
EVAL_RESERVE_S = 20.0  # kept back for saving, plus the evaluation's own estimate

log = get_logger("heads")


class Workbench:
    """What training and evaluation both need: the model as one stage, its tokenizer, progress bars.

    ``bar(**tqdm_kwargs)`` makes a progress bar (a context manager with
    ``update`` and ``set_postfix``); ``started`` is when the run's clock began.
    """

    def __init__(self, source, model_path, bar: Callable, started: float | None = None):
        self.t0 = time.monotonic() if started is None else started
        self.source, self.model_path, self.bar = source, model_path, bar
        self.cfg = source.config
        self.tok = source.tokenizer
        self.stage = source.load_stage(0, self.cfg.num_layers, torch.float32)
        self.lm_head = self.stage.lm_head.float()

    def answers(self, prompts: Sequence[Prompt], deadline: float | None, *, generator: str, gen_batch: int,
                max_new_tokens: int) -> list[Example]:
        """Greedy answers, in the order given, until ``deadline`` (held-out prompts come first)."""
        eos = tuple(self.tok.eos_ids)
        ids = [chat_prompt_ids(self.tok, p.text) for p in prompts]
        out: list[Example] = []
        gen = None
        if generator in ("auto", "transformers"):
            try:
                gen = TransformersGenerator(self.model_path)
            except Exception as exc:  # noqa: BLE001 - any failure here means "use the runtime"
                if generator == "transformers":
                    raise
                log.warning("heads_generator_fallback", reason=str(exc)[:200])
        batch = gen_batch if gen is not None else 1
        pad = self.cfg.eos_ids[0] if self.cfg.eos_ids else 0
        with self.bar(total=len(prompts), desc="answers", unit="prompt") as bar:
            for s in range(0, len(prompts), batch):
                if deadline is not None and time.monotonic() > deadline and out:
                    break
                chunk = ids[s:s + batch]
                if gen is not None:
                    res = gen.generate(chunk, max_new_tokens, eos, pad)
                else:
                    res = generate_runtime(self.stage, chunk, max_new_tokens, eos)
                for p, pid, ans in zip(prompts[s:s + batch], chunk, res):
                    out.append(Example(p.id, p.heldout, pid, ans))
                bar.update(len(chunk))
        return out

    def hidden(self, examples: Sequence[Example], num_heads: int, check: RuntimeCheck, desc: str) -> HiddenSet:
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


@dataclass(frozen=True)
class TrainOptions:
    """The knobs of one training run (``meshd heads train``'s flags)."""

    heads: int = 5
    minutes: float = 30.0
    epochs: float = 8.0
    batch_size: int = 128
    lr: float = 1e-3
    steps: int | None = None  # None: fit the budget
    seed: int = 0
    fp32: bool = False
    answers: Path | None = None  # generated answers: reused if the file exists, written otherwise
    prompts_file: str = ""
    generator: str = "auto"
    gen_batch: int = 64
    max_new_tokens: int = 160


@dataclass(frozen=True)
class TrainResult:
    heads: MedusaHeads
    meta: dict  # what the heads file records about the run
    evaluation: dict
    train_prompts: int
    heldout_prompts: int
    train_positions: int
    steps: int
    epochs: float
    seconds: float


def answer_order(heldout: list[Prompt], train: list[Prompt], seed: int) -> list[Prompt]:
    """All prompts in a seeded shuffle: a run cut short by its time budget still covers every
    category and keeps the held-out share, instead of spending its time on held-out prompts."""
    order = heldout + train
    random.Random(seed).shuffle(order)
    return order


def save_answers(path: Path, examples: Sequence[Example]) -> None:
    path.write_text(json.dumps([e.__dict__ for e in examples]))


def load_answers(path: Path) -> list[Example]:
    return [Example(**raw) for raw in json.loads(path.read_text())]


def train(bench: Workbench, heldout_p: list[Prompt], train_p: list[Prompt], opts: TrainOptions) -> TrainResult:
    """Answers, hidden states, training and evaluation, all within ``opts.minutes`` from ``bench.t0``."""
    start, budget = bench.t0, opts.minutes * 60.0
    deadline = start + budget
    t_gen = time.monotonic()
    if opts.answers is not None and opts.answers.is_file():
        examples = load_answers(opts.answers)
    else:
        examples = bench.answers(answer_order(heldout_p, train_p, opts.seed), start + GEN_SHARE * budget,
                                 generator=opts.generator, gen_batch=opts.gen_batch,
                                 max_new_tokens=opts.max_new_tokens)
        if opts.answers is not None:
            save_answers(opts.answers, examples)
    t_gen = time.monotonic() - t_gen
    held = [e for e in examples if e.heldout]
    train_ex = [e for e in examples if not e.heldout]
    if not train_ex or not held:
        raise DrafterError(f"{len(train_ex)} training and {len(held)} held-out prompts were answered within the "
                           f"time budget; both are needed (give more --minutes)")
    t_hid = time.monotonic()
    check = RuntimeCheck()
    train_set = bench.hidden(train_ex, opts.heads, check, "hidden (train)")
    held_set = bench.hidden(held, opts.heads, check, "hidden (held-out)")
    t_hid = time.monotonic() - t_hid
    log.info("heads_data", train_positions=len(train_set), heldout_positions=len(held_set), **check.to_dict())

    cfg = TrainConfig(lr=opts.lr, batch_size=opts.batch_size, seed=opts.seed, bf16=not opts.fp32)
    torch.manual_seed(opts.seed)
    heads = MedusaHeads(opts.heads, bench.cfg.hidden_size)
    step_s = time_one_step(heads, train_set, bench.lm_head, cfg)
    # evaluation runs the heads forward (about a third of a training step per row) on every held-out row
    eval_s = EVAL_RESERVE_S + 0.5 * step_s * len(held_set) / cfg.batch_size
    train_until = deadline - eval_s
    steps = opts.steps
    if steps is None:
        by_epochs = int(opts.epochs * len(train_set) / cfg.batch_size)
        by_time = int(max(0.0, train_until - time.monotonic()) / step_s)
        steps = max(1, min(by_epochs, by_time))
    with bench.bar(total=steps, desc="train", unit="step") as bar:
        def on_step(i, loss):
            bar.update(1)
            if i % 20 == 0:
                bar.set_postfix(loss=f"{loss:.3f}")
        stats = train_heads(heads, train_set, bench.lm_head, steps, cfg, deadline=train_until, on_step=on_step)
    t_eval = time.monotonic()
    with torch.no_grad():  # evaluate exactly what the file will hold (fp16 weights)
        for p in heads.parameters():
            p.copy_(p.to(torch.float16).float())
    ev = evaluate(heads, held_set, bench.lm_head)
    t_eval = time.monotonic() - t_eval
    heads.tree = [tuple(p) for p in ev["tree"]]
    total_s = time.monotonic() - start
    meta = {
        "model": bench.model_meta(),
        "vocab_size": bench.cfg.vocab_size, "hidden_size": bench.cfg.hidden_size, "num_heads": opts.heads,
        "topk_accuracy": ev["topk_accuracy"],
        "heldout": {k: ev[k] for k in ("positions", "top1", "top5", "chain", "built_tree")},
        "training": {
            "recipe": "Medusa-1 (backbone frozen), self-distilled greedy answers",
            "loss": "sum_k 0.8^(k+1) * CE(head_k, x[t+k+2]) over answer positions",
            "prompts_file": opts.prompts_file,
            "prompts_answered": len(examples), "prompts_available": len(heldout_p) + len(train_p),
            "train_prompts": len(train_ex), "heldout_prompts": len(held),
            "train_positions": len(train_set), "max_new_tokens": opts.max_new_tokens,
            "generator": opts.generator, "runtime_check": check.to_dict(),
            "optimizer": "AdamW", "lr": cfg.lr, "schedule": f"linear warm-up {cfg.warmup_fraction:.0%}, cosine",
            "weight_decay": cfg.weight_decay, "batch_size": cfg.batch_size,
            "lm_head_product": "bfloat16" if cfg.bf16 else "float32", "seed": opts.seed,
            **stats, "measured_step_s": round(step_s, 4), "eval_reserve_s": round(eval_s, 1),
            "gen_batch": opts.gen_batch, "gen_share": GEN_SHARE,
            "threads": torch.get_num_threads(), "torch": torch.__version__, "machine": platform.machine(),
            "seconds": {"generate": round(t_gen, 1), "hidden": round(t_hid, 1), "train": stats["seconds"],
                        "eval": round(t_eval, 1), "total": round(total_s, 1)},
            "budget_minutes": opts.minutes,
        },
    }
    return TrainResult(heads, meta, ev, len(train_ex), len(held), len(train_set), stats["steps"], stats["epochs"],
                       total_s)


__all__ = ["EVAL_RESERVE_S", "GEN_SHARE", "TrainOptions", "TrainResult", "Workbench", "answer_order",
           "load_answers", "save_answers", "train"]
