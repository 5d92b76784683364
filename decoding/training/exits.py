"""Training early-exit heads (``meshd heads train-exits``): the full model teaches its own exits.

The data are the model's own greedy answers to the shipped prompt set (the
same self-distillation the Medusa heads use, ``decoding.training.medusa_data``).
For every answer position the runtime gives the hidden state after each exit
layer and the full model's next-token distribution. The shortlist is the S
tokens the model says most often in its training answers; the target of exit j
is the full distribution collapsed onto the shortlist plus "other" (everything
else), and the loss is the cross-entropy of exit j's S + 1 logits against it.
The backbone, the final norm and the LM head stay frozen: only the residual
blocks and the "other" logits learn.

Evaluation replays the exit rule on held-out answers: at each threshold, where
the first confident exit happens, how often its token equals the full model's,
and how much of the vocabulary mass the shortlist covers.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from decoding.exits.heads import ExitHeads
from decoding.training.medusa_data import Example

THRESHOLDS = (0.6, 0.7, 0.8, 0.9)


@dataclass
class ExitSet:
    """Answer positions: hidden states after each exit layer, the full model's targets and its tokens."""

    hidden: list[torch.Tensor]  # per exit [N, d] float32
    target: torch.Tensor  # [N, S + 1] float32: the full distribution on the shortlist, then "other"
    tokens: torch.Tensor  # [N] the full model's greedy next token

    def __len__(self) -> int:
        return int(self.tokens.numel())


def choose_shortlist(examples: Sequence[Example], size: int, eos_ids: Sequence[int] = ()) -> torch.Tensor:
    """The ``size`` tokens most often in the answers (end-of-answer tokens always in): what an exit may say."""
    counts = Counter(t for e in examples for t in e.answer_ids)
    chosen = [int(t) for t in eos_ids]
    for t, _ in counts.most_common():
        if len(chosen) >= size:
            break
        if t not in chosen:
            chosen.append(int(t))
    return torch.tensor(sorted(chosen), dtype=torch.long)


def collect(source, examples: Sequence[Example], layers: Sequence[int], shortlist: torch.Tensor,
            on_done: Callable[[int], None] | None = None) -> ExitSet:
    """Run each prompt + answer through the runtime in float32, cut at the exit layers."""
    cfg = source.config
    bounds = [0, *layers, cfg.num_layers]
    stages = [source.load_stage(a, b, torch.float32) for a, b in zip(bounds, bounds[1:])]
    hidden: list[list[torch.Tensor]] = [[] for _ in layers]
    targets, tokens = [], []
    for e in examples:
        ids = list(e.prompt_ids) + list(e.answer_ids[:-1])
        if not e.answer_ids:
            continue
        first = len(e.prompt_ids) - 1  # the position whose next token is the answer's first
        x = torch.tensor(ids, dtype=torch.long)
        caches = [s.new_cache(len(ids) + 1) for s in stages]
        for kv in caches:
            kv.create("x", len(ids) + 1)
        for i, (stage, kv) in enumerate(zip(stages, caches)):
            x = stage.forward(kv, "x", x, all_logits=True) if stage.is_last else stage.forward(kv, "x", x)
            if not stage.is_last:
                hidden[i].append(x[first:].float())
        probs = torch.softmax(x[first:].float(), dim=-1)
        short = probs[:, shortlist]
        targets.append(torch.cat([short, (1.0 - short.sum(-1, keepdim=True)).clamp_min(0.0)], dim=-1))
        tokens.append(probs.argmax(-1))
        if on_done:
            on_done(len(ids))
    return ExitSet([torch.cat(h) for h in hidden], torch.cat(targets), torch.cat(tokens))


def exit_loss(heads: ExitHeads, j: int, hidden: torch.Tensor, target: torch.Tensor, final_norm: torch.Tensor,
              rows: torch.Tensor, eps: float) -> torch.Tensor:
    z = heads.logits(j, hidden, final_norm, rows, eps)
    return -(target * F.log_softmax(z, dim=-1)).sum(-1).mean()


def train_exits(heads: ExitHeads, data: ExitSet, final_norm: torch.Tensor, rows: torch.Tensor, eps: float,
                steps: int, batch_size: int = 256, lr: float = 2e-3, seed: int = 0, deadline: float | None = None,
                on_step: Callable[[int, float], None] | None = None) -> dict:
    """AdamW with a cosine schedule, every exit trained on the same batches; returns what the file records."""
    gen = torch.Generator().manual_seed(seed)
    heads.train()
    opt = torch.optim.AdamW(heads.parameters(), lr=lr, weight_decay=0.0)
    n, t0, done, loss_v = len(data), time.monotonic(), 0, float("nan")
    for step in range(steps):
        if deadline is not None and time.monotonic() > deadline:
            break
        for g in opt.param_groups:
            g["lr"] = lr * 0.5 * (1 + math.cos(math.pi * step / max(1, steps)))
        idx = torch.randint(0, n, (min(batch_size, n),), generator=gen)
        loss = sum(exit_loss(heads, j, data.hidden[j][idx], data.target[idx], final_norm, rows, eps)
                   for j in range(len(heads.layers)))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        done, loss_v = step + 1, float(loss.detach()) / len(heads.layers)
        if on_step:
            on_step(step, loss_v)
    heads.eval()
    heads.requires_grad_(False)
    return {"steps": done, "epochs": round(done * batch_size / max(1, n), 2), "final_loss": round(loss_v, 4),
            "seconds": round(time.monotonic() - t0, 1), "batch_size": batch_size, "lr": lr}


@torch.no_grad()
def evaluate(heads: ExitHeads, data: ExitSet, final_norm: torch.Tensor, rows: torch.Tensor, eps: float,
             thresholds: Sequence[float] = THRESHOLDS) -> dict:
    """The exit rule replayed on held-out positions: per threshold, the share of tokens that leave at
    each exit and how often the token that left equals the full model's."""
    n = len(data)
    margins, best, per_exit = [], [], {}
    for j in range(len(heads.layers)):
        p = torch.softmax(heads.logits(j, data.hidden[j], final_norm, rows, eps), dim=-1)
        per_exit[str(heads.layers[j])] = _exit_agreement(heads, p, data.tokens, thresholds)
        top = torch.topk(p, 2, dim=-1)
        other = top.indices[:, 0] == heads.size
        margins.append(torch.where(other, torch.zeros_like(top.values[:, 0]), top.values[:, 0] - top.values[:, 1]))
        best.append(torch.where(other, torch.full_like(top.indices[:, 0], -1), heads.shortlist[
            top.indices[:, 0].clamp_max(heads.size - 1)]))
    covered = float(data.target[:, :-1].sum(-1).mean())
    in_short = float(torch.isin(data.tokens, heads.shortlist).float().mean())
    out = {"positions": n, "shortlist": heads.size, "shortlist_mass": round(covered, 4),
           "shortlist_token_share": round(in_short, 4), "per_exit": per_exit, "thresholds": {}}
    for thr in thresholds:
        left = torch.zeros(n, dtype=torch.bool)
        by_layer, agree = {}, 0
        for j, layer in enumerate(heads.layers):
            now = ~left & (margins[j] >= thr) & (best[j] >= 0)
            by_layer[str(layer)] = round(float(now.float().mean()), 4)
            agree += int((best[j][now] == data.tokens[now]).sum())
            left |= now
        exited = int(left.sum())
        out["thresholds"][str(thr)] = {"exit_rate": round(exited / max(1, n), 4), "by_layer": by_layer,
                                       "agreement_of_exits": round(agree / exited, 4) if exited else None,
                                       "token_agreement": round(1 - (exited - agree) / max(1, n), 4)}
    return out


def _exit_agreement(heads: ExitHeads, p: torch.Tensor, tokens: torch.Tensor, thresholds: Sequence[float]) -> dict:
    """One exit on its own, as a verifier's preview reads it: how often its best token is the full model's,
    and at each confidence (its max probability, "other" never confident) how often it is that sure
    and right when it is."""
    conf, idx = p.max(dim=-1)
    said = torch.where(idx == heads.size, torch.full_like(idx, -1), heads.shortlist[idx.clamp_max(heads.size - 1)])
    right = said == tokens
    out = {"agreement": round(float(right.float().mean()), 4), "at": {}}
    for thr in thresholds:
        sure = (conf >= thr) & (said >= 0)
        out["at"][str(thr)] = {"confident": round(float(sure.float().mean()), 4),
                               "agreement_when_confident": round(float(right[sure].float().mean()), 4)
                               if bool(sure.any()) else None}
    return out


__all__ = ["ExitSet", "THRESHOLDS", "choose_shortlist", "collect", "evaluate", "exit_loss", "train_exits"]
